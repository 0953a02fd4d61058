"""artifacts_gen against an independent PyTorch/PEFT model, for every family (issue: artifacts_gen)."""
from __future__ import annotations

import shutil

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper

from ort_trainer import manifest as mf
from ort_trainer.bundle import BundleError, open_bundle
from ort_trainer.session import EvalSession, TrainSession
from tests.bundle_helpers import (
    build_tiny_bundle, head_weight_views, load_lora_into, peft_lora_params, peft_reference, random_lora,
    sample_batch, to_onnx_layout, to_peft_layout, torch_batch,
)
from tests.tiny_models import FAMILIES


@pytest.fixture(scope="module", params=FAMILIES)
def built(request, tmp_path_factory):
    ckpt, path = build_tiny_bundle(request.param, tmp_path_factory.mktemp(request.param))
    bundle = open_bundle(path)
    return request.param, ckpt, bundle


@pytest.mark.parametrize("seq", [20, 48])   # neither is the traced length (32)
def test_eval_logits_and_loss_match_peft(built, seq):
    family, ckpt, bundle = built
    assert bundle.manifest.traced_seq_len not in (20, 48)
    assert_eval_matches_peft(bundle, peft_reference(ckpt, bundle.manifest), seq)


def assert_eval_matches_peft(bundle, ref, seq: int) -> None:
    """The eval graph's logits at labelled positions and loss equal PEFT's with the same random LoRA."""
    man = bundle.manifest
    lora = random_lora(man, seed=1)
    load_lora_into(ref, lora)
    batch = sample_batch(man.model.vocab_size, 3, seq)
    n = int((batch["labels"][:, 1:] != -100).sum())

    loss, logits = EvalSession(bundle, to_onnx_layout(man, lora)).run(batch, loss_scale=1.0 / n)
    with torch.no_grad():
        out = ref(**torch_batch(batch))
    keep = torch.from_numpy(batch["labels"][:, 1:] != -100)
    ref_logits = out.logits[:, :-1][keep].numpy()
    assert logits.shape == ref_logits.shape
    assert np.abs(logits - ref_logits).max() <= 1e-4
    assert abs(loss - out.loss.item()) / out.loss.item() <= 1e-5


def test_padding_is_never_computed(built):
    """packing.py: the graph drops padding positions before the embedding lookup, so token ids there are never
    read: ids far outside the vocabulary at padding give the same loss and logits (a graph that embeds padding
    fails on them: Gather index out of range)."""
    family, ckpt, bundle = built
    man = bundle.manifest
    assert man.padding_free
    batch = sample_batch(man.model.vocab_size, 3, 20)
    n = int((batch["labels"][:, 1:] != -100).sum())
    sess = EvalSession(bundle, to_onnx_layout(man, random_lora(man, seed=1)))
    loss, logits = sess.run(batch, loss_scale=1.0 / n)
    assert (batch["attention_mask"] == 0).any()
    bad = {**batch, "input_ids": np.where(batch["attention_mask"] == 1, batch["input_ids"], man.model.vocab_size + 10**6)}
    loss_bad, logits_bad = sess.run(bad, loss_scale=1.0 / n)
    assert loss_bad == loss and np.array_equal(logits_bad, logits)


def assert_lora_grads_match_autograd(ckpt, bundle, ref=None, seed: int = 2) -> None:
    """ORT's LoRA gradients on a random batch equal autograd's through an independently built PEFT model."""
    man = bundle.manifest
    lora = random_lora(man, seed=seed)
    batch = sample_batch(man.model.vocab_size, 2, 40, seed=seed + 1)
    n = int((batch["labels"][:, 1:] != -100).sum())

    sess = TrainSession(bundle)
    sess.set_lora(to_onnx_layout(man, lora))
    sess.forward_backward(batch, 1.0 / n)
    ort_grads = to_peft_layout(man, sess.grads())

    ref = ref if ref is not None else peft_reference(ckpt, man)
    load_lora_into(ref, lora)
    ref(**torch_batch(batch)).loss.backward()
    for key, p in peft_lora_params(ref).items():
        g = p.grad.numpy()
        rel = np.linalg.norm(ort_grads[key] - g) / np.linalg.norm(g)
        assert rel <= 1e-4, (key, rel)


