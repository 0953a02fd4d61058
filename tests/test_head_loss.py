"""The training graph's chunked LM head (artifacts_gen/head_loss.py) against autograd through PEFT:
the loss value and the LoRA gradients, for several chunk counts, an untied head and a logit soft-cap."""
from __future__ import annotations

import numpy as np
import onnx
import pytest

from artifacts_gen.build import build_bundle
from artifacts_gen.export import LoraSettings
from ort_trainer import manifest as mf
from ort_trainer.bundle import open_bundle
from ort_trainer.session import TrainSession
from tests.bundle_helpers import (
    SEQ_LEN, head_weight_views, load_lora_into, peft_lora_params, peft_reference, random_lora, sample_batch,
    to_onnx_layout, to_peft_layout, torch_batch,
)
from tests.tiny_models import make_tiny_checkpoint


def _build(tmp_path, family: str, chunks: int, min_rows: int = 8, vocab_cols: int | None = None,
           **config_overrides):
    ckpt = make_tiny_checkpoint(family, tmp_path / "ckpt", **config_overrides)
    out = tmp_path / "bundle"
    build_bundle(ckpt, out, lora=LoraSettings(r=4, alpha=8.0), seq_len=SEQ_LEN, shard_mb=64, head_chunks=chunks,
                 head_min_rows=min_rows, head_vocab_cols=vocab_cols, log=lambda *_: None)
    return ckpt, open_bundle(out)


