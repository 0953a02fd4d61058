"""Test helpers: build tiny bundles once, and the independent PyTorch/PEFT side of each comparison."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import numpy_helper

from artifacts_gen.quantize import is_vocab  # noqa: F401  (the tests' import of it)
from ort_trainer import manifest as mf
from ort_trainer.manifest import Manifest

SEQ_LEN = 64          # bundles are built for 64; tests also run other lengths than the trace's


def build_tiny_bundle(family: str, root: Path, targets: str = "attn", r: int = 4, **build_kw) -> tuple[Path, Path]:
    from artifacts_gen.build import build_bundle
    from artifacts_gen.export import LoraSettings
    from tests.tiny_models import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(family, root / f"{family}-ckpt")
    bundle = root / f"{family}-bundle"
    if build_kw.get("quant") == "int4":      # int4's default samples calibration text from the model (10-40 s for a
        build_kw.setdefault("quant_calib", "none")    # tiny one); its own tests (test_gptq) build it so
    build_bundle(ckpt, bundle, lora=LoraSettings(r=r, alpha=2.0 * r, targets=targets), seq_len=SEQ_LEN,
                 shard_mb=64, log=lambda *_: None, **build_kw)
    return ckpt, bundle


def peft_reference(ckpt: Path, manifest: Manifest):
    """A PEFT model built independently from the checkpoint and the manifest's LoRA config."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    cfg = LoraConfig(r=manifest.lora.r, lora_alpha=manifest.lora.alpha, lora_dropout=manifest.lora.dropout,
                     target_modules=manifest.lora.target_modules, fan_in_fan_out=manifest.lora.fan_in_fan_out)
    return get_peft_model(base, cfg).eval()


def peft_lora_params(model) -> dict[str, torch.nn.Parameter]:
    """PEFT state-dict key -> live parameter."""
    return {n.replace(".default", ""): p for n, p in model.named_parameters() if "lora_" in n}


def random_lora(manifest: Manifest, seed: int) -> dict[str, np.ndarray]:
    """Non-zero LoRA values (PEFT's B=0 would make A's gradient vanish), keyed by PEFT key, PEFT layout."""
    rng = np.random.default_rng(seed)
    out = {}
    for t in manifest.trainable:
        shape = t.shape[::-1] if t.transposed else t.shape
        out[t.peft_key] = (rng.standard_normal(shape) * 0.1).astype(np.float32)
    return out