def test_lora_grads_match_autograd(built):
    family, ckpt, bundle = built
    assert_lora_grads_match_autograd(ckpt, bundle)
    graph = onnx.load(str(bundle.file(mf.TRAINING_MODEL)), load_external_data=False).graph
    ops = [n.op_type for n in graph.node]
    assert "GatherGrad" not in ops     # every row gather's gradient is a ScatterND (ORT's CPU kernel is ~100x slower)
    # packing.to_padded first undoes the family's [1, T, heads, d] -> [1, heads, T, d] Transpose, and the two
    # cancel; with a Reshape between them, both ran, forward and backward (GPT-2 124M: 254 -> 110 Transposes)
    producer = {out: n for n in graph.node for out in n.output}

    def chain(n, k=3):         # n's op type, then its first input's producer's, ..., k of them
        kinds = []
        while n is not None and len(kinds) < k:
            kinds.append(n.op_type)
            n = producer.get(n.input[0]) if n.input else None
        return kinds
    def perm(n):
        return next((list(a.ints) for a in n.attribute if a.name == "perm"), None)

    def cancelled(n):          # a Transpose right after its inverse: ORT drops both
        p = producer.get(n.input[0])
        return p is not None and p.op_type == "Transpose" and [perm(p)[i] for i in perm(n)] == sorted(perm(n))
    assert not [n.name for n in graph.node if chain(n) == ["Transpose", "Reshape", "Transpose"]
                and not cancelled(producer[producer[n.input[0]].input[0]])]
    # grouped-query attention (Qwen2, Gemma3) stacks a key/value head's query heads into one matmul, so no key or
    # value is expanded to every head (repeat_kv), and no expanded copy is kept for the backward pass
    assert not [n.name for n in graph.node if n.op_type == "Expand" and "attn" in n.name]
    # every residual Add's inputs are known to be alike ([1, T, D], export.CausalLMWithLoss + graph_fixes.known_shapes),
    # so ORT passes their gradient on as is, with no sum over an axis of size 1
    assert not [n.name for n in graph.node if n.op_type == "ReduceSum" and "/Add_Grad/" in n.name]
    if family in ("gpt2", "gemma3"):   # ORT fused the GELU (Gemma's via export.fusable_gelu); its slow gradient
                                       # kernel was replaced (slow_kernels)
        assert "FastGelu" in ops and "FastGeluGrad" not in ops
    # the norms' gradients were rewritten too (slow_kernels: LayerNorm's and RMSNorm's, dX only)
    assert "LayerNormalizationGrad" not in ops and "SimplifiedLayerNormalizationGrad" not in ops
    if family == "gpt2":   # its attention's own causal Where is gone (graph_fixes.drop_causal_where; the grads above
                           # with padding still match), and its [1, 1, n, n] bool buffer left the shards
        assert not [n.name for n in graph.node if n.name.endswith("/attn/Where")]
        bool_4d = [i.name for i in graph.initializer if i.data_type == onnx.TensorProto.BOOL and len(i.dims) == 4]
        assert not bool_4d


def test_ten_adamw_steps_match_torch(built):
    family, ckpt, bundle = built
    assert_ten_adamw_steps_match_torch(bundle, peft_reference(ckpt, bundle.manifest))


def ten_adamw_steps(bundle, ref, seed: int = 4) -> tuple[dict, dict, dict]:
    """10 ORT optimizer steps (AdamW, clipping) from a random LoRA, and torch.optim.AdamW's on PEFT model `ref`
    (float32 or float64) from the same LoRA on the same batches. -> (ORT's LoRA, PyTorch's, the start; PEFT keys)."""
    man = bundle.manifest
    lora = random_lora(man, seed=seed)
    batches = adamw_batches(man)
    lr = 1e-2

    sess = TrainSession(bundle)
    sess.set_lora(to_onnx_layout(man, lora))
    for b in batches:
        sess.forward_backward(b, 1.0 / int((b["labels"][:, 1:] != -100).sum()))
        sess.step(lr)
    ort_final = to_peft_layout(man, sess.lora())

    torch_final = torch_adamw_steps(bundle, ref, lora, batches, lr)
    moved = max(np.abs(torch_final[k] - lora[k]).max() for k in lora)
    assert moved > 1e-3   # a comparison of the ends is not vacuous
    return ort_final, torch_final, lora


def adamw_batches(man) -> list[dict]:
    """ten_adamw_steps' 10 batches."""
    return [sample_batch(man.model.vocab_size, 2, 24, seed=10 + i) for i in range(10)]