def _check_against_peft(ckpt, bundle, seed: int = 5) -> None:
    man = bundle.manifest
    lora = random_lora(man, seed=seed)
    batch = sample_batch(man.model.vocab_size, 3, 37, seed=seed + 1)     # 3 x 36 rows minus the ignored ones
    n = int((batch["labels"][:, 1:] != -100).sum())
    used = min(max(n // man.loss.head_min_rows, 1), man.loss.head_chunks)
    assert used == 1 or n % used != 0        # several slices: the last one is padded

    sess = TrainSession(bundle)
    sess.set_lora(to_onnx_layout(man, lora))
    loss = sess.forward_backward(batch, 1.0 / n)
    grads = to_peft_layout(man, sess.grads())

    ref = peft_reference(ckpt, man)
    load_lora_into(ref, lora)
    out = ref(**torch_batch(batch))
    out.loss.backward()
    assert abs(loss - out.loss.item()) <= 1e-5 * abs(out.loss.item())
    for key, p in peft_lora_params(ref).items():
        g = p.grad.numpy()
        assert np.linalg.norm(grads[key] - g) / np.linalg.norm(g) <= 1e-4, key


def _head_gemms(bundle) -> tuple[int, list[str]]:
    model = onnx.load(str(bundle.file(mf.TRAINING_MODEL)), load_external_data=False)
    gemms = [n for n in model.graph.node if n.op_type == "Gemm" and any("/chunked_head/" in o for o in n.output)]
    sce = [n.op_type for n in model.graph.node if "SoftmaxCrossEntropy" in n.op_type]
    return len(gemms), sce


# 73 rows: 1, 5, 2, 2 row slices used. Tiny GPT-2 has GPT-2's 50,257-entry vocabulary: 4 vocabulary slices of
# 12,608 by default, 1 at 65,536, 8 at 7,000.
@pytest.mark.parametrize("chunks, min_rows, vocab_cols, vocab_slices",
                         [(1, 8, None, 4), (5, 8, None, 4), (5, 30, 65536, 1), (2, 8, 7000, 8)])
def test_chunked_head_loss_and_grads_match_peft(tmp_path, chunks, min_rows, vocab_cols, vocab_slices):
    ckpt, bundle = _build(tmp_path, "gpt2", chunks, min_rows, vocab_cols)
    assert bundle.manifest.loss.head_chunks == chunks
    n_gemm, sce = _head_gemms(bundle)
    assert n_gemm == 2 * chunks * vocab_slices and sce == []     # head + dLoss/dh per slice; no [N, V] loss node
    if vocab_slices > 1:
        assert len(head_weight_views(bundle)[1]) == vocab_slices
    _check_against_peft(ckpt, bundle)


def test_untied_head(tmp_path):
    """An untied head [H, V] is stored as [V, H] (graph_fixes), so it too is read in views."""
    ckpt, bundle = _build(tmp_path, "qwen2", 3, tie_word_embeddings=False)
    assert not bundle.manifest.model.tie_word_embeddings
    assert len(head_weight_views(bundle)[1]) == 10      # Qwen2's 151,936 entries in slices of <= 16,384
    _check_against_peft(ckpt, bundle)


def test_logit_softcap(tmp_path):
    ckpt, bundle = _build(tmp_path, "gemma3", 3, final_logit_softcapping=0.5)
    assert len(head_weight_views(bundle)[1]) == 4
    _check_against_peft(ckpt, bundle)


def test_bad_chunk_count_is_refused_before_any_work(tmp_path):
    with pytest.raises(ValueError, match="--head-chunks 0"):
        build_bundle(tmp_path / "nowhere", tmp_path / "out", head_chunks=0)
    with pytest.raises(ValueError, match="--head-min-rows 0"):
        build_bundle(tmp_path / "nowhere", tmp_path / "out", head_min_rows=0)
    with pytest.raises(ValueError, match="--head-vocab-cols 8"):
        build_bundle(tmp_path / "nowhere", tmp_path / "out", head_vocab_cols=8)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("softcap", [None, 20.0, 50.0])     # 50: above FIXED_BOUND_MAX, the online max
def test_online_softmax_head_against_numpy(tmp_path, softcap):
    """The rewritten head alone, on logits spread over +-60 (so the running max moves between vocabulary
    slices and an unrescaled sum would be off by e^30 and more): loss and dLoss/dh against float64 numpy."""
    import onnxruntime as ort
    from onnx import TensorProto, helper
    from artifacts_gen import head_loss

    rng = np.random.default_rng(3)
    n_rows, vocab, hidden = 37, 1000, 16
    w = rng.standard_normal((vocab, hidden)).astype(np.float32)
    w[rng.integers(0, vocab, 20)] *= 12.0                      # a few large logits, in different slices
    w.tofile(tmp_path / "w.bin")
    init = TensorProto(name="W", dims=[vocab, hidden], data_type=TensorProto.FLOAT, data_location=TensorProto.EXTERNAL)
    for key, value in (("location", "w.bin"), ("offset", "0"), ("length", str(w.nbytes))):
        entry = init.external_data.add()
        entry.key, entry.value = key, value
    nodes = [helper.make_node("Gemm", ["h", "W"], ["logits"], transB=1)]
    logits = "logits"
    if softcap is not None:       # the traced Gemma3 tail: logits / cap -> tanh -> * cap
        nodes += [helper.make_node("Div", ["logits", "cap"], ["l_over_cap"]),
                  helper.make_node("Tanh", ["l_over_cap"], ["l_tanh"]),
                  helper.make_node("Mul", ["l_tanh", "cap"], ["l_capped"])]
        logits = "l_capped"
    nodes += [helper.make_node("SoftmaxCrossEntropyLoss", [logits, "y"], ["nll"], reduction="sum", ignore_index=-100),
              helper.make_node("Mul", ["nll", "scale"], ["loss"])]
    consts = [onnx.numpy_helper.from_array(np.array(softcap or 1.0, np.float32), "cap")]
    graph = helper.make_graph(nodes, "head", [helper.make_tensor_value_info("h", TensorProto.FLOAT, ["N", hidden]),
                                              helper.make_tensor_value_info("y", TensorProto.INT64, ["N"]),
                                              helper.make_tensor_value_info("scale", TensorProto.FLOAT, [])],
                              [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], [init, *consts])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    head_loss.chunk_head_loss(model, chunks=2, min_rows=16, softcap=softcap, vocab_cols=192)   # 6 slices of 192
    assert sum(i.name.startswith("/chunked_head/w") for i in model.graph.initializer) == 6
    head_gemms = [n for n in model.graph.node if n.op_type == "Gemm"]   # named, so that a profile tells them apart
    assert len(head_gemms) == 2 * 2 * 6 and all(n.name.startswith(head_loss.PREFIX) for n in head_gemms)
    model.graph.output.append(helper.make_tensor_value_info("/chunked_head/g", TensorProto.FLOAT, None))
    onnx.save(model, str(tmp_path / "head.onnx"))

    h = (rng.standard_normal((n_rows, hidden)) * 1.5).astype(np.float32)
    y = rng.integers(0, vocab, n_rows)
    y[[3, 17]] = -100
    scale = np.array(0.25, np.float32)
    loss, g = ort.InferenceSession(str(tmp_path / "head.onnx")).run(None, {"h": h, "y": y, "scale": scale})

    z = h.astype(np.float64) @ w.astype(np.float64).T
    dcap = np.ones_like(z)
    if softcap is not None:
        t = np.tanh(z / softcap)
        z, dcap = softcap * t, 1 - t ** 2
    assert np.ptp(z, axis=1).min() > (60 if softcap is None else 30)       # far beyond exp's float32 range
    valid = y != -100
    lse = np.log(np.exp(z - z.max(1, keepdims=True)).sum(1)) + z.max(1)
    ref_loss = scale * (lse - z[np.arange(n_rows), np.where(valid, y, 0)])[valid].sum()
    dz = np.exp(z - lse[:, None])
    dz[np.arange(n_rows)[valid], y[valid]] -= 1
    ref_g = ((dz * dcap) @ w.astype(np.float64)) * scale * valid[:, None]
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
    assert np.linalg.norm(g - ref_g) / np.linalg.norm(ref_g) <= 1e-5


def test_fast_gelu_grad_replacement_matches_torch_and_ort():
    """slow_kernels: the elementwise derivative equals ORT's own FastGeluGrad and torch's autograd of
    gelu(approximate='tanh'), on values across GELU's range."""
    import onnxruntime as ort
    import torch
    from onnx import TensorProto, helper

    from artifacts_gen.slow_kernels import replace_fast_gelu_grad

    x = np.linspace(-8, 8, 4001, dtype=np.float32).reshape(1, -1)
    dy = np.random.default_rng(0).normal(size=x.shape).astype(np.float32)
    node = helper.make_node("FastGeluGrad", ["dy", "x"], ["dx"], domain="com.microsoft")
    vi = [helper.make_tensor_value_info(n, TensorProto.FLOAT, list(x.shape)) for n in ("dy", "x", "dx")]
    model = helper.make_model(helper.make_graph([node], "g", vi[:2], vi[2:]),
                              opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    run = lambda m: ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(  # noqa: E731
        None, {"dy": dy, "x": x})[0]
    ort_dx = run(model)
    assert replace_fast_gelu_grad(model) == 1
    assert all(n.op_type != "FastGeluGrad" for n in model.graph.node)
    new_dx = run(model)

    xt = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    torch.nn.functional.gelu(xt, approximate="tanh").backward(torch.tensor(dy, dtype=torch.float64))
    ref = xt.grad.numpy()
    assert np.abs(new_dx - ref).max() <= 1e-5
    assert np.abs(new_dx - ort_dx).max() <= 1e-5


def _norm_grad_rewrite(op: str, replace, feeds: dict, eps: float, opset: int) -> tuple[np.ndarray, np.ndarray]:
    """One com.microsoft `op` node (dX and dScale outputs) run by ORT before and after `replace`, which must keep a
    node whose dScale is read and rewrite one whose dScale nothing reads. -> (ORT's kernel's dX, the rewrite's dX)"""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    def model(read_dw: bool):
        node = helper.make_node(op, list(feeds), ["dx", "dw"] + (["db"] if op == "LayerNormalizationGrad" else []),
                                domain="com.microsoft", axis=-1, epsilon=eps)
        ins = [helper.make_tensor_value_info(k, TensorProto.FLOAT, list(v.shape)) for k, v in feeds.items()]
        outs = [helper.make_tensor_value_info(k, TensorProto.FLOAT, None) for k in (["dx", "dw"] if read_dw else ["dx"])]
        return helper.make_model(helper.make_graph([node], "g", ins, outs),
                                 opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid("com.microsoft", 1)])
    run = lambda m: ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(  # noqa: E731
        ["dx"], feeds)[0]

    assert replace(model(read_dw=True)) == 0
    m = model(read_dw=False)
    ort_dx = run(m)
    assert replace(m) == 1
    assert all(n.op_type != op for n in m.graph.node)
    return ort_dx, run(m)


@pytest.mark.parametrize("opset", [17, 18])
def test_layer_norm_grad_replacement_matches_torch_and_ort(opset):
    """slow_kernels: the rewritten LayerNormalizationGrad gives torch's float64 autograd dX of layer_norm
    and ORT's own kernel's, on rows with a large mean (the rewrite subtracts mean * k late); a node whose
    dScale is read is kept."""
    import torch

    from artifacts_gen.slow_kernels import replace_layer_norm_grad

    rng = np.random.default_rng(1)
    n_rows, d, eps = 64, 96, 1e-5
    x = (rng.normal(size=(n_rows, d)) * rng.uniform(0.1, 3, (n_rows, 1)) + rng.uniform(-20, 20, (n_rows, 1))).astype(np.float32)
    dy = rng.normal(size=x.shape).astype(np.float32)
    w = rng.uniform(0.5, 1.5, d).astype(np.float32)
    mean = x.mean(-1, keepdims=True)
    inv = (1 / np.sqrt(x.var(-1, keepdims=True) + eps)).astype(np.float32)
    feeds = {"dy": dy, "x": x, "w": w, "mean": mean, "inv": inv}
    ort_dx, new_dx = _norm_grad_rewrite("LayerNormalizationGrad", replace_layer_norm_grad, feeds, eps, opset)

    xt = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    torch.nn.functional.layer_norm(xt, (d,), torch.tensor(w, dtype=torch.float64), None, eps).backward(
        torch.tensor(dy, dtype=torch.float64))
    ref = xt.grad.numpy()
    scale = np.abs(ref).max()
    assert np.abs(new_dx - ref).max() <= 1e-5 * scale
    assert np.abs(ort_dx - ref).max() <= 1e-5 * scale        # the bar holds for ORT's own kernel too
    assert np.abs(new_dx - ort_dx).max() <= 2e-5 * scale


@pytest.mark.parametrize("opset", [17, 18])
def test_rms_norm_grad_replacement_matches_torch_and_ort(opset):
    """slow_kernels: the rewritten SimplifiedLayerNormalizationGrad gives torch's float64 autograd dX of an RMSNorm
    (rows of very different scales, a weight broadcast over a 3-D input as in Gemma3's q/k norms) and ORT's own
    kernel's; a node whose dScale is read is kept."""
    import torch

    from artifacts_gen.slow_kernels import replace_rms_norm_grad

    rng = np.random.default_rng(2)
    heads, n_rows, d, eps = 3, 40, 64, 1e-6
    x = (rng.normal(size=(heads, n_rows, d)) * rng.uniform(0.05, 20, (heads, n_rows, 1)) + 0.5).astype(np.float32)
    dy = rng.normal(size=x.shape).astype(np.float32)
    w = rng.uniform(0.5, 1.5, d).astype(np.float32)
    inv = (1 / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + eps)).astype(np.float32)
    feeds = {"dy": dy, "x": x, "w": w, "inv": inv}
    ort_dx, new_dx = _norm_grad_rewrite("SimplifiedLayerNormalizationGrad", replace_rms_norm_grad, feeds, eps, opset)

    xt = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    y = xt * torch.rsqrt(xt.pow(2).mean(-1, keepdim=True) + eps) * torch.tensor(w, dtype=torch.float64)
    y.backward(torch.tensor(dy, dtype=torch.float64))
    ref = xt.grad.numpy()
    scale = np.abs(ref).max(-1, keepdims=True)            # per row: the rows' scales differ by 400x
    assert (np.abs(new_dx - ref) <= 1e-5 * scale).all()
    assert (np.abs(ort_dx - ref) <= 1e-5 * scale).all()   # the bar holds for ORT's own kernel too


def test_gather_grad_replacement_matches_torch_and_only_for_nonzero_indices():
    """slow_kernels: a GatherGrad whose indices are torch.nonzero(mask).squeeze(1) (no index repeats) becomes a
    ScatterND with torch's autograd result of index_select; one with other indices (they may repeat) is kept."""
    import onnxruntime as ort
    import torch
    from onnx import TensorProto, helper

    from artifacts_gen.slow_kernels import replace_gather_grad

    rng = np.random.default_rng(2)
    mask = (rng.random(40) < 0.6).astype(np.int64)
    dy = rng.normal(size=(int(mask.sum()), 3, 5)).astype(np.float32)
    shape = np.array([40, 3, 5], np.int64)
    n = helper.make_node

    def model(from_nonzero: bool):
        nodes = [n("NonZero", ["mask"], ["nz"]), n("Transpose", ["nz"], ["nz_t"], perm=[1, 0]),
                 n("Squeeze", ["nz_t", "one"], ["rows"])] if from_nonzero else \
                [n("Cast", ["mask"], ["rows"], to=TensorProto.INT64)]    # not known to be free of repeats
        nodes.append(n("GatherGrad", ["shape", "rows", "dy"], ["dx"], domain="com.microsoft", axis=0))
        ins = [helper.make_tensor_value_info("mask", TensorProto.INT64, [40]),
               helper.make_tensor_value_info("shape", TensorProto.INT64, [3]),
               helper.make_tensor_value_info("dy", TensorProto.FLOAT, [None, 3, 5])]
        graph = helper.make_graph(nodes, "g", ins, [helper.make_tensor_value_info("dx", TensorProto.FLOAT, None)],
                                  initializer=[onnx.numpy_helper.from_array(np.array([1], np.int64), "one")])
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])

    assert replace_gather_grad(model(from_nonzero=False)) == 0
    m = model(from_nonzero=True)
    assert replace_gather_grad(m) == 1
    assert [x.op_type for x in m.graph.node if x.domain == "com.microsoft"] == []
    dx = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"mask": mask, "shape": shape, "dy": dy})[0]

    xt = torch.zeros(40, 3, 5, dtype=torch.float64, requires_grad=True)
    xt.index_select(0, torch.nonzero(torch.from_numpy(mask)).squeeze(1)).backward(torch.tensor(dy, dtype=torch.float64))
    assert np.abs(dx - xt.grad.numpy()).max() <= 1e-7
