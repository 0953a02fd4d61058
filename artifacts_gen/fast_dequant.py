"""The training and eval graphs' weight dequantizations, rewritten into ops ORT 1.19 runs several times faster.

ORT 1.19.2's DequantizeLinear is single-threaded and scalar except per tensor with uint8 codes (bench.dequant_kernels,
run 2026-12-07T0255Z, ns per weight element at 1 / 2 threads): blocked uint4 with a zero point 2.27 / 2.32, int8 per
column 1.89 / 1.94, uint8 per tensor 0.16 / 0.15, int8 as Cast + Mul 0.57 / 0.35. It took 32% of a Qwen2.5-0.5B int4
training step. So each gated DequantizeLinear of a linear weight's codes (an initializer; quantize.py) becomes:

  int8 codes q, a scale per row, per column or per block along an axis:
      Cast(q) to float32, times the scales (broadcast; blocks: a Reshape into [.., blocks, block, ..] and back)
  uint4 codes C [N, K] (two a byte, the first in the low nibble), a scale per block along K, zero point 8:
      in the forward pass (every reader computes A W^T, as FusedMatMul or Gemm with transB), MatMulNBits over the
      codes' bytes, which multiplies without a float32 copy of the weight (zero point 8 is its default; nbits.py);
      a weight with offsets (W^T = C S + O per block: int4, Q4_K) whose readers' outputs feed only the offset
      term's Add (quantize._add_offset_term) instead gets float zero points zp = -O / S = 8 - (O + 8 S) / S,
      computed from the gated offsets and scales, and the offset term goes from the forward pass (_offset_add;
      not for a weight with a zero scale, whose block no zero point can give). In ORT 1.19 without prepacking
      MatMulNBits dequantizes B into a float32 buffer and runs an SGEMM; with float zero points that dequantization
      is its other loop, which measured faster, not slower (2 threads, medians of 37 runs, 2026-12-07): [256, 896]
      x [4864, 896]^T 36.4 ms with float zero points, 42.6 without, 45.2 with the offset term, 29.9 in float32;
      [256, 4864] x [896, 4864]^T 32.4 / 40.1 / 46.2 / 28.7 ms;
      a backward reader dY W (the pass's dX) as two matmuls over W's even and odd input columns, the bytes' low
      nibbles (B << 4) >> 4 and high nibbles B >> 4, each half dequantized alone by a DequantizeLinear per row of
      its [N * K / block, block / 2] view (axis 0: a row's block scale and the zero point), the high half gated on
      the low half's product, and the two products interleaved (_split_nodes: at most half the weight in float32 at
      once); any other reader (none in the bundles built so far): the whole weight, both halves interleaved
      (_uint4_nodes).

Each value is (q - z) * s rounded once, as DequantizeLinear computes it: the weights are the same bit for bit
(tests/test_fast_dequant.py); MatMulNBits' products are float32 sums in another order. The codes are gated on the
DequantizeLinear's gated scales (recompute.gate_nodes), since a Cast or a BitwiseAnd of an initializer would be a
constant (folded into a float32 copy on the heap, at session start). The uint4 codes initializer is retyped to the
uint8 [N, K / block, block / 2] of the same bytes in place (same name, same external data: MatMulNBits' B;
quantize.codes_array reads both forms). The decoder has its own graph (nbits.py), and DequantizeLinear nodes of
computed codes (the LM head's vocabulary slices, the embedding lookups) or of the vocabulary are left as they are.

Measured (Qwen2.5-0.5B random weights, forward and backward of 2 x 128 tokens, 2 threads, alternating processes,
2026-12-07): float32 2.7-2.9 s; int4 4.9 s before, 3.7 s after (0.57x -> 0.74x of float32), peak RSS 1,290 -> 1,248
MiB; --memory low at 1 x 128: peak anonymous 638 -> 629 MiB (the whole-weight form for the backward: 689). int8 4.3
s before, 3.3-3.6 s after (0.68x -> ~0.85x). The zero-point fold, on another host (medians of 6 alternating rounds):
float32 3.65 s, int4 5.15 s without, 4.66 s with (0.71x -> 0.78x); profiled kernel time 5.29 -> 5.08 s a pass
(MatMulNBits 1.69 -> 1.45 s; the forward /dequant/ nodes, gates, casts and the offset term, 0.26 -> 0.10 s),
float32 3.65 s. What was left was the backward pass: its half matmuls 1.3 s and their dequantization 0.56 s (a
BitwiseAnd by 15, a per-tensor DequantizeLinear and a Mul by the block scales broadcast over spans of 16, 0.24 s of
it); the two shifts and the DequantizeLinear per row (_half_nodes), medians of 5 alternating rounds on a slower
host: float32 4.36 s, int4 6.00 -> 5.16 s (0.73x -> 0.85x; per round 0.77x-0.93x, median 0.82x).
"""
from __future__ import annotations