def torch_adamw_steps(bundle, ref, lora: dict, batches: list[dict], lr: float = 1e-2) -> dict:
    """ten_adamw_steps' PyTorch side: torch.optim.AdamW (with clipping) on PEFT model `ref` from `lora`, one step per
    batch. -> the final LoRA (PEFT keys)."""
    spec = bundle.manifest.optimizer
    load_lora_into(ref, lora)
    params = peft_lora_params(ref)
    opt = torch.optim.AdamW(params.values(), lr=lr, betas=(spec["beta1"], spec["beta2"]), eps=spec["eps"],
                            weight_decay=spec["weight_decay"])
    for b in batches:
        opt.zero_grad()
        ref(**torch_batch(b)).loss.backward()
        torch.nn.utils.clip_grad_norm_(params.values(), spec["clip"])
        opt.step()
    return {k: p.detach().numpy().copy() for k, p in params.items()}


def assert_ten_adamw_steps_match_torch(bundle, ref) -> None:
    ort_final, torch_final, _ = ten_adamw_steps(bundle, ref)
    for key, want in torch_final.items():
        assert np.abs(ort_final[key] - want).max() <= 1e-5, key


def test_checkpoint_is_peft_init_and_lora_only(built):
    family, ckpt, bundle = built
    man = bundle.manifest
    sess = TrainSession(bundle)
    assert sorted(sess.state.parameters[n].name for n in man.trainable_names) == sorted(man.trainable_names)
    assert len(list(sess.state.parameters)) == len(man.trainable)
    # PEFT, seeded as the generator was (--seed 0), gives the same initial tensors one for one.
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    torch.manual_seed(0)
    peft = get_peft_model(base, LoraConfig(r=man.lora.r, lora_alpha=man.lora.alpha, target_modules=man.lora.target_modules,
                                           fan_in_fan_out=man.lora.fan_in_fan_out))
    expected = {k: p.detach().numpy() for k, p in peft_lora_params(peft).items()}
    got = to_peft_layout(man, sess.lora())
    assert set(got) == set(expected) and len(got) == len(man.trainable)
    for k in expected:
        np.testing.assert_array_equal(got[k], expected[k])
    # Distinct tensors: no two LoRA weights share storage or name (the exporter's dedup trap).
    assert len({t.onnx_name for t in man.trainable}) == len(man.trainable)
    ck = bundle.file(mf.CHECKPOINT).stat().st_size
    lora_bytes = sum(int(np.prod(t.shape)) * 4 for t in man.trainable)
    assert ck < 2 * lora_bytes + 64 * 1024


def _external_tensors(bundle, name):
    model = onnx.load(str(bundle.file(name)), load_external_data=False)
    ext = {}
    for init in model.graph.initializer:
        if init.data_location == onnx.TensorProto.EXTERNAL:
            info = {e.key: e.value for e in init.external_data}
            ext[init.name] = (info["location"], int(info["offset"]), int(info["length"]))
    onnx.load_external_data_for_model(model, str(bundle.path))
    arrays = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer if i.name in ext}
    return ext, arrays


def test_shards_hold_every_frozen_weight_once(built):
    family, ckpt, bundle = built
    train_refs, _ = _external_tensors(bundle, mf.TRAINING_MODEL)
    eval_refs, arrays = _external_tensors(bundle, mf.EVAL_MODEL)
    # Training and eval graphs point at the same bytes; the training graph reads the LM head weight
    # through views that tile it (head_loss._vocab_slices).
    whole, views = head_weight_views(bundle)
    assert views and {k: v for k, v in train_refs.items() if k not in views} == {
        k: v for k, v in eval_refs.items() if k != whole}
    # No two stored tensors overlap.
    spans = sorted(eval_refs.values())
    for (f1, o1, l1), (f2, o2, l2) in zip(spans, spans[1:]):
        assert f1 != f2 or o1 + l1 <= o2
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    stored = list(arrays.values())

    def forms(name, w):
        return [w] + ([w.T] if w.ndim == 2 else []) + ([1.0 + w] if family == "gemma3" and "norm" in name else [])

    def hits(w_forms):
        return [i for i, s in enumerate(stored) for f in w_forms if s.shape == f.shape and np.array_equal(s, f)]

    matched = set()
    for name, p in base.named_parameters():   # tied weights are listed once by named_parameters
        w = p.detach().numpy()
        if w.size * 4 >= 1024:
            found = hits(forms(name, w))
            assert len(found) == 1, (name, len(found))
            matched.update(found)
    for name, b in base.named_buffers():       # e.g. GPT-2's causal-mask buffer, exported as a constant
        matched.update(hits([b.numpy()]))
    # Every stored tensor is a weight or buffer of the model: nothing else, nothing twice.
    assert matched == set(range(len(stored)))
    assert sum(f.bytes for f in bundle.manifest.files_with_role("shard")) >= sum(a.nbytes for a in stored)


