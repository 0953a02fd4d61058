"""eval.reference: the PyTorch + PEFT reference trainer's exact semantics."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from peft import get_peft_model_state_dict
from transformers import get_scheduler

from eval.reference import (
    ReferenceRun,
    TrainConfig,
    get_lora_state,
    lora_dropout_modules,
    make_peft_model,
    reference_train,
    set_lora_state,
)
from tiny_models_eval import random_batch, randomize_lora, tiny_gpt2

TARGETS = ["attn.c_attn", "attn.c_proj", "mlp.c_fc"]


def tiny_peft(seed=0, dropout=0.0, n_layer=2):
    base = tiny_gpt2(seed=seed, n_layer=n_layer)
    model = make_peft_model(base, r=4, alpha=8, dropout=dropout, target_modules=TARGETS, fan_in_fan_out=True)
    randomize_lora(model, seed=seed + 100)
    return model


def concat(batches):
    """One padded micro-batch holding all rows of `batches`."""
    width = max(b["input_ids"].shape[1] for b in batches)
    out = {}
    for key, fill in (("input_ids", 0), ("attention_mask", 0), ("labels", -100)):
        rows = [np.pad(b[key], ((0, 0), (0, width - b[key].shape[1])), constant_values=fill) for b in batches]
        out[key] = np.concatenate(rows)
    return out


def labelled(b):
    return int((b["labels"][:, 1:] != -100).sum())


def test_accumulation_equals_one_big_batch():
    rng = np.random.default_rng(0)
    steps = []
    for _ in range(3):
        a = random_batch(rng, [24, 10], width=24, label_frac=0.9)
        b = random_batch(rng, [7, 16, 12], width=16, label_frac=0.3)
        assert labelled(a) != labelled(b)
        steps.append([a, b])
    m1 = tiny_peft()
    m2 = copy.deepcopy(m1)
    cfg = TrainConfig(lr=1e-2, warmup=1, total_steps=3, weight_decay=0.01, clip=1.0)
    r1 = reference_train(m1, steps, cfg)
    r2 = reference_train(m2, [[concat(s)] for s in steps], cfg)
    assert isinstance(r1, ReferenceRun)
    assert len(r1.losses) == len(r1.grad_norms) == len(r1.lrs) == 3
    assert r1.tokens == r2.tokens == sum(labelled(b) for s in steps for b in s)
    np.testing.assert_allclose(r1.losses, r2.losses, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(r1.grad_norms, r2.grad_norms, rtol=1e-5)
    assert r1.lora_state.keys() == r2.lora_state.keys()
    assert set(r1.lora_state) == set(get_peft_model_state_dict(m1))
    start = get_lora_state(tiny_peft())
    moved = 0.0
    for k in r1.lora_state:
        np.testing.assert_allclose(r1.lora_state[k], r2.lora_state[k], rtol=0, atol=1e-6, err_msg=k)
        moved = max(moved, float(np.abs(r1.lora_state[k] - start[k]).max()))
    assert moved > 1e-3   # training actually changed the weights


def test_loss_equals_hf_labels_loss():
    model = tiny_peft(seed=3)
    rng = np.random.default_rng(3)
    b = random_batch(rng, [20, 14], width=20, label_frac=0.6)
    with torch.no_grad():
        want = model(input_ids=torch.from_numpy(b["input_ids"]), attention_mask=torch.from_numpy(b["attention_mask"]),
                     labels=torch.from_numpy(b["labels"])).loss.item()
    run = reference_train(model, [[b]], TrainConfig(total_steps=1))
    assert run.losses[0] == pytest.approx(want, rel=1e-6, abs=1e-6)
    assert run.tokens == labelled(b)


def test_grad_norm_is_pre_clip_and_independent():
    model = tiny_peft(seed=5)
    ref = copy.deepcopy(model)
    rng = np.random.default_rng(5)
    b1 = random_batch(rng, [18], width=18)
    b2 = random_batch(rng, [12, 9], width=12)
    n = labelled(b1) + labelled(b2)
    # Independent gradient: HF's summed loss over both micro-batches at once, one backward.
    ref.eval()
    total = 0
    for b in (b1, b2):
        out = ref(input_ids=torch.from_numpy(b["input_ids"]), attention_mask=torch.from_numpy(b["attention_mask"]),
                  labels=torch.from_numpy(b["labels"]))
        total = total + out.loss * labelled(b) / n
    total.backward()
    grads = [p.grad for p in ref.parameters() if p.requires_grad]
    want = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])).item()
    run = reference_train(model, [[b1, b2]], TrainConfig(total_steps=1, clip=1e-3))
    assert want > 1e-3   # clipping was active
    assert run.grad_norms[0] == pytest.approx(want, rel=1e-5)
    run_noclip = reference_train(copy.deepcopy(ref), [[b1, b2]], TrainConfig(total_steps=1, clip=None))
    assert run_noclip.grad_norms[0] == pytest.approx(want, rel=1e-5)


def test_clipping_changes_the_update():
    rng = np.random.default_rng(6)
    steps = [[random_batch(rng, [16, 16], width=16)] for _ in range(2)]
    base = tiny_peft(seed=6, n_layer=1)
    cfg = dict(lr=1e-2, warmup=0, total_steps=2, schedule="constant")
    # Clipping to a tiny norm brings the gradients near AdamW's eps, so the update must differ;
    # the logged norm is the pre-clip one either way.
    a = reference_train(copy.deepcopy(base), steps, TrainConfig(**cfg, clip=1e-4))
    b = reference_train(copy.deepcopy(base), steps, TrainConfig(**cfg, clip=None))
    assert a.grad_norms[0] == pytest.approx(b.grad_norms[0], rel=1e-6)
    assert a.grad_norms[0] > 1e-2
    diff = max(float(np.abs(a.lora_state[k] - b.lora_state[k]).max()) for k in a.lora_state)
    assert diff > 1e-7


@pytest.mark.parametrize("schedule,name", [("cosine", "cosine"), ("linear", "linear"),
                                           ("constant", "constant_with_warmup")])
def test_lrs_follow_transformers_scheduler(schedule, name):
    total, warmup, lr = 7, 3, 1e-3
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    sched = get_scheduler(name, opt, num_warmup_steps=warmup, num_training_steps=total)
    want = []
    for _ in range(total):
        want.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    rng = np.random.default_rng(7)
    steps = [[random_batch(rng, [6], width=6, label_frac=1.0)] for _ in range(total)]
    run = reference_train(tiny_peft(seed=7, n_layer=1), steps,
                          TrainConfig(lr=lr, warmup=warmup, schedule=schedule, total_steps=total))
    assert run.lrs == pytest.approx(want, rel=1e-12, abs=0)
    assert run.lrs[0] == 0.0 and max(run.lrs) == pytest.approx(lr)


def test_modes_base_dropout_off_lora_dropout_on():
    model = tiny_peft(seed=8, dropout=0.5, n_layer=1)
    drops = lora_dropout_modules(model)
    assert drops
    seen = {}

    def hook(name):
        def fn(module, args, out):
            seen.setdefault(name, set()).add(module.training)
        return fn

    handles = []
    lora_ids = {id(d) for d in drops}
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Dropout):
            handles.append(m.register_forward_hook(hook(("lora" if id(m) in lora_ids else "base", name))))
    model.train()
    rng = np.random.default_rng(8)
    reference_train(model, [[random_batch(rng, [8], width=8)]], TrainConfig(total_steps=1))
    for h in handles:
        h.remove()
    assert any(k[0] == "base" for k in seen) and any(k[0] == "lora" for k in seen)
    for (kind, name), modes in seen.items():
        assert modes == ({True} if kind == "lora" else {False}), name
    assert all(m.training for m in model.modules())   # the caller's modes are restored


def test_set_lora_state_strict():
    model = tiny_peft(seed=9, n_layer=1)
    state = get_lora_state(model)
    new = {k: np.full_like(v, 0.25) for k, v in state.items()}
    set_lora_state(model, new)
    for k, v in get_lora_state(model).items():
        np.testing.assert_array_equal(v, new[k])
    with pytest.raises(KeyError):
        set_lora_state(model, {**new, "base_model.model.nope.lora_A.weight": np.zeros((4, 4), np.float32)})
    missing = dict(new)
    missing.pop(next(iter(missing)))
    with pytest.raises(KeyError):
        set_lora_state(model, missing)
    k0 = next(iter(new))
    with pytest.raises(ValueError):
        set_lora_state(model, {**new, k0: np.zeros((1, 1), np.float32)})


def test_config_validation():
    with pytest.raises(TypeError):
        TrainConfig()   # total_steps is required
    with pytest.raises(ValueError):
        reference_train(tiny_peft(seed=10, n_layer=1), [], TrainConfig(total_steps=1, schedule="step"))
