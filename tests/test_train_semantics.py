"""Device training semantics against the independent PyTorch + PEFT reference (eval.reference):
accumulation over uneven micro-batches, LR schedule, clipping (issue: device training loop)."""
from __future__ import annotations

import platform
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from eval.reference import TrainConfig, reference_train, set_lora_state
from ort_trainer.bundle import open_bundle
from ort_trainer.optimizer_graph import AdamWSpec
from ort_trainer.schedule import SCHEDULES, lr_at
from ort_trainer.session import RuntimeOptions, TrainSession
from ort_trainer.step import train_step
from tests.bundle_helpers import build_tiny_bundle, peft_reference, random_lora, to_onnx_layout, to_peft_layout
from tests.conftest import REPO


@pytest.fixture(scope="module", params=["gpt2", "qwen2"])
def built(request, tmp_path_factory):
    ckpt, path = build_tiny_bundle(request.param, tmp_path_factory.mktemp(request.param))
    return ckpt, open_bundle(path)


def _uneven_micro_batches(vocab, seed):
    """Two micro-batches with very different numbers of labelled tokens, different lengths."""
    rng = np.random.default_rng(seed)
    a_ids = rng.integers(0, vocab, (1, 40))
    a = {"input_ids": a_ids, "attention_mask": np.ones_like(a_ids), "labels": a_ids.copy()}
    b_ids = rng.integers(0, vocab, (1, 24))
    b_lab = b_ids.copy()
    b_lab[0, :18] = -100                      # a prompt: only 5 loss tokens after the shift
    b = {"input_ids": b_ids, "attention_mask": np.ones_like(b_ids), "labels": b_lab}
    return [a, b]


def _concat(micro):
    """One padded batch holding every micro-batch's rows (what a big-memory server would run)."""
    seq = max(m["input_ids"].shape[1] for m in micro)
    out = {k: [] for k in ("input_ids", "attention_mask", "labels")}
    for m in micro:
        pad = seq - m["input_ids"].shape[1]
        out["input_ids"].append(np.pad(m["input_ids"], ((0, 0), (0, pad))))
        out["attention_mask"].append(np.pad(m["attention_mask"], ((0, 0), (0, pad))))
        out["labels"].append(np.pad(m["labels"], ((0, 0), (0, pad)), constant_values=-100))
    return {k: np.concatenate(v).astype(np.int64) for k, v in out.items()}


def test_accumulation_schedule_and_clip_equal_one_big_pytorch_step(built):
    ckpt, bundle = built
    man = bundle.manifest
    steps = [_uneven_micro_batches(man.model.vocab_size, seed=s) for s in range(5)]
    lora = random_lora(man, seed=7)
    cfg = TrainConfig(lr=5e-3, warmup=2, schedule="cosine", total_steps=5, clip=0.5, eps=1e-8, weight_decay=0.01)

    sess = TrainSession(bundle, adamw=AdamWSpec(eps=cfg.eps, weight_decay=cfg.weight_decay, clip=cfg.clip),
                        options=RuntimeOptions(threads=1), work_dir=ckpt.parent)
    sess.set_lora(to_onnx_layout(man, lora))
    ours = [train_step(sess, micro, lr_at(i, cfg.lr, cfg.warmup, cfg.total_steps, cfg.schedule))
            for i, micro in enumerate(steps)]

    ref_model = peft_reference(ckpt, man)
    set_lora_state(ref_model, lora)
    ref = reference_train(ref_model, [[_concat(micro)] for micro in steps], cfg)

    np.testing.assert_allclose([r.loss for r in ours], ref.losses, rtol=1e-5)
    np.testing.assert_allclose([r.grad_norm for r in ours], ref.grad_norms, rtol=1e-4)
    assert max(ref.grad_norms) > cfg.clip   # clipping was active, so it was compared
    final = to_peft_layout(man, sess.lora())
    for key, want in ref.lora_state.items():
        rel = np.linalg.norm(final[key] - want) / np.linalg.norm(want)
        assert rel <= 1e-5, (key, rel)


def test_micro_batch_split_does_not_change_the_step(built):
    """Same data as [a, b] in one micro-batch vs two: identical step (the ORT side alone)."""
    ckpt, bundle = built
    man = bundle.manifest
    micro = _uneven_micro_batches(man.model.vocab_size, seed=11)
    lora = to_onnx_layout(man, random_lora(man, seed=3))
    results = []
    for batches in (micro, [_concat(micro)]):
        s = TrainSession(bundle, options=RuntimeOptions(threads=1))
        s.set_lora(lora)
        r = train_step(s, batches, 1e-2)
        results.append((r.loss, s.lora()))
    assert abs(results[0][0] - results[1][0]) <= 1e-5 * results[1][0]
    for k in lora:
        np.testing.assert_allclose(results[0][1][k], results[1][1][k], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_schedules_match_transformers(schedule):
    from transformers import get_scheduler

    total, warmup, base = 50, 7, 3e-4
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=base)
    name = {"constant": "constant_with_warmup"}.get(schedule, schedule)
    sched = get_scheduler(name, opt, num_warmup_steps=warmup, num_training_steps=total)
    for step in range(total):
        assert lr_at(step, base, warmup, total, schedule) == pytest.approx(opt.param_groups[0]["lr"], rel=1e-12, abs=1e-15)
        opt.step()
        sched.step()


def test_sessions_flush_denormals_on_every_thread():
    """RuntimeOptions' sessions flush denormals to zero (masked attention scores made MLAS's exp produce them,
    ~7x slower on x86), also on the calling thread, which ORT sets from the first session of a process: hence
    a fresh process. A product below float32's normal range comes out 0, on the calling thread (a 1-element
    Mul) and on the pool's (a large one)."""
    if platform.machine().lower() not in ("x86_64", "amd64", "i686", "x86"):
        pytest.skip("ORT sets FTZ/DAZ on x86 only")
    code = textwrap.dedent("""
        import numpy as np, onnxruntime as ort
        from onnx import helper, TensorProto
        from ort_trainer.session import RuntimeOptions
        vi = lambda n: helper.make_tensor_value_info(n, TensorProto.FLOAT, None)
        g = helper.make_graph([helper.make_node("Mul", ["a", "b"], ["y"])], "g", [vi("a"), vi("b")], [vi("y")])
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]); m.ir_version = 8
        before = float(np.float32(1e-30) * np.float32(1e-10))   # a denormal, before any session
        s = ort.InferenceSession(m.SerializeToString(), RuntimeOptions(threads=2).session_options())
        for n in (1, 1 << 20):
            a = np.full(n, 1e-30, np.float32); b = np.full(n, 1e-10, np.float32)
            print(int(np.count_nonzero(s.run(None, {"a": a, "b": b})[0])), before)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=str(REPO)).stdout.split("\n")
    for line in filter(None, out):
        nonzero, numpy_product = line.split()
        assert float(numpy_product) > 0          # without the flush, the product is a denormal, not 0
        assert nonzero == "0", line
