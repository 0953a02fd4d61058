"""A quantized frozen base: frozen linear weights stored as integer codes and scales, dequantized just in time.

Modes (`pocketlora gen --quant`):
  none  float32, as the source holds them
  int8  per output column, symmetric: W[:, n] = q[:, n] * s[n], q in [-127, 127]  (DequantizeLinear, axis 1)
  int4  per block of `block` rows (default 32) of one column, symmetric: W[k, n] = q[k, n] * s[k // block, n],
        q in [-8, 7]  (DequantizeLinear-21 with block_size; the graphs are converted to opset 21, to_opset)

What: every frozen weight read as the B input of a MatMul (Qwen2's and Gemma3's nn.Linear, stored W.T) or of a
Gemm without transB (GPT-2's Conv1D). The LoRA tensors, norms and biases stay float32, and so (for now) do the
token embedding and the LM head.

Memory. A DequantizeLinear of an initializer is a constant: ORT's constant folding would turn it back into a
float32 initializer (nothing saved, silently), and ORT would run every dequantization at the start of the step,
so every float32 copy would be alive at once. So each weight's dequantization reads its scales through a gate on
its layer's activation (recompute.gate_nodes; the scales, not the codes: ORT 1.19 has no int4 Reshape): it runs
right before its MatMul and its float32 copy is freed after it. The backward pass needs W again (dX = dY W^T); `recompute_dequantized` gives each backward reader its own
dequantization, gated on that reader's backward input, instead of keeping the forward's copy alive from the
forward pass to the backward pass. At most a few float32 weights exist at any time.
"""
from __future__ import annotations

import copy

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper, version_converter

from ort_trainer import manifest as mf

from .recompute import backward_nodes, gate_nodes, readers

MODES = ("none", "int8", "int4")
INT4_BLOCK = 32
INT4_OPSET = 21               # DequantizeLinear's int4 and block_size
PREFIX = "/dequant/"
CODES, SCALE = ".qcodes", ".qscale"
ZERO = PREFIX + "zero"
MIN_ELEMENTS = 1024           # smaller weights are not worth a node


class QuantError(ValueError):
    pass


def check_mode(mode: str, block: int) -> None:
    if mode not in MODES:
        raise QuantError(f"--quant {mode}: use one of {', '.join(MODES)}.")
    if mode == "int4" and (block < 2 or block % 2):
        raise QuantError(f"--quant-block {block}: use an even number >= 2 (default {INT4_BLOCK}).")


# ------------------------------------------------------------------------------------------ numbers