import copy

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from .recompute import backward_nodes, drop_dead, gate_nodes, readers

PREFIX = "/fastdq/"


def _attrs(n: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in n.attribute}


def _const(g: onnx.GraphProto, have: set[str], tag: str, value, dtype) -> str:
    name = PREFIX + tag
    if name not in have:
        g.initializer.append(numpy_helper.from_array(np.asarray(value, dtype=dtype), name))
        have.add(name)
    return name


def _plan(n: onnx.NodeProto, inits: dict, base_dir: str) -> tuple[str, int] | None:
    """("int8" | "uint4", zero point) when this DequantizeLinear can be rewritten: its codes an initializer (2-D),
    its scale a computed (gated) tensor, and its form one of the module note's."""
    if n.input[0] not in inits or n.input[1] in inits:
        return None
    codes, a = inits[n.input[0]], _attrs(n)
    if len(codes.dims) != 2:
        return None
    axis, block = a.get("axis", 1) % 2, a.get("block_size", 0)
    zp = n.input[2] if len(n.input) > 2 and n.input[2] else None
    if codes.data_type == TensorProto.INT8 and zp is None:
        return ("int8", 0) if not block or codes.dims[axis] % block == 0 else None
    if codes.data_type == TensorProto.UINT4 and block and axis == 1 and block % 2 == 0 and codes.dims[1] % block == 0:
        value = 0 if zp is None else _zero_point(inits[zp], base_dir)
        return None if value is None else ("uint4", value)
    return None


def _zero_point(t: onnx.TensorProto, base_dir: str) -> int | None:
    """The one value of a uint4 zero-point tensor, or None if its values differ."""
    from .quantize import read_tensor

    values = np.unique(read_tensor(t, base_dir))
    return int(values[0]) if values.size == 1 else None


