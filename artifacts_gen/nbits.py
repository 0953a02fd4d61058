"""The decoder's quantized matmuls as ORT's MatMulNBits over the bundle's own codes: no weight is dequantized.

A quantized base's training graphs dequantize each weight just in time (quantize.py): at a batch of 128+ tokens the
DequantizeLinear is small beside the matmul. At decode time (one token) it is everything: materializing a weight in
float32 from its codes cost 10-17x the float32 matmul itself, and the decoder did it for every weight and every
token (the real Gemma3-270M keep bundle: 2.8 tok/s). MatMulNBits (com.microsoft; in ORT 1.19 and onnxruntime-web
1.19) multiplies by 4-bit codes directly, accumulating in float32 (accuracy_level 0):

    MatMulNBits(A, B, scales):  Y[m, n] = sum_k A[m, k] * (B[n, k] - 8) * scales[n, k // block]

with B packed [N, K / block, block / 2] (two codes a byte, the first in the low nibble). Every quantized weight is
W^T[n, k] = C[n, k] * S[n, b] + O[n, b] (b = k // block), so

    Y = MatMulNBits(A, C, S) + blocksum(A) @ (O + 8 S)^T,    blocksum(A)[m, b] = sum_{k in block b} A[m, k]

exactly up to float32 rounding: uint4 codes with a float offset per block (int4's asymmetric blocks, GGUF's Q4_K)
need no integer zero point. MatMulNBits has 4 bits only in 1.19; an 8-bit code q (int8, GGUF's Q8_0 / Q5_0 / Q6_K)
is one byte, q + 128 = l + 16 h in offset binary (q XOR 0x80), i.e. two 4-bit codes (l, h) in a row. Read as 2K
codes against A interleaved with 16 A ([a_0, 16 a_0, a_1, 16 a_1, ...]), blocks of 2 x block:

    sum_k a_k s ((l_k - 8) + 16 (h_k - 8)) = sum_k a_k s (q_k - 8)

so the same correction (O = 0) makes it exact. The graph reads the codes as stored (the training graphs' layout:
4-bit codes [out, in] with the blocks along in, 8-bit codes [in, out]: quantize.py; the vocabulary's [V, H]): uint4
codes are MatMulNBits' B byte for byte; int8 codes are XORed with 0x80 (and transposed unless [V, H]) by nodes over
the initializer, which ORT folds into a constant when the session starts (memory: a copy of the 8-bit codes;
disk: nothing new).

Measured (2026-12-06, 2 threads, this machine): 24 layers of Qwen2.5's MLP, one token, so that no weight stays in
cache: float32 MatMul 30.4 ms, MatMulNBits 12.2 ms. The real Gemma3-270M keep bundle decodes at ~20 tok/s (it was
2.8) and its session takes ~2.4 s to start (0.7 s before: the XOR of the 8-bit codes is folded then;
docs/bench/runs/2026-12-06T1704Z-decode).
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ort_trainer import manifest as mf

from .quantize import INT4_OPSET, dequant_chains, to_opset
from .recompute import drop_dead, readers

PREFIX = "/nbits/"
BLOCKS = (128, 64, 32, 16)      # MatMulNBits' block sizes, for weights with one scale per row or column


def _matmul_readers(g: onnx.GraphProto, read_by, w: str) -> list[tuple[int, bool]] | None:
    """(node index, transB) of every reader of weight w, or None unless all are matmuls reading it as B:
    MatMul / Gemm (W [K, N]) or Gemm with transB (W [N, K], the LM head), without alpha, beta or transA."""
    out = []
    for j in read_by[w]:
        n = g.node[j]
        attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
        if len(n.input) < 2 or n.input[1] != w or n.input[0] == w:
            return None
        if n.op_type == "MatMul":
            out.append((j, False))
        elif (n.op_type == "Gemm" and not attrs.get("transA", 0) and attrs.get("alpha", 1.0) == 1.0
              and attrs.get("beta", 1.0) == 1.0):
            out.append((j, bool(attrs.get("transB", 0))))
        else:
            return None
    return out or None


class _Builder:
    """Nodes and constants under one name prefix."""

    def __init__(self, g: onnx.GraphProto, p: str):
        self.g, self.p, self.nodes = g, p, []

    def const(self, name: str, value, dtype) -> str:
        self.g.initializer.append(numpy_helper.from_array(np.asarray(value, dtype=dtype), self.p + name))
        return self.p + name

    def op(self, op: str, inputs: list[str], out: str, **attrs) -> str:
        domain = "com.microsoft" if op == "MatMulNBits" else ""
        self.nodes.append(helper.make_node(op, inputs, [self.p + out], name=self.p + out, domain=domain, **attrs))
        return self.p + out


def _pick_block(k: int) -> int:
    return next((b for b in BLOCKS if k % b == 0), 0)


def _fits(q: mf.QuantizedWeight, codes: onnx.TensorProto, codes_nk: bool) -> tuple[int, int, int] | None:
    """(N, K, block) when MatMulNBits can run the weight from its codes ([N, K] or [K, N], uint4 or int8): scales per
    block along K (a power of two >= 16), or one per output (then blocks of BLOCKS)."""
    rows, cols = (int(d) for d in codes.dims)
    n, k = (rows, cols) if codes_nk else (cols, rows)
    if q.dtype not in ("uint4", "int8") or (q.dtype == "uint4" and (k % 2 or not codes_nk)):
        return None
    k_axis = 1 if codes_nk else 0
    if q.block:
        block = q.block if q.axis == k_axis and q.block >= 16 and q.block & (q.block - 1) == 0 else 0
    else:
        block = _pick_block(k) if q.axis == 1 - k_axis else 0
    span = block if q.dtype == "uint4" else 2 * block              # 8-bit codes: two nibbles a code
    return (n, k, block) if block and k % block == 0 and span <= 256 else None


def _codes_nk(b: _Builder, q: mf.QuantizedWeight, codes: onnx.TensorProto, codes_nk: bool, n: int, k: int,
              block: int):
    """-> (B, scales, K and block as MatMulNBits counts them, whether A is interleaved, (O + 8 S)^T [K/block, N]) for
    the formula of the module note. B is the stored bytes themselves (uint4 [N, K]), or the stored bytes XOR 0x80
    (int8; [K, N] transposed first): nodes over initializers, folded when the session starts, as are the scales'."""
    nb = k // block
    four = q.dtype == "uint4"
    view = TensorProto(name=b.p + "codes_u8", data_type=TensorProto.UINT8,
                       dims=[n, nb, block // 2 if four else block] if codes_nk else [nb, block, n])
    view.raw_data = codes.raw_data            # the same bytes (link_to_shards points it at the shards' copy)
    b.g.initializer.append(view)
    if four:
        packed, kk, bb, interleaved = view.name, k, block, False
    else:          # int8 q, offset-binary (q ^ 0x80 = q + 128 = l + 16 h'): nibbles (l, h') = 2 entries along K
        values = view.name if codes_nk else b.op("Transpose", [view.name], "bytes_nk", perm=[2, 0, 1])
        packed = b.op("BitwiseXor", [values, b.const("sign", 128, np.uint8)], "packed")
        kk, bb, interleaved = 2 * k, 2 * block, True
    q_scale = _float32(b, q.scale, "scale32")
    if q.block:
        scale = q_scale if codes_nk else b.op("Transpose", [q_scale], "scale_nk", perm=[1, 0])
    else:
        scale = b.op("Expand", [b.op("Unsqueeze", [q_scale, b.const("axis1", [1], np.int64)], "scale_col"),
                                b.const("nb_shape", [n, nb], np.int64)], "scale_nk")
    flat = b.op("Reshape", [scale, b.const("flat", [-1], np.int64)], "scale_flat")
    correction = b.op("Mul", [scale, b.const("eight", 8, np.float32)], "eight_s")          # [N, nb]
    if q.offset:                     # uint4: stored [N, nb, 1] (quantize_forward)
        offset = b.op("Reshape", [_float32(b, q.offset, "offset32"), b.const("offset_shape", [n, nb], np.int64)],
                      "offset_nk")
        correction = b.op("Add", [offset, correction], "offset8")
    return packed, flat, kk, bb, interleaved, b.op("Transpose", [correction], "correction_t", perm=[1, 0])


def _float32(b: _Builder, name: str, tag: str) -> str:
    """An initializer as float32: int4's float16 scales and offsets get a Cast (folded when the session starts)."""
    init = next(i for i in b.g.initializer if i.name == name)
    return b.op("Cast", [name], tag, to=TensorProto.FLOAT) if init.data_type == TensorProto.FLOAT16 else name


def _matmul(b: _Builder, node: onnx.NodeProto, fused, n: int, k: int, block: int, tag: str, shared: dict
            ) -> list[onnx.NodeProto]:
    """The nodes that replace one matmul reader, in 2-D: MatMulNBits (of A, or for 8-bit codes of A interleaved with
    16 A) + blocksum(A) @ (O + 8 S)^T (+ Gemm's C), reshaped to A's leading dimensions and N. `shared`: A's 2-D view,
    interleaving and block sums made for an earlier reader of the same A (q, k and v read one activation), reused."""
    packed, flat, kk, bb, interleaved, correction_t = fused
    first = len(b.nodes)
    a = node.input[0]

    def once(key, make):
        if key not in shared:
            shared[key] = make()
        return shared[key]

    a2 = once((a, "2d"), lambda: b.op("Reshape", [a, b.const(f"rows{tag}", [-1, k], np.int64)], f"a2d{tag}"))
    if interleaved:
        def interleave():
            last = b.const(f"last_axis{tag}", [2], np.int64)
            a16 = b.op("Mul", [a2, b.const(f"sixteen{tag}", 16, np.float32)], f"a16{tag}")
            pairs = [b.op("Unsqueeze", [a2, last], f"a_lo{tag}"), b.op("Unsqueeze", [a16, last], f"a_hi{tag}")]
            return b.op("Reshape", [b.op("Concat", pairs, f"a_pairs{tag}", axis=2),
                                    b.const(f"rows2{tag}", [-1, kk], np.int64)], f"a_interleaved{tag}")
        a_in = once((a, "interleaved"), interleave)
    else:
        a_in = a2

    def block_sums():
        blocks = b.op("Reshape", [a2, b.const(f"blocks{tag}", [-1, k // block, block], np.int64)], f"a_blocks{tag}")
        return b.op("ReduceSum", [blocks, b.const(f"last{tag}", [-1], np.int64)], f"a_sums{tag}", keepdims=0)
    sums = once((a, "sums", block), block_sums)
    y = b.op("MatMulNBits", [a_in, packed, flat], f"y{tag}", K=kk, N=n, bits=4, block_size=bb, accuracy_level=0)
    y = b.op("Add", [y, b.op("MatMul", [sums, correction_t], f"corr{tag}")], f"y_corr{tag}")
    if node.op_type == "Gemm" and len(node.input) > 2 and node.input[2]:
        y = b.op("Add", [y, node.input[2]], f"y_bias{tag}")
    lead = once((a, "lead"), lambda: b.op("Slice", [b.op("Shape", [a], f"a_shape{tag}"),
                                                    b.const(f"s{tag}", [0], np.int64),
                                                    b.const(f"e{tag}", [-1], np.int64)], f"lead{tag}"))
    shape = b.op("Concat", [lead, b.const(f"n{tag}", [n], np.int64)], f"y_shape{tag}", axis=0)
    b.op("Reshape", [y, shape], f"y_out{tag}")
    b.nodes[-1].output[0] = node.output[0]
    return _take(b, first)


def _take(b: _Builder, first: int) -> list[onnx.NodeProto]:
    taken = b.nodes[first:]
    del b.nodes[first:]
    return taken


def _plans(model: onnx.ModelProto, weights: list[mf.QuantizedWeight]):
    """[(weight, [(matmul node index, transB)], codes are [N, K], (N, K, block))] for the weights MatMulNBits can
    run: a DequantizeLinear chain (quantize.dequant_chains) read only as the B of matmuls."""
    g = model.graph
    inits = {i.name: i for i in g.initializer}
    read_by = readers(g)
    by_codes = {chain[0].input[0]: (w, chain) for w, chain in dequant_chains(g, {q.codes for q in weights},
                                                                             read_by).items()}
    plans = []
    for q in weights:
        if q.codes not in by_codes:
            continue
        w, chain = by_codes[q.codes]
        users = _matmul_readers(g, read_by, w)
        if users is None or len({t for _, t in users}) != 1:
            continue
        codes_nk = users[0][1] != (chain[-1].op_type == "Transpose")   # [N, K] as the matmul counts them
        fit = _fits(q, inits[q.codes], codes_nk)
        if fit:
            plans.append((q, users, codes_nk, fit))
    return plans


def fuse(model: onnx.ModelProto, weights: list[mf.QuantizedWeight]) -> tuple[onnx.ModelProto, int]:
    """Rewrite every matmul of a quantized weight (a DequantizeLinear chain of `weights`' codes read only as a
    matmul's B) into MatMulNBits; the DequantizeLinear nodes and their gates go, and so does a uint4 codes
    tensor's old name (its bytes are the uint8 view's). -> (the model, at opset >= 21 if anything changed; how
    many weights were fused)."""
    if not _plans(model, weights):
        return model, 0
    model = to_opset(model, INT4_OPSET)           # BitwiseXor (18); the converter may add nodes: plan again
    plans = _plans(model, weights)
    g = model.graph
    inits = {i.name: i for i in g.initializer}
    prep: list[onnx.NodeProto] = []
    readers_of: list[tuple[int, _Builder, tuple, int, int, int]] = []
    for i, (q, users, codes_nk, (n, k, block)) in enumerate(plans):
        b = _Builder(g, f"{PREFIX}{i}/")
        fused = _codes_nk(b, q, inits[q.codes], codes_nk, n, k, block)
        prep += _take(b, 0)
        readers_of += [(j, b, fused, n, k, block) for j, _ in users]
    replace: dict[int, list[onnx.NodeProto]] = {}
    shared: dict = {}
    for u, (j, b, fused, n, k, block) in enumerate(sorted(readers_of, key=lambda r: r[0])):   # in graph order
        replace[j] = _matmul(b, g.node[j], fused, n, k, block, str(u), shared)
    out = list(prep)
    for j, node in enumerate(g.node):
        out += replace.get(j, [node])
    del g.node[:]
    g.node.extend(out)
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    drop_dead(g)
    return model, len(plans)