def quantize_array(w: np.ndarray, mode: str, block: int = INT4_BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """W [K, N] float32 -> (codes int8 [K, N], scales float32): int8 [N] per column, int4 [ceil(K/block), N]."""
    w = np.asarray(w, dtype=np.float32)
    if mode == "int8":
        scale = np.abs(w).max(axis=0) / 127.0
        groups = scale[None, :]
        lo, hi = -127, 127
    elif mode == "int8-rows":
        scale = np.abs(w).max(axis=1) / 127.0
        groups = scale[:, None]
        lo, hi = -127, 127
    elif mode == "int4":
        k, n = w.shape
        pad = (-k) % block
        absmax = np.abs(np.pad(w, ((0, pad), (0, 0)))).reshape(-1, block, n).max(axis=1)
        scale = absmax / 7.0
        groups = np.repeat(scale, block, axis=0)[:k]
        lo, hi = -8, 7
    else:
        raise QuantError(f"quantize_array: mode {mode!r}")
    scale = scale.astype(np.float32)
    safe = np.where(groups > 0, groups, 1.0).astype(np.float32)
    codes = np.clip(np.rint(w / safe), lo, hi).astype(np.int8)
    return codes, np.where(scale > 0, scale, np.float32(1.0)).astype(np.float32)


def dequantize_array(codes: np.ndarray, scale: np.ndarray, block: int = 0, axis: int = 1) -> np.ndarray:
    """The float32 weight a quantized weight stands for: codes * scale, per column (axis 1), per row (axis 0), or
    per block of `block` rows of a column."""
    scale = np.asarray(scale, dtype=np.float32)
    if block:
        scale = np.repeat(scale, block, axis=0)[: codes.shape[0]]
    elif axis == 0:
        scale = scale[:, None]
    return codes.astype(np.float32) * scale


def int4_tensor(codes: np.ndarray, name: str) -> TensorProto:
    """An ONNX INT4 tensor: two codes a byte, the first in the low nibble (as onnx.helper.make_tensor packs)."""
    flat = codes.reshape(-1).astype(np.int8)
    if flat.size % 2:
        flat = np.concatenate([flat, np.zeros(1, np.int8)])
    packed = (flat[0::2].view(np.uint8) & 0x0F) | ((flat[1::2].view(np.uint8) & 0x0F) << 4)
    t = TensorProto(name=name, data_type=TensorProto.INT4, dims=list(codes.shape))
    t.raw_data = packed.astype(np.uint8).tobytes()
    return t


def read_tensor(t: TensorProto, base_dir: str = ".") -> np.ndarray:
    """An initializer's values (its external data read from base_dir); INT4 codes unpacked into int8."""
    if t.data_location == TensorProto.EXTERNAL:
        t = copy.deepcopy(t)
        onnx.external_data_helper.load_external_data_for_tensor(t, base_dir)
        t.data_location = TensorProto.DEFAULT
        del t.external_data[:]
    if t.data_type != TensorProto.INT4:
        return numpy_helper.to_array(t)
    raw = np.frombuffer(t.raw_data, dtype=np.uint8)
    both = np.stack([raw & 0x0F, raw >> 4], axis=1).reshape(-1).astype(np.int8)
    both = np.where(both > 7, both - 16, both).astype(np.int8)
    return both[: int(np.prod(t.dims))].reshape(list(t.dims))


# ------------------------------------------------------------------------------------------ graphs

def to_opset(model: onnx.ModelProto, version: int) -> onnx.ModelProto:
    """The model with its default-domain opset converted to `version` (onnx's version converter), initializers
    untouched: the converter sees them as graph inputs, so external data and GB-sized weights never pass through it."""
    current = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
    if current >= version:
        return model
    inits = list(model.graph.initializer)
    shell = onnx.ModelProto()
    shell.CopyFrom(model)
    del shell.graph.initializer[:]
    n_inputs = len(shell.graph.input)
    shell.graph.input.extend(helper.make_tensor_value_info(i.name, i.data_type, list(i.dims)) for i in inits)
    out = version_converter.convert_version(shell, version)
    del out.graph.input[n_inputs:]
    out.graph.initializer.extend(inits)
    out.ir_version = model.ir_version
    return out


def _weights_to_quantize(g: onnx.GraphProto, keep: set[str]) -> dict[str, int]:
    """Name -> index of its first reader, for every frozen float32 2-D initializer read as a MatMul's B or a Gemm's B
    without transB, and by nothing else."""
    inits = {i.name: i for i in g.initializer}
    read_by = readers(g)
    out = {}
    for idx, n in enumerate(g.node):
        if n.op_type not in ("MatMul", "Gemm") or len(n.input) < 2:
            continue
        name = n.input[1]
        init = inits.get(name)
        if init is None or name in keep or name in out or init.data_type != TensorProto.FLOAT or len(init.dims) != 2:
            continue
        if int(np.prod(init.dims)) < MIN_ELEMENTS:
            continue
        ok = all(_reads_as_b(g.node[j], name) for j in read_by[name])
        if ok:
            out[name] = idx
    return out


def _reads_as_b(n: onnx.NodeProto, name: str) -> bool:
    if list(n.input).count(name) != 1 or len(n.input) < 2 or n.input[1] != name:
        return False
    if n.op_type == "MatMul":
        return True
    return n.op_type == "Gemm" and not any(a.name == "transB" and a.i for a in n.attribute)


def _dq_node(codes: str, scale: str, out: str, name: str, block: int) -> onnx.NodeProto:
    if block:
        return helper.make_node("DequantizeLinear", [codes, scale], [out], name=name, axis=0, block_size=block)
    return helper.make_node("DequantizeLinear", [codes, scale], [out], name=name, axis=1)


def quantize_forward(model: onnx.ModelProto, mode: str, block: int, keep: set[str], transposed_suffix: str,
                     ) -> tuple[onnx.ModelProto, list[mf.QuantizedWeight]]:
    """Replace the frozen linear weights of the forward graph (float32 initializers, values inline) by codes +
    scales and a gated DequantizeLinear whose output keeps the weight's name, so every reader is unchanged.
    `keep`: initializers never quantized (the LoRA tensors). -> (the model, possibly at a new opset; the list)."""
    if mode == "none":
        return model, []
    if mode == "int4":
        model = to_opset(model, INT4_OPSET)
    g = model.graph
    inits = {i.name: i for i in g.initializer}
    chosen = _weights_to_quantize(g, keep)
    inserts: dict[int, list[onnx.NodeProto]] = {}
    entries = []
    for k, (name, reader) in enumerate(chosen.items()):
        init = inits[name]
        w = numpy_helper.to_array(init)
        codes, scale = quantize_array(w, mode, block)
        use_block = block if mode == "int4" else 0
        codes_t = int4_tensor(codes, name + CODES) if mode == "int4" else numpy_helper.from_array(codes, name + CODES)
        g.initializer.remove(init)
        g.initializer.extend([codes_t, numpy_helper.from_array(scale, name + SCALE)])
        p = f"{PREFIX}{k}/"
        nodes = gate_nodes(name + SCALE, g.node[reader].input[0], p, ZERO)
        nodes.append(_dq_node(name + CODES, p + "x", name, p + "dq", use_block))
        inserts.setdefault(reader, []).extend(nodes)
        transposed = name.endswith(transposed_suffix)
        entries.append(mf.QuantizedWeight(
            onnx_name=name, source_key=name[: -len(transposed_suffix)] if transposed else name, transposed=transposed,
            shape=[int(d) for d in init.dims], codes=name + CODES, scale=name + SCALE,
            dtype="int4" if mode == "int4" else "int8", axis=0 if use_block else 1, block=use_block))
    if entries:
        out = []
        for j, n in enumerate(g.node):
            out += inserts.get(j, [])
            out.append(n)
        del g.node[:]
        g.node.extend(out)
        g.initializer.append(numpy_helper.from_array(np.asarray(0, dtype=np.int64), ZERO))
    return model, entries + quantize_vocab(model, keep)


def _vocab_weights(g: onnx.GraphProto, keep: set[str]) -> list[str]:
    """[V, H] float32 initializers read only as a Gather's table (axis 0: an embedding lookup) or as the B of a
    Gemm with transB (the LM head, tied or not: graph_fixes.untie_head)."""
    inits = {i.name: i for i in g.initializer}
    read_by = readers(g)
    out = []
    for name, init in inits.items():
        if (name in keep or init.data_type != TensorProto.FLOAT or len(init.dims) != 2 or not read_by.get(name)
                or int(np.prod(init.dims)) < MIN_ELEMENTS):
            continue
        if all(_reads_as_table(g.node[j], name) or _reads_as_head(g.node[j], name) for j in read_by[name]):
            out.append(name)
    return out


def _reads_as_table(n: onnx.NodeProto, name: str) -> bool:
    return (n.op_type == "Gather" and n.input[0] == name and name not in n.input[1:]
            and all(a.name != "axis" or a.i == 0 for a in n.attribute))


def _reads_as_head(n: onnx.NodeProto, name: str) -> bool:
    return (n.op_type == "Gemm" and len(n.input) >= 2 and n.input[1] == name and n.input[0] != name
            and any(a.name == "transB" and a.i for a in n.attribute))


def gather_dequantized(codes: str, scale: str, idx: str, out: str, p: str, axis_last: str) -> list[onnx.NodeProto]:
    """out = rows idx of a per-row int8 table, dequantized: Gather the codes and the scales, multiply."""
    n = helper.make_node
    return [n("Gather", [codes, idx], [p + "q"], name=p + "q", axis=0),
            n("Cast", [p + "q"], [p + "f"], name=p + "f", to=TensorProto.FLOAT),
            n("Gather", [scale, idx], [p + "s"], name=p + "s", axis=0),
            n("Unsqueeze", [p + "s", axis_last], [p + "s1"], name=p + "s1"),
            n("Mul", [p + "f", p + "s1"], [out], name=p + "w")]


AXIS_LAST = PREFIX + "axis_last"


def quantize_vocab(model: onnx.ModelProto, keep: set[str]) -> list[mf.QuantizedWeight]:
    """The token embedding and the LM head ([V, H], tied or not) as int8 codes with one scale per vocabulary row,
    in place. A lookup gathers the codes and scales of its rows only; the head's readers get a gated per-row
    DequantizeLinear (the training graph's chunked head replaces it by one per vocabulary slice: head_loss)."""
    g = model.graph
    names = _vocab_weights(g, keep)
    if not names:
        return []
    inits = {i.name: i for i in g.initializer}
    read_by = readers(g)
    replace: dict[int, list[onnx.NodeProto]] = {}
    entries = []
    for k, name in enumerate(names):
        init = inits[name]
        codes, scale = quantize_array(numpy_helper.to_array(init), "int8-rows")
        g.initializer.remove(init)
        g.initializer.extend([numpy_helper.from_array(codes, name + CODES), numpy_helper.from_array(scale, name + SCALE)])
        for r, j in enumerate(read_by[name]):
            node, p = g.node[j], f"{PREFIX}vocab{k}/{r}/"
            if node.op_type == "Gather":
                replace[j] = gather_dequantized(name + CODES, name + SCALE, node.input[1], node.output[0], p, AXIS_LAST)
            else:
                gated = gate_nodes(name + SCALE, node.input[0], p, ZERO)
                gated.append(helper.make_node("DequantizeLinear", [name + CODES, p + "x"], [p + "w"], name=p + "dq",
                                              axis=0))
                node.input[1] = p + "w"
                replace[j] = gated + [node]
        entries.append(mf.QuantizedWeight(onnx_name=name, source_key=name, transposed=False,
                                          shape=[int(d) for d in init.dims], codes=name + CODES, scale=name + SCALE,
                                          dtype="int8", axis=0, block=0))
    out = []
    for j, n in enumerate(g.node):
        out += replace.get(j, [n])
    del g.node[:]
    g.node.extend(out)
    for extra in (numpy_helper.from_array(np.asarray(0, dtype=np.int64), ZERO),
                  numpy_helper.from_array(np.asarray([-1], dtype=np.int64), AXIS_LAST)):
        if extra.name not in {i.name for i in g.initializer}:
            g.initializer.append(extra)
    return entries


def recompute_dequantized(model: onnx.ModelProto, weights: list[str]) -> int:
    """In the training graph: each backward reader of a dequantized weight gets its own DequantizeLinear of the
    codes, gated on one of the reader's backward inputs, so the forward's float32 copy dies with its MatMul. A
    backward reader with no backward input (e.g. a Transpose of W alone) is gated through its own readers'.
    In place; -> how many readers were rewired."""
    g = model.graph
    weights = set(weights)
    read_by = readers(g)
    bwd = backward_nodes(g, read_by)
    produced_by = {o: i for i, n in enumerate(g.node) for o in n.output}
    dq = {n.output[0]: n for n in g.node if n.op_type == "DequantizeLinear" and n.output[0] in weights}
    inserts: dict[int, list[onnx.NodeProto]] = {}
    count = 0
    for w, node in dq.items():
        for j in [j for j in read_by[w] if j in bwd]:
            reader = g.node[j]
            gate = next((d for d in reader.input if d in produced_by and produced_by[d] in bwd and d != w), None)
            if gate is None:                 # e.g. Transpose(W): gate on what its first backward reader reads
                later = [r for o in reader.output for r in read_by[o] if r in bwd]
                gate = next((d for r in later for d in g.node[r].input
                             if d in produced_by and produced_by[d] in bwd and d not in reader.output), None)
            if gate is None:
                continue
            p = f"{PREFIX}bwd/{count}/"
            scale = node.input[1]
            while scale.startswith(PREFIX) and scale in produced_by:      # the forward's gated alias -> the scales
                scale = g.node[produced_by[scale]].input[0]
            nodes = gate_nodes(scale, gate, p, ZERO)
            new = copy.deepcopy(node)
            new.input[1], new.output[0], new.name = p + "x", p + "w", p + "dq"
            nodes.append(new)
            inserts.setdefault(j, []).extend(nodes)
            reader.input[:] = [p + "w" if x == w else x for x in reader.input]
            count += 1
    if count:
        out = []
        for j, n in enumerate(g.node):
            out += inserts.get(j, [])
            out.append(n)
        del g.node[:]
        g.node.extend(out)
        if not any(i.name == ZERO for i in g.initializer):    # ORT's constant sharing renamed the forward's
            g.initializer.append(numpy_helper.from_array(np.asarray(0, dtype=np.int64), ZERO))
    return count



# ------------------------------------------------------------------------------------------ reading a bundle

def dequantized_weights(bundle_dir, quant: mf.QuantSpec) -> dict[str, np.ndarray]:
    """A quantized bundle's frozen weights as the graphs compute them, by source key in the source model's layout
    (what a PyTorch reference of the bundle must load). {} for an unquantized bundle."""
    if not quant.weights:
        return {}
    from pathlib import Path

    bundle_dir = Path(bundle_dir)
    graph = onnx.load(str(bundle_dir / mf.EVAL_MODEL), load_external_data=False).graph
    inits = {i.name: i for i in graph.initializer}
    out = {}
    for q in quant.weights:
        w = dequantize_array(read_tensor(inits[q.codes], str(bundle_dir)), read_tensor(inits[q.scale], str(bundle_dir)),
                             q.block, q.axis)
        out[q.source_key] = np.ascontiguousarray(w.T) if q.transposed else w
    return out