def _int8_nodes(g, have, n, codes: onnx.TensorProto, p: str) -> list[onnx.NodeProto]:
    a = _attrs(n)
    axis, block = a.get("axis", 1) % 2, a.get("block_size", 0)
    rows, cols = (int(d) for d in codes.dims)
    make = helper.make_node
    nodes = gate_nodes(n.input[0], n.input[1], p + "gate/", _const(g, have, "zero", 0, np.int64))
    nodes.append(make("Cast", [p + "gate/x"], [p + "f"], name=p + "f", to=TensorProto.FLOAT))
    if not block:
        if axis == 1:                                   # [K, N] * s[N]
            return nodes + [make("Mul", [p + "f", n.input[1]], [n.output[0]], name=p + "w")]
        return nodes + [make("Unsqueeze", [n.input[1], _const(g, have, "axis1", [1], np.int64)], [p + "s"],
                             name=p + "s"),
                        make("Mul", [p + "f", p + "s"], [n.output[0]], name=p + "w")]
    split = [rows // block, block, cols] if axis == 0 else [rows, cols // block, block]
    s_axis = _const(g, have, f"axis{axis + 1}", [axis + 1], np.int64)
    return nodes + [
        make("Reshape", [p + "f", _const(g, have, "x".join(map(str, split)), split, np.int64)], [p + "f3"],
             name=p + "f3"),
        make("Unsqueeze", [n.input[1], s_axis], [p + "s"], name=p + "s"),
        make("Mul", [p + "f3", p + "s"], [p + "w3"], name=p + "w3"),
        make("Reshape", [p + "w3", _const(g, have, f"{rows}x{cols}", [rows, cols], np.int64)], [n.output[0]],
             name=p + "w")]


def _half_nodes(g, have, n: onnx.NodeProto, codes: onnx.TensorProto, zp: int, part: str, after: str, scales: str,
                q: str) -> list[onnx.NodeProto]:
    """Nodes computing q + "w3", the float32 [N * K / block, block / 2] of a uint4 weight's even ("lo": the bytes'
    low nibbles, (B << 4) >> 4) or odd ("hi": B >> 4) input columns: its codes gated on `after`, and a
    DequantizeLinear per row of that view (axis 0) by `scales` (the block scales, flat: _scales_nodes) and the zero
    point. Measured on Qwen2.5-0.5B's [4864, 896] (2 threads, kernel ns per byte, 2026-12-07): the two shifts 0.58
    against a BitwiseAnd by 15's 0.9-1.0; the DequantizeLinear per row 0.51 against a per-tensor one (scale 1, the
    zero point) and a Mul by the scales broadcast over each row's 16 values, 0.45 + 0.89."""
    make = helper.make_node
    block = _attrs(n)["block_size"]
    rows, half = int(codes.dims[0]) * int(codes.dims[1]) // block, block // 2      # codes: uint4 [N, K]
    four = _const(g, have, "four", 4, np.uint8)
    nodes = gate_nodes(n.input[0], after, q + "gate/", _const(g, have, "zero", 0, np.int64))
    byte = q + "gate/x"
    if part == "lo":
        nodes.append(make("BitShift", [byte, four], [q + "up"], name=q + "up", direction="LEFT"))
        byte = q + "up"
    nodes += [make("BitShift", [byte, four], [q + "c"], name=q + "c", direction="RIGHT"),
              make("Reshape", [q + "c", _const(g, have, f"rows_{half}", [-1, half], np.int64)], [q + "c2"],
                   name=q + "c2")]
    zero_point = [_const(g, have, f"zp{zp}_{rows}", np.full(rows, zp), np.uint8)] if zp else []
    return nodes + [make("DequantizeLinear", [q + "c2", scales, *zero_point], [q + "w3"], name=q + "w3", axis=0)]


def _scales_nodes(g, have, n: onnx.NodeProto, p: str) -> list[onnx.NodeProto]:
    """p + "s": the gated block scales, flat [N * K / block] (_half_nodes' DequantizeLinear, MatMulNBits' scales)."""
    return [helper.make_node("Reshape", [n.input[1], _const(g, have, "flat", [-1], np.int64)], [p + "s"],
                             name=p + "s")]


def _uint4_nodes(g, have, n: onnx.NodeProto, codes: onnx.TensorProto, zp: int, p: str) -> list[onnx.NodeProto]:
    """The whole weight [N, K] (for a reader _splittable does not take): both halves, interleaved."""
    rows, cols = (int(d) for d in codes.dims)
    make = helper.make_node
    last = _const(g, have, "axis_last", [-1], np.int64)
    nodes = _scales_nodes(g, have, n, p)
    for part in ("lo", "hi"):
        nodes += _half_nodes(g, have, n, codes, zp, part, n.input[1], p + "s", f"{p}{part}/")
        nodes.append(make("Unsqueeze", [f"{p}{part}/w3", last], [f"{p}{part}/w4"], name=f"{p}{part}/w4"))
    return nodes + [
        make("Concat", [p + "lo/w4", p + "hi/w4"], [p + "pairs"], name=p + "pairs", axis=-1),
        make("Reshape", [p + "pairs", _const(g, have, f"{rows}x{cols}", [rows, cols], np.int64)], [n.output[0]],
             name=p + "w")]


def _splittable(r: onnx.NodeProto, w: str) -> bool:
    """r computes A W from weight w [N, K] as its B (the backward pass's dX = dY W): MatMul, or FusedMatMul or Gemm
    without transposes and (Gemm) without C."""
    a = _attrs(r)
    if len(r.input) < 2 or r.input[1] != w or r.input[0] == w or a.get("transA", 0) or a.get("transB", 0):
        return False
    if r.op_type == "FusedMatMul":
        return not a.get("transBatchA", 0) and not a.get("transBatchB", 0)
    if r.op_type == "Gemm":
        return (len(r.input) < 3 or not r.input[2]) and a.get("alpha", 1.0) == 1.0
    return r.op_type == "MatMul"


def _split_nodes(g, have, n: onnx.NodeProto, r: onnx.NodeProto, codes: onnx.TensorProto, zp: int, p: str
                 ) -> list[onnx.NodeProto]:
    """Reader r (A W, _splittable) of a uint4 weight as two matmuls over its even and odd input columns, the low
    and high nibbles of the codes' bytes, each dequantized alone (_half_nodes): A W[:, 0::2] and A W[:, 1::2],
    interleaved into r's output. The high half's codes are gated on the low half's product, so at most half the
    weight is float32 at a time: the whole weight dequantized at once (a first version, the nibbles interleaved by a
    uint8 Concat before the DequantizeLinear) took ~50 MiB more anonymous memory than DequantizeLinear did
    (Qwen2.5-0.5B int4, --memory low, micro-batch 1), and its interleave was a tenth of its time."""
    rows, cols = (int(d) for d in codes.dims)
    make = helper.make_node
    last = _const(g, have, "axis_last", [-1], np.int64)
    half = [rows, cols // 2]
    nodes = _scales_nodes(g, have, n, p)
    outs = []
    for part, after in (("lo", n.input[1]), ("hi", p + "lo/y")):
        q = f"{p}{part}/"
        nodes += _half_nodes(g, have, n, codes, zp, part, after, p + "s", q)
        nodes.append(make("Reshape", [q + "w3", _const(g, have, "x".join(map(str, half)), half, np.int64)], [q + "w"],
                          name=q + "w"))
        mm = copy.deepcopy(r)
        mm.input[1], mm.output[0], mm.name = q + "w", q + "y", q + "y"
        nodes += [mm, make("Unsqueeze", [q + "y", last], [q + "y1"], name=q + "y1")]
        outs.append(q + "y1")
    nodes += [make("Concat", outs, [p + "pairs"], name=p + "pairs", axis=-1),
              make("Shape", [p + "lo/y"], [p + "lead"], name=p + "lead", start=0, end=-1),
              make("Concat", [p + "lead", _const(g, have, f"k{cols}", [cols], np.int64)], [p + "shape"],
                   name=p + "shape", axis=0),
              make("Reshape", [p + "pairs", p + "shape"], [r.output[0]], name=p + "y")]
    return nodes


def as_bytes(codes: onnx.TensorProto, block: int) -> None:
    """In place: a uint4 [N, K] initializer as the uint8 [N, K / block, block / 2] of its bytes (external or inline,
    unchanged): MatMulNBits' B, and to the bit operations any shape will do."""
    rows, cols = (int(d) for d in codes.dims)
    codes.data_type = TensorProto.UINT8
    del codes.dims[:]
    codes.dims.extend([rows, cols // block, block // 2])


def _fusable(r: onnx.NodeProto, w: str) -> bool:
    """r computes A W^T (+ C) from weight w [N, K] as its B: FusedMatMul or Gemm with transB only."""
    a = _attrs(r)
    if len(r.input) < 2 or r.input[1] != w or r.input[0] == w or a.get("transA", 0) or not a.get("transB", 0):
        return False
    if r.op_type == "FusedMatMul":
        return a.get("alpha", 1.0) == 1.0 and not a.get("transBatchA", 0) and not a.get("transBatchB", 0)
    return r.op_type == "Gemm" and a.get("alpha", 1.0) == 1.0 and a.get("beta", 1.0) == 1.0


def _nbits_nodes(dq: onnx.NodeProto, r: onnx.NodeProto, codes: onnx.TensorProto, flat: str, p: str,
                 zero_points: str | None = None, out: str | None = None) -> list[onnx.NodeProto]:
    """Reader r of dq's weight as MatMulNBits over the codes' bytes (zero point 8, MatMulNBits' default, or the
    float `zero_points`; A of any rank) plus Gemm's C, into `out` (default r's output)."""
    block = _attrs(dq)["block_size"]
    n, k = (int(d) for d in codes.dims)                 # uint4 [N, K]: retyped after its readers (as_bytes)
    out = out or r.output[0]
    y = out if r.op_type == "FusedMatMul" or len(r.input) < 3 or not r.input[2] else p + "y"
    nodes = [helper.make_node("MatMulNBits", [r.input[0], codes.name, flat, *([zero_points] if zero_points else [])],
                              [y], name=p + "y", domain="com.microsoft", K=k, N=n, bits=4, block_size=block,
                              accuracy_level=0)]
    if y != out:
        nodes.append(helper.make_node("Add", [y, r.input[2]], [out], name=p + "y_bias"))
    return nodes


def _offset_add(g: onnx.GraphProto, dq: onnx.NodeProto, y: str, produced_by: dict, read_by) -> tuple[int, str] | None:
    """(index of the Add, O + 8 S) when reader output y feeds only the offset term's Add y + blocksum(X) (O + 8 S)^T
    (quantize._add_offset_term) of dq's own gated scales S, else None."""
    if len(read_by[y]) != 1 or g.node[read_by[y][0]].op_type != "Add":
        return None
    j = read_by[y][0]
    other = [x for x in g.node[j].input if x != y]
    m = produced_by.get(other[0]) if len(other) == 1 else None
    if m is None or m.op_type not in ("MatMul", "FusedMatMul", "Gemm") or len(m.input) != 2:
        return None
    o8, trans_b = m.input[1], _attrs(m).get("transB", 0)
    t = produced_by.get(o8)
    if not trans_b and t is not None and t.op_type == "Transpose" and _attrs(t).get("perm") == [1, 0]:
        o8, trans_b = t.input[0], 1
    a = produced_by.get(o8)
    if not trans_b or a is None or a.op_type != "Add":
        return None
    s8 = [produced_by.get(x) for x in a.input]
    if not any(x is not None and x.op_type == "Mul" and dq.input[1] in x.input for x in s8):
        return None
    return j, o8


def _zero_point_nodes(g, have, dq: onnx.NodeProto, o8: str, p: str) -> list[onnx.NodeProto]:
    """p + "zp": MatMulNBits' float zero points [N * K / block] of a weight C S + O, from O + 8 S and S (dq's gated
    scales): (C - zp) S = C S + O for zp = -O / S = 8 - (O + 8 S) / S. Every scale must be non-zero (_nonzero)."""
    make = helper.make_node
    return [make("Div", [o8, dq.input[1]], [p + "o_s"], name=p + "o_s"),
            make("Sub", [_const(g, have, "eight", 8.0, np.float32), p + "o_s"], [p + "zp2"], name=p + "zp2"),
            make("Reshape", [p + "zp2", _const(g, have, "flat", [-1], np.int64)], [p + "zp"], name=p + "zp")]


def _nonzero_scales(codes: str, inits: dict, base_dir: str) -> bool:
    """Whether every block scale of the weight with these codes is non-zero (a GGUF Q4_K sub-block may have scale 0:
    its values are its offset alone, which no zero point can give)."""
    from .quantize import CODES, SCALE, read_tensor

    scale = inits.get(codes.removesuffix(CODES) + SCALE) if codes.endswith(CODES) else None
    return scale is not None and bool(np.all(read_tensor(scale, base_dir) != 0))


def rewrite(model: onnx.ModelProto, codes: set[str], base_dir: str = ".") -> int:
    """In place: every gated DequantizeLinear of the initializers `codes` (the linear weights': not the vocabulary,
    whose whole-table dequantization in the eval graph would take a second float32 copy of the table for the Mul)
    in a form of the module note rewritten (all of a codes tensor's, or none). base_dir: where the model's external
    data lives (the zero points are read). -> how many were rewritten."""
    g = model.graph
    inits = {i.name: i for i in g.initializer}
    plans = {j: _plan(n, inits, base_dir) for j, n in enumerate(g.node) if n.op_type == "DequantizeLinear"}
    by_codes: dict[str, list[int]] = {}
    for j, n in enumerate(g.node):
        if n.input and n.input[0] in codes and n.input[0] in inits:
            by_codes.setdefault(n.input[0], []).append(j)
    have = set(inits)
    read_by = readers(g)
    produced_by = {o: n for n in g.node for o in n.output}
    bwd = backward_nodes(g, read_by)
    replace: dict[int, list[onnx.NodeProto]] = {}
    count = 0
    for name, users in by_codes.items():
        if not all(plans.get(j) for j in users):         # a codes tensor read otherwise too: left as it is
            continue
        for j in users:
            n = g.node[j]
            p = f"{PREFIX}{count}/"
            count += 1
            kind, zp = plans[j]
            if kind == "int8":
                replace[j] = _int8_nodes(g, have, n, inits[name], p)
                continue
            w = n.output[0]
            if (j not in bwd and zp == 8 and read_by[w]
                    and all(_fusable(g.node[r], w) and r not in bwd for r in read_by[w])):
                replace[j], flat = _scales_nodes(g, have, n, p), p + "s"
                adds = {r: _offset_add(g, n, g.node[r].output[0], produced_by, read_by) for r in read_by[w]}
                fold = (all(adds.values()) and len({o8 for _, o8 in adds.values()}) == 1
                        and _nonzero_scales(name, inits, base_dir))
                first = min(add for add, _ in adds.values()) if fold else None
                for r in read_by[w]:
                    if fold:        # at the Add's place, where O + 8 S exists (the reader's output fed it alone)
                        add = adds[r][0]
                        replace[r] = []
                        replace[add] = ((_zero_point_nodes(g, have, n, adds[r][1], p) if add == first else []) +
                                        _nbits_nodes(n, g.node[r], inits[name], flat, f"{p}{r}/", p + "zp",
                                                     g.node[add].output[0]))
                    else:
                        replace[r] = _nbits_nodes(n, g.node[r], inits[name], flat, f"{p}{r}/")
            elif len(read_by[w]) == 1 and _splittable(g.node[read_by[w][0]], w):
                replace[j] = []
                r = read_by[w][0]
                replace[r] = _split_nodes(g, have, n, g.node[r], inits[name], zp, p)
            else:
                replace[j] = _uint4_nodes(g, have, n, inits[name], zp, p)
        if inits[name].data_type == TensorProto.UINT4:
            as_bytes(inits[name], _attrs(g.node[users[0]])["block_size"])
    if not replace:
        return 0
    out = []
    for j, n in enumerate(g.node):
        out += replace.get(j, [n])
    del g.node[:]
    g.node.extend(out)
    drop_dead(g)                                   # the zero points' tensors, read by nothing now
    if any(n.op_type == "MatMulNBits" for n in g.node) and not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return count