def to_onnx_layout(manifest: Manifest, by_peft_key: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {t.onnx_name: (by_peft_key[t.peft_key].T if t.transposed else by_peft_key[t.peft_key]).copy()
            for t in manifest.trainable}


def to_peft_layout(manifest: Manifest, by_onnx_name: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {t.peft_key: (by_onnx_name[t.onnx_name].T if t.transposed else by_onnx_name[t.onnx_name]).copy()
            for t in manifest.trainable}


def load_lora_into(model, values: dict[str, np.ndarray]) -> None:
    params = peft_lora_params(model)
    assert set(params) == set(values)
    with torch.no_grad():
        for k, v in values.items():
            params[k].copy_(torch.from_numpy(v))


def sample_batch(vocab: int, batch: int, seq: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Right-padded rows of different lengths, some prompt tokens masked with -100."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, (batch, seq), dtype=np.int64)
    mask = np.ones((batch, seq), dtype=np.int64)
    for b in range(1, batch):
        mask[b, seq - (b * seq) // (batch + 1):] = 0
    labels = np.where(mask == 1, ids, -100)
    labels[0, : seq // 4] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def torch_batch(batch: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(v) for k, v in batch.items()}


def head_weight_views(bundle) -> tuple[str, list[str]]:
    """(the eval graph's LM head weight, the training graph's views of it): the views tile the weight's
    bytes in its shard file exactly, in order, and nothing in the training graph reads the whole weight."""
    import onnx
    from ort_trainer import manifest as mf

    ev = onnx.load(str(bundle.file(mf.EVAL_MODEL)), load_external_data=False)
    tr = onnx.load(str(bundle.file(mf.TRAINING_MODEL)), load_external_data=False)
    head = next(n for n in ev.graph.node if n.name.endswith("_untied"))
    whole = next(i for i in ev.graph.initializer if i.name == head.input[1])

    def ext(t):
        return {e.key: e.value for e in t.external_data}
    views = sorted((i for i in tr.graph.initializer if i.name.startswith("/chunked_head/w")),
                   key=lambda t: int(ext(t)["offset"]))
    offset = int(ext(whole).get("offset", 0))
    for v in views:
        assert ext(v)["location"] == ext(whole)["location"]
        assert int(ext(v)["offset"]) == offset and v.dims[1] == whole.dims[1]
        offset += int(ext(v)["length"])
    if views:
        assert offset == int(ext(whole).get("offset", 0)) + int(ext(whole)["length"])
        assert sum(v.dims[0] for v in views) == whole.dims[0]
        assert not any(whole.name in n.input for n in tr.graph.node)
    return whole.name, [v.name for v in views]


def dequantizations(g: onnx.GraphProto) -> list[tuple[int, onnx.NodeProto, str]]:
    """(index, node, codes) of each weight's dequantization in a training or eval graph: a DequantizeLinear (of
    codes, or of their gathered or sliced rows), or artifacts_gen/fast_dequant's rewrite of one (its last node,
    ".../w", which reads the codes through the gate ".../gate/x" or ".../lo/gate/x"; a weight split into its even
    and odd columns has two, ".../lo/w" and ".../hi/w")."""
    from artifacts_gen import fast_dequant

    by_name = {n.name: n for n in g.node}
    out = []
    for i, n in enumerate(g.node):
        if n.op_type == "DequantizeLinear" and not n.name.startswith(fast_dequant.PREFIX):
            out.append((i, n, n.input[0]))
        elif n.name.startswith(fast_dequant.PREFIX) and n.name.endswith("/w"):
            gate = by_name.get(n.name[:-1] + "gate/x") or by_name[n.name[:-1] + "lo/gate/x"]   # (the whole weight's)
            out.append((i, n, gate.input[0]))
    return out


def weight_reads(g: onnx.GraphProto) -> list[tuple[int, onnx.NodeProto, str]]:
    """dequantizations, and the MatMulNBits nodes that multiply by codes without dequantizing them."""
    return dequantizations(g) + [(i, n, n.input[1]) for i, n in enumerate(g.node) if n.op_type == "MatMulNBits"]


def eval_initializers(bundle) -> dict[str, onnx.TensorProto]:
    model = onnx.load(str(bundle.file(mf.EVAL_MODEL)))            # external data loaded by onnx itself
    return {i.name: i for i in model.graph.initializer}


def dequantized_here(bundle) -> dict[str, np.ndarray]:
    """source key -> codes x scales, in the source model's layout, computed here with onnx's own readers."""
    inits = eval_initializers(bundle)
    out = {}
    for q in bundle.manifest.quant.weights:
        t = inits[q.codes]
        codes = numpy_helper.to_array(t)
        if t.data_type == onnx.TensorProto.UINT8 and q.dtype == "uint4":    # the graphs' byte view of 4-bit codes,
            codes = np.stack([codes & 15, codes >> 4], axis=-1).reshape(codes.shape[0], -1)   # [N, K/block, block/2]
        codes = codes.astype(np.float32)
        scale = numpy_helper.to_array(inits[q.scale])
        groups = scale
        if q.block:
            groups = np.repeat(scale, q.block, axis=q.axis)
        elif q.axis == 0:
            groups = scale[:, None]
        w = codes * groups
        if q.offset:                                          # added per block after scaling, one per scale
            offset = numpy_helper.to_array(inits[q.offset]).reshape(scale.shape)
            w = w + np.repeat(offset, q.block, axis=q.axis)
        if q.codes_transposed:                                # codes [out, in] -> the onnx tensor [in, out]
            w = w.T
        out[q.source_key] = w.T if q.transposed else w
    return out


def with_dequantized_base(model, bundle):
    """An HF model (plain or PEFT-wrapped) whose quantized weights are replaced by the bundle's dequantized values,
    computed here from the codes and scales (the identity for an unquantized bundle)."""
    from peft import PeftModel

    inner = model.base_model.model if isinstance(model, PeftModel) else model
    params = {n.replace(".base_layer", ""): p for n, p in inner.named_parameters()}
    with torch.no_grad():
        for key, w in dequantized_here(bundle).items():
            params[key].copy_(torch.from_numpy(np.ascontiguousarray(w)))
    return model


def with_outputs(model: onnx.ModelProto) -> onnx.ModelProto:
    """An optimizer graph with AdamWOptimizer's optional outputs (the updated params and moments) as graph outputs,
    to run as an InferenceSession."""
    adam = next(n for n in model.graph.node if n.op_type == "AdamWOptimizer")
    seq = onnx.helper.make_sequence_type_proto(onnx.helper.make_tensor_type_proto(onnx.TensorProto.FLOAT, None))
    for name in ("new_params", "new_m", "new_v"):
        adam.output.append(name)
        model.graph.output.append(onnx.helper.make_value_info(name, seq))
    return model


OFFSET_K, OFFSET_N, OFFSET_BLOCK = 64, 24, 16


def offset_term_model(seed: int) -> onnx.ModelProto:
    """Two int4 weights through quantize_forward (offset term, transposes fused): A [k, n] read by m1(x1) and
    m3(x2), B by m2(x2), in that order (x1 [b, k], x2 [b, t, k]; outputs y1, y2, y3)."""
    from onnx import TensorProto, helper

    from artifacts_gen import quantize

    k, n = OFFSET_K, OFFSET_N
    rng = np.random.default_rng(seed)
    wa, wb = (rng.standard_normal((k, n)).astype(np.float32) for _ in range(2))
    x1 = helper.make_tensor_value_info("x1", TensorProto.FLOAT, ["b", k])
    x2 = helper.make_tensor_value_info("x2", TensorProto.FLOAT, ["b", "t", k])
    outs = [helper.make_tensor_value_info(y, TensorProto.FLOAT, None) for y in ("y1", "y2", "y3")]
    nodes = [helper.make_node("MatMul", ["x1", "A"], ["y1"], name="m1"),
             helper.make_node("MatMul", ["x2", "B"], ["y2"], name="m2"),
             helper.make_node("MatMul", ["x2", "A"], ["y3"], name="m3")]
    model = helper.make_model(helper.make_graph(nodes, "g", [x1, x2], outs, [numpy_helper.from_array(wa, "A"),
                                                                            numpy_helper.from_array(wb, "B")]),
                              opset_imports=[helper.make_opsetid("", 17)])
    model, entries = quantize.quantize_forward(model, "int4", OFFSET_BLOCK, set(), ".T")
    assert {e.onnx_name for e in entries} == {"A", "B"}
    quantize.fuse_transposes(model)
    return model


def offset_weight_here(model: onnx.ModelProto, name: str) -> np.ndarray:
    """Weight `name` [k, n] in float64, dequantized here from its stored [n, k] codes and [n, k / block] scales and
    offsets: W^T[n, k] = C[n, k] S[n, k // block] + O[n, k // block]."""
    from artifacts_gen import quantize

    inits = {i.name: i for i in model.graph.initializer}
    n, block = OFFSET_N, OFFSET_BLOCK
    c = quantize.read_tensor(inits[name + quantize.CODES]).astype(np.float64)
    s = numpy_helper.to_array(inits[name + quantize.SCALE]).astype(np.float64).reshape(n, -1)
    o = numpy_helper.to_array(inits[name + quantize.OFFSET]).astype(np.float64).reshape(n, -1)
    return (c * np.repeat(s, block, axis=1) + np.repeat(o, block, axis=1)).T


def run_offset_term_model(model: onnx.ModelProto, w: dict[str, np.ndarray], seed: int
                          ) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(ORT's y1, y2, y3; numpy's x1 @ A, x2 @ B, x2 @ A on the weights `w` (offset_weight_here))."""
    import onnxruntime as ort

    rng = np.random.default_rng(seed)
    a1 = rng.standard_normal((3, OFFSET_K)).astype(np.float32)
    a2 = rng.standard_normal((2, 5, OFFSET_K)).astype(np.float32)
    want = (a1 @ w["A"], a2 @ w["B"], a2 @ w["A"])
    got = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        ["y1", "y2", "y3"], {"x1": a1, "x2": a2})
    return got, list(want)