def test_manifest_hashes_verify_and_detect_damage(built, tmp_path):
    family, ckpt, bundle = built
    copy = tmp_path / "copy"
    shutil.copytree(bundle.path, copy)
    open_bundle(copy)   # verifies every sha256
    shard = copy / bundle.manifest.files_with_role("shard")[0].path
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(BundleError, match="sha256"):
        open_bundle(copy)
    shard.write_bytes(bytes(data[:-10]))
    with pytest.raises(BundleError, match="bytes"):
        open_bundle(copy, verify="sizes")


MLP_OUT = {"gpt2": "mlp.c_proj", "qwen2": "down_proj", "gemma3": "down_proj"}   # HF's names, written out here


@pytest.mark.parametrize("family", FAMILIES)
def test_mlp_out_targets_only_the_mlp_output_and_grads_match_autograd(family, tmp_path):
    """--targets mlp-out (the demo's recipe): one adapter per layer, on the MLP's output projection, and ORT's
    LoRA gradients equal PyTorch autograd's through an independently built PEFT model."""
    ckpt, path = build_tiny_bundle(family, tmp_path, targets="mlp-out")
    bundle = open_bundle(path)
    man = bundle.manifest
    assert man.lora.target_modules == [MLP_OUT[family]]
    ref = peft_reference(ckpt, man)
    params = peft_lora_params(ref)
    layers = ref.base_model.model.config.num_hidden_layers
    assert len(params) == 2 * layers and all(MLP_OUT[family] + ".lora_" in k for k in params)
    assert sorted(t.peft_key for t in man.trainable) == sorted(params)
    assert_lora_grads_match_autograd(ckpt, bundle, ref, seed=4)


def test_backward_recomputes_mlp_activations(built, tmp_path):
    """recompute.py: no backward node reads a kept activation that it could recompute from the kept input, and
    in ORT's real execution order every recomputation runs in the backward pass: after the last layer's forward
    activation. (Ungated, a recomputation reads forward tensors only, and ORT may run it right after them.)"""
    import gc

    import onnxruntime as ort

    from artifacts_gen.recompute import ACTIVATIONS, PREFIX, backward_nodes, readers
    from ort_trainer.ort_training import CheckpointState, Module

    family, _, bundle = built
    graph = onnx.load(str(bundle.file(mf.TRAINING_MODEL)), load_external_data=False).graph
    read_by = readers(graph)
    bwd = backward_nodes(graph, read_by)
    acts = [n for i, n in enumerate(graph.node) if i not in bwd and (n.domain, n.op_type) in ACTIVATIONS]
    kept = [n.name for n in acts if any(j in bwd for j in read_by[n.output[0]]) and any(j in bwd for j in read_by[n.input[0]])]
    assert not kept
    again = [n.name for n in graph.node if n.name.startswith(PREFIX) and (n.domain, n.op_type) in ACTIVATIONS]
    # Qwen2's and Gemma3's gated MLPs keep act(g) for dm * act(g); GPT-2's MLP reads its GELU forward only
    assert len(again) == (0 if family == "gpt2" else bundle.manifest.model.num_layers)
    if not again:
        return

    so = ort.SessionOptions()
    so.enable_profiling = True
    so.profile_file_prefix = str(tmp_path / "prof")
    module = Module(str(bundle.file(mf.TRAINING_MODEL)), CheckpointState.load_checkpoint(str(bundle.file(mf.CHECKPOINT))),
                    None, "cpu", so)
    module.train()
    batch = sample_batch(bundle.manifest.model.vocab_size, 2, 40)
    module(batch["input_ids"], batch["attention_mask"], batch["labels"], np.asarray(0.01, dtype=np.float32))
    del module
    gc.collect()
    import json
    events = json.loads(next(tmp_path.glob("prof*.json")).read_text())
    order = [e["name"][: -len("_kernel_time")] for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]
    at = {name: k for k, name in enumerate(order)}
    last_forward = max(at[n.name] for n in acts)
    assert all(at[name] > last_forward for name in again), [(name, at[name], last_forward) for name in again]
