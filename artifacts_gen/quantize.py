"""A quantized frozen base: frozen linear weights stored as integer codes and scales, dequantized just in time.

Modes (`pocketlora gen --quant`):
  none  float32, as the source holds them
  int8  per output, symmetric: W[k, n] = q[k, n] * s[n], q in [-127, 127]
  int4  per block of `block` inputs (default 32) of one output, asymmetric: W[k, n] = q[n, k] * s[n, k // block]
        + o[n, k // block], q in [0, 15]  (DequantizeLinear-21 with block_size; the graphs go to opset 21, to_opset)
  keep  a GGUF source's own blocks (gguf_exact.py)

Layout: the graphs read W [in, out] (MatMul's B). 4-bit codes are stored transposed, [out, in] with the blocks
along in, as GGUF stores them and as ORT's MatMulNBits reads them, so the decoder multiplies by the very bytes the
training graphs dequantize (nbits.py); the training and eval graphs dequantize [out, in] and multiply by it
transposed (FusedMatMul or Gemm with transB: fuse_transposes), forward and backward. Their offsets per block are
applied to the activation, y = X ((C - 8) S)^T + (X E)(O + 8 S)^T (_add_offset_term; E sums X per block), so the
DequantizeLinear's output is the only float32 copy of a weight: with the offset added to the weight and a float32
Transpose, Qwen2.5-0.5B in --memory low took 54 MiB more anonymous memory than with [in, out] codes (587 against 533
MiB, 2026-12-06; 543 since).
8-bit codes stay [in, out]: ORT 1.19's training session rewrites a Transpose of an int8 DequantizeLinear into a
QuantizeLinear of the wrong type and fails to start (measured 2026-12-06; uint4 too), so the decoder transposes
them once when its session starts.

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

Speed. ORT 1.19's DequantizeLinear is single-threaded; the finished training and eval graphs' dequantizations of
the linear weights are rewritten into faster ops of the same values by fast_dequant.py (int8: Cast and Mul; uint4:
MatMulNBits forward, its float zero points taking the forward's offset term; bit operations backward).

Codes. int4's default (`--quant-calib self`) chooses them by GPTQ on windows the source model samples itself
(gptq.py); `--quant-calib FILE` on a text; `--quant-calib none` rounds each block to its grid (fit_int4_blocks).
"""
from __future__ import annotations

import copy

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper, version_converter

from ort_trainer import manifest as mf

from .recompute import backward_nodes, gate_nodes, insert_before, readers

MODES = ("none", "int8", "int4", "keep")
INT4_BLOCK = 32
INT4_SHRINK = np.linspace(0.7, 1.0, 7, dtype=np.float32)     # int4's block ranges tried (see quantize_array)
DEFAULT_FOR_GGUF = "keep"     # a GGUF source keeps its blocks unless --quant says otherwise (safetensors: none)
INT4_OPSET = 21               # DequantizeLinear's int4 and block_size
HALF_MAX = 60000.0             # int4's scales and offsets are float16
PREFIX = "/dequant/"
CODES, SCALE, OFFSET = ".qcodes", ".qscale", ".qoffset"
ZERO = PREFIX + "zero"
MIN_ELEMENTS = 1024           # smaller weights are not worth a node
CALIB_TOKENS = 16384          # --quant-calib FILE: calibration tokens read by default (gptq.py)
SELF_CALIB = "self"           # --quant-calib self (int4's default): GPTQ on text the source model samples itself
NO_CALIB = "none"             # --quant-calib none: each block rounded to its nearest grid, no calibration
SAMPLED_TOKENS = 8192         # --quant-calib self: tokens sampled by default (~2.5 min for Gemma3-270M on 2 cores)


class QuantError(ValueError):
    pass


def describe(mode: str, block: int, weights: list[mf.QuantizedWeight]) -> str:
    """One line for the build log: how many weights, in which forms."""
    from collections import Counter

    forms = Counter(w.source_format or (f"{w.dtype} blocks of {w.block}" if w.block else
                                        f"{w.dtype} per {'row' if w.axis == 0 else 'column'}") for w in weights)
    return f"{len(weights)} frozen weights quantized ({mode}): " + ", ".join(f"{n} {f}" for f, n in forms.items())


def check_mode(mode: str, block: int) -> None:
    if mode not in MODES:
        raise QuantError(f"--quant {mode}: use one of {', '.join(MODES)}.")
    if mode == "int4" and (block < 2 or block % 2):
        raise QuantError(f"--quant-block {block}: use an even number >= 2 (default {INT4_BLOCK}).")


def calibration_source(mode: str, calib, tokens: int | None) -> str | None:
    """`--quant-calib` checked before anything is loaded -> what int4's codes are calibrated on: SELF_CALIB, a text
    file's path, or None (plain rounding; every mode but int4). int4 only, an existing file, a positive count."""
    from pathlib import Path

    if calib is not None and mode != "int4":
        raise QuantError(f"--quant-calib chooses int4's codes (GPTQ); add --quant int4 (got --quant {mode or 'default'}),"
                         " or drop --quant-calib.")
    if tokens is not None and tokens < 1:
        raise QuantError(f"--quant-calib-tokens {tokens}: use 1 or more (default {SAMPLED_TOKENS} sampled, "
                         f"{CALIB_TOKENS} of a file).")
    if mode != "int4" or str(calib) == NO_CALIB:
        return None
    if calib is None or str(calib) == SELF_CALIB:
        return SELF_CALIB
    if not Path(calib).is_file():
        raise QuantError(f"--quant-calib {calib}: no such file. Give a plain UTF-8 text file, {SELF_CALIB} (text the "
                         f"model samples itself, the default) or {NO_CALIB} (plain rounding).")
    return str(calib)


# ------------------------------------------------------------------------------------------ numbers

def quantize_array(w: np.ndarray, mode: str, block: int = INT4_BLOCK, hessian: np.ndarray | None = None
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """W [K, N] float32 -> (codes, scales, offsets or None).
    int8: codes int8 in [-127, 127], one scale per column [N] (absmax / 127).
    int8-rows: the same with one scale per row [K] (embedding / LM head).
    int4: codes in [0, 15] (uint4), per block of `block` rows of a column a scale and an offset [ceil(K/block), N],
        float16: W ~ codes * scale + offset (fit_int4_blocks). With `hessian` (E[x x^T] of the layer's inputs
        [K, K], from calibration text: gptq.py) the codes are chosen by GPTQ instead, block by block, each
        rounding error pushed onto the inputs not yet rounded."""
    w = np.asarray(w, dtype=np.float32)
    if mode in ("int8", "int8-rows"):
        axis = 0 if mode == "int8" else 1
        scale = np.abs(w).max(axis=axis) / 127.0
        scale = np.where(scale > 0, scale, np.float32(1.0)).astype(np.float32)
        groups = scale[None, :] if axis == 0 else scale[:, None]
        return np.clip(np.rint(w / groups), -127, 127).astype(np.int8), scale, None
    if mode != "int4":
        raise QuantError(f"quantize_array: mode {mode!r}")
    if not np.isfinite(w).all() or np.abs(w).max(initial=0) > HALF_MAX:
        raise QuantError(f"int4: a weight of magnitude {np.abs(w).max():.3g} is beyond float16's range (the scales "
                         "and offsets are float16); use --quant int8.")
    if hessian is not None:
        from .gptq import gptq_int4

        return gptq_int4(w, hessian, block)
    k, n = w.shape
    x = np.pad(w, ((0, (-k) % block), (0, 0))).reshape(-1, block, n)          # [blocks, block, N]
    q, s, lo = fit_int4_blocks(x)
    return q.reshape(-1, n)[:k].astype(np.uint8), s[:, 0].astype(np.float16), lo[:, 0].astype(np.float16)


def fit_int4_blocks(x: np.ndarray, importance: np.ndarray | None = None, refine: int = 0
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x [B, block, N] -> (q [B, block, N] in [0, 15], scale, offset [B, 1, N], float16 values held in float32) with
    x ~ q * scale + offset, least `importance`-weighted squared error ([B, block, 1] per input; None: all 1).
    The block's range [lo, hi] (0 included) is shrunk from its min and max to the pair of a grid (INT4_SHRINK) with
    the least error (asymmetric, clipped: on the real Gemma3-270M's weights the relative error fell from 10.4% for
    symmetric absmax to 6.5%, measured 2026-12-05); then `refine` rounds of least squares for scale and offset
    given the codes, and codes given them. Refining without importance raised Gemma3-270M's perplexity (+19.0%
    against +16.8% for the grid alone, 2026-12-06), so it is used only with calibration (GPTQ)."""
    w = np.ones_like(x[:, :, :1]) if importance is None else importance
    lo0, hi0 = np.minimum(x.min(axis=1, keepdims=True), 0), np.maximum(x.max(axis=1, keepdims=True), 0)
    best: list[np.ndarray] = []

    def consider(q, s, lo):
        err = (w * (q * s + lo - x) ** 2).sum(axis=1, keepdims=True)
        if not best:
            best.extend((err, q, s, lo))
            return
        better = err < best[0]
        best[:] = [np.where(better, new, old) for new, old in zip((err, q, s, lo), best)]

    for a in INT4_SHRINK:
        for b in INT4_SHRINK:
            s, lo = _half((hi0 * b - lo0 * a) / 15), _half(lo0 * a)
            s = np.where(s > 0, s, np.float32(1.0))                  # an all-zero block
            consider(np.clip(np.rint((x - lo) / s), 0, 15), s, lo)
    for _ in range(refine):
        _, q, s, lo = best
        sw = np.broadcast_to(w.sum(axis=1, keepdims=True), s.shape)
        sq, sqq = (w * q).sum(axis=1, keepdims=True), (w * q * q).sum(axis=1, keepdims=True)
        sx, sqx = (w * x).sum(axis=1, keepdims=True), (w * q * x).sum(axis=1, keepdims=True)
        det = sqq * sw - sq * sq
        ok = det > 1e-20
        det = np.where(ok, det, 1)
        s2 = np.where(ok, (sqx * sw - sq * sx) / det, s)
        s2, lo2 = _half(np.where(s2 > 0, s2, s)), _half(np.where(ok, (sqq * sx - sq * sqx) / det, lo))
        consider(q, s2, lo2)
        consider(np.clip(np.rint((x - lo2) / s2), 0, 15), s2, lo2)
    return best[1], best[2], best[3]


def _half(a: np.ndarray) -> np.ndarray:
    """float16 values (int4's scales and offsets are stored so) in float32; a scale never rounds to 0."""
    h = np.asarray(a, dtype=np.float32).astype(np.float16).astype(np.float32)
    return np.where((h == 0) & (a != 0), np.float32(2.0 ** -24) * np.sign(a), h).astype(np.float32)


def dequantize_array(codes: np.ndarray, scale: np.ndarray, block: int = 0, axis: int = 1,
                     offset: np.ndarray | None = None) -> np.ndarray:
    """The float32 weight a quantized weight stands for: codes * scale (+ offset), with one scale per column
    (axis 1, block 0), per row (axis 0, block 0), or per `block` entries along `axis`."""
    groups = np.asarray(scale, dtype=np.float32)
    if block:
        groups = np.repeat(groups, block, axis=axis)
    elif axis == 0:
        groups = groups[:, None]
    w = codes.astype(np.float32) * groups
    if offset is not None:       # one per scale (stored with a trailing axis of 1 for the graphs' broadcast)
        w = w + np.repeat(np.asarray(offset, dtype=np.float32).reshape(np.shape(scale)), block, axis=axis)
    return w


def int4_tensor(codes: np.ndarray, name: str, unsigned: bool = False) -> TensorProto:
    """An ONNX INT4 (UINT4) tensor: two codes a byte, the first in the low nibble (as onnx.helper.make_tensor packs)."""
    flat = codes.reshape(-1).astype(np.int8)
    if flat.size % 2:
        flat = np.concatenate([flat, np.zeros(1, np.int8)])
    packed = (flat[0::2].view(np.uint8) & 0x0F) | ((flat[1::2].view(np.uint8) & 0x0F) << 4)
    t = TensorProto(name=name, data_type=TensorProto.UINT4 if unsigned else TensorProto.INT4, dims=list(codes.shape))
    t.raw_data = packed.astype(np.uint8).tobytes()
    return t


def is_vocab(w: mf.QuantizedWeight) -> bool:
    """A quantized lookup table / LM head [V, H] (token or position embedding): one scale per row (axis 0), or a
    GGUF's blocks along H (axis 1). A linear layer's codes: 4-bit [out, in] (codes_transposed), or 8-bit [in, out]
    with one scale per column (axis 1) or blocks along in (axis 0)."""
    return not w.codes_transposed and (w.axis == 0) == (w.block == 0)


def codes_array(t: TensorProto, w: mf.QuantizedWeight, base_dir: str = ".") -> np.ndarray:
    """A weight's codes as integers: `t` its codes initializer, uint4 codes in either form a bundle holds them
    (INT4 / UINT4 [N, K], or the training and eval graphs' uint8 view of the same bytes [N, K / 2]: fast_dequant)."""
    codes = read_tensor(t, base_dir)
    if w.dtype == "uint4" and t.data_type == TensorProto.UINT8:
        codes = unpack_nibbles(codes).reshape(codes.shape[0], -1)
    return codes


def unpack_nibbles(packed: np.ndarray) -> np.ndarray:
    """uint8 bytes -> their two 4-bit codes each as int8 (0..15), the low nibble first: [..., n] -> [..., 2 n]."""
    return np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1).astype(np.int8)


def read_tensor(t: TensorProto, base_dir: str = ".") -> np.ndarray:
    """An initializer's values (its external data read from base_dir); INT4 codes unpacked into int8."""
    if t.data_location == TensorProto.EXTERNAL:
        t = copy.deepcopy(t)
        onnx.external_data_helper.load_external_data_for_tensor(t, base_dir)
        t.data_location = TensorProto.DEFAULT
        del t.external_data[:]
    if t.data_type not in (TensorProto.INT4, TensorProto.UINT4):
        return numpy_helper.to_array(t)
    both = unpack_nibbles(np.frombuffer(t.raw_data, dtype=np.uint8))
    if t.data_type == TensorProto.INT4:
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
    attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
    return (n.op_type == "Gemm" and not attrs.get("transA", 0) and not attrs.get("transB", 0)
            and attrs.get("alpha", 1.0) == 1.0)          # y = X W (+ C): the offset term adds to it as it is


def _dq_node(codes: str, scale: str, out: str, name: str, block: int, axis: int) -> onnx.NodeProto:
    if block:
        return helper.make_node("DequantizeLinear", [codes, scale], [out], name=name, axis=axis, block_size=block)
    return helper.make_node("DequantizeLinear", [codes, scale], [out], name=name, axis=axis)


def _gated_float(name: str, values: np.ndarray, activation: str, p: str) -> tuple[str, list[onnx.NodeProto]]:
    """(the float32 tensor to read, the nodes making it): initializer `name` gated on `activation`
    (recompute.gate_nodes), then cast to float32 when `values` are float16 (int4's scales and offsets: cast after
    the gate, so no float32 copy outlives its use; a Cast of the initializer would be a constant)."""
    nodes = gate_nodes(name, activation, p, ZERO)
    if values.dtype != np.float16:
        return p + "x", nodes
    return p + "x32", nodes + [helper.make_node("Cast", [p + "x"], [p + "x32"], name=p + "x32", to=TensorProto.FLOAT)]


def _shared_initializer(g: onnx.GraphProto, name: str, make) -> str:
    """Initializer `name`, added once (make() -> TensorProto) and shared by every weight that needs it."""
    if not any(i.name == name for i in g.initializer):
        g.initializer.append(make())
    return name


def _zero_points(g: onnx.GraphProto, n: int, nb: int) -> str:
    """uint4 [n, nb] all 8: the DequantizeLinear computes (C - 8) S, centred, so the offset term is small."""
    name = f"{PREFIX}zero_points/{n}x{nb}"
    return _shared_initializer(g, name, lambda: int4_tensor(np.full((n, nb), 8, np.int8), name, unsigned=True))


def _offset_t(g: onnx.GraphProto, name: str, offset: np.ndarray, activation: str, p: str, n: int, nb: int,
              scale32: str) -> tuple[str, list[onnx.NodeProto]]:
    """((O + 8 S)^T [blocks, out] float32, the nodes making it) from the gated offsets and the gated scales (scale32,
    [out, blocks]); transposed by a Transpose that fuse_transposes folds into its readers. recompute_dequantized
    gives the backward pass its own copy."""
    gated, nodes = _gated_float(name, offset, activation, p + "o/")    # float32 too: no constant to fold
    g.initializer.append(numpy_helper.from_array(np.array([n, nb], np.int64), p + "o_rows_shape"))
    eight = _shared_initializer(g, PREFIX + "eight", lambda: numpy_helper.from_array(np.asarray(8, np.float32),
                                                                                     PREFIX + "eight"))
    return p + "o_t", nodes + [
        helper.make_node("Reshape", [gated, p + "o_rows_shape"], [p + "o_rows"], name=p + "o_rows"),
        helper.make_node("Mul", [scale32, eight], [p + "s8"], name=p + "s8"),
        helper.make_node("Add", [p + "o_rows", p + "s8"], [p + "o8"], name=p + "o8"),
        helper.make_node("Transpose", [p + "o8"], [p + "o_t"], name=p + "o_t", perm=[1, 0])]


def _block_sum_matrix(g: onnx.GraphProto, k: int, block: int) -> str:
    """E [k, k / block] float32, E[i, b] = 1 where i // block == b: X E sums X's inputs per block. A constant
    initializer, shared by every weight of that shape (the shards hold it; ~2.9 MB for k = 4864)."""
    name = f"{PREFIX}block_sums/{k}x{block}"
    e = lambda: (np.arange(k)[:, None] // block == np.arange(k // block)[None, :]).astype(np.float32)
    return _shared_initializer(g, name, lambda: numpy_helper.from_array(e(), name))


def _add_offset_term(g: onnx.GraphProto, reader: onnx.NodeProto, offset_t: str, k: int, block: int, p: str,
                     shared: dict) -> tuple[list[onnx.NodeProto], list[onnx.NodeProto]]:
    """The offset term of a matmul reader y = X W (+ bias) of a weight stored W^T = C S + O (an offset per block of
    `block` inputs) whose DequantizeLinear gives (C - 8) S: y += blocksum(X) (O + 8 S)^T (offset_t), blocksum(X) =
    X E (_block_sum_matrix; the decoder's MatMulNBits correction is the same, nbits.py). Centred codes keep both
    terms about as large as y: with C S + O, both were about twice y and cancelled, and the LoRA gradients of a tiny
    Gemma3 ended 2.7-3.6e-6 from float64 against 1.4-2.0e-6 for the weight added whole (and for float32 PyTorch);
    centred, 1.4-1.9e-6 (4 seeds, measured 2026-12-06). No full-size float32 Add, and no
    Shape of X in the backward pass (a Reshape and ReduceSum would read it there and keep X alive; the matmul's
    gradient is dX += d(X E) E^T). -> (nodes to run before the activation's first quantized reader: X E, made once
    per activation in `shared`; nodes after this reader: the offset's matmul and the Add, which now outputs the
    reader's output)."""
    x, before = reader.input[0], []
    if (x, block) not in shared:
        shared[(x, block)] = p + "sums"
        before.append(helper.make_node("MatMul", [x, _block_sum_matrix(g, k, block)], [p + "sums"], name=p + "sums"))
    y = reader.output[0]
    reader.output[0] = p + "y_codes"
    return before, [helper.make_node("MatMul", [shared[(x, block)], offset_t], [p + "y_offset"], name=p + "y_offset"),
                    helper.make_node("Add", [p + "y_codes", p + "y_offset"], [y], name=p + "y")]


def _offset_in_chain(g: onnx.GraphProto, name: str, offset: np.ndarray, activation: str, p: str, n: int, k: int,
                     block: int, out: str) -> list[onnx.NodeProto]:
    """The nodes after the DequantizeLinear (p + "scaled", [out, in]) that add the offsets to the weight itself:
    Reshape into blocks, Add, Reshape back to `out` (the decoder's form: nbits.fuse folds the offsets)."""
    offset_in, nodes = name, []
    if offset.dtype == np.float16:          # gated like the scales, so its float32 copy is transient too
        offset_in, nodes = _gated_float(name, offset, activation, p + "o/")
    g.initializer.extend([numpy_helper.from_array(np.array([n, k // block, block], np.int64), p + "blocks_shape"),
                          numpy_helper.from_array(np.array([n, k], np.int64), p + "w_shape")])
    return nodes + [
        helper.make_node("Reshape", [p + "scaled", p + "blocks_shape"], [p + "blocks"], name=p + "blocks"),
        helper.make_node("Add", [p + "blocks", offset_in], [p + "shifted"], name=p + "offset"),
        helper.make_node("Reshape", [p + "shifted", p + "w_shape"], [out], name=p + "w")]


def _codes_tensor(codes: np.ndarray, name: str, dtype: str) -> TensorProto:
    if dtype == "int4":
        return int4_tensor(codes, name)
    if dtype == "uint4":
        return int4_tensor(codes, name, unsigned=True)
    return numpy_helper.from_array(codes.astype(np.int8), name)


def _exact_for(name: str, w: np.ndarray, source_key: str, transposed: bool, exact: dict | None):
    """The GGUF's exact blocks of a weight (gguf_exact.ExactBlocks, in the GGUF's layout: the source parameter's), or
    None when the source has none for it. The blocks must give the weights the graph holds, bit for bit."""
    ex = (exact or {}).get(source_key)
    if ex is None:
        return None
    values = ex.dequantize()
    if transposed:
        values = values.T
    if values.shape != w.shape or not np.array_equal(values.view(np.uint32), w.view(np.uint32)):
        raise QuantError(f"{source_key}: the GGUF's {ex.fmt} blocks do not give the weights the source loaded "
                         "(a converter changed them); build with --quant int8 or int4 instead.")
    return ex


def quantize_forward(model: onnx.ModelProto, mode: str, block: int, keep: set[str], transposed_suffix: str,
                     exact: dict | None = None, calibration=None, split_offsets: bool = True
                     ) -> tuple[onnx.ModelProto, list[mf.QuantizedWeight]]:
    """Replace the frozen linear weights of the forward graph (float32 initializers, values inline) by codes +
    scales and a gated DequantizeLinear (whose output keeps the weight's name, or for a 4-bit weight with split
    offsets feeds a Transpose that does; its readers' outputs then come from the offset term's Add).
    `keep`: initializers never quantized (the LoRA tensors). `exact` (mode keep): a GGUF source's blocks by HF
    name (gguf_exact.read_exact); weights without them stay float32. `calibration` (mode int4, gptq.Calibration):
    the weights it covers get GPTQ's codes. int4's scales and offsets are float16 initializers, gated and then
    cast to float32 right before their DequantizeLinear (a Cast of an initializer would be a constant, folded
    into a float32 copy on the heap: +170 MiB anonymous memory for Qwen2.5-0.5B in --memory low, measured
    2026-12-06). An offset per block (uint4: int4, Q4_K) is, with `split_offsets`, not added to the weight but
    applied to the activation: y = X ((C - 8) S)^T + (X E)(O + 8 S)^T (_add_offset_term), so the only float32 copy
    of a weight is its DequantizeLinear's; without (the decoder: nbits folds the offsets into a constant), the
    DequantizeLinear's output is reshaped into blocks, offset and reshaped back (_offset_in_chain).
    -> (the model, possibly at a new opset; the list)."""
    if mode == "none":
        return model, []
    if mode in ("int4", "keep"):
        model = to_opset(model, INT4_OPSET)
    g = model.graph
    inits = {i.name: i for i in g.initializer}
    chosen = _weights_to_quantize(g, keep)
    inserts: dict[int, list[onnx.NodeProto]] = {}
    after: dict[int, list[onnx.NodeProto]] = {}
    shared: dict = {}            # an activation's block sums, made once for all its readers (_add_offset_term)
    read_by = readers(g)
    first_reader: dict[str, int] = {}     # activation -> its first quantized reader, where its block sums go
    for name in chosen:
        for j in read_by[name]:
            first_reader[g.node[j].input[0]] = min(j, first_reader.get(g.node[j].input[0], j))
    entries = []
    for k, (name, reader) in enumerate(chosen.items()):
        init = inits[name]
        w = numpy_helper.to_array(init)
        transposed = name.endswith(transposed_suffix)
        source_key = name[: -len(transposed_suffix)] if transposed else name
        offset, fmt = None, ""
        if mode == "keep":
            ex = _exact_for(name, w, source_key, transposed, exact)
            if ex is None or not transposed:     # blocks must run along the input features: W.T of a [out, in]
                continue
            codes, scale, offset, use_block, fmt = ex.codes, ex.scale, ex.offset, ex.block, ex.fmt   # [out, in]
            dtype = "uint4" if fmt == "Q4_K" else "int8"
            out_in = dtype == "uint4"
            if not out_in:
                codes, scale = codes.T, scale.T
        elif mode == "int4" and w.shape[0] % block:
            continue                                   # int4 blocks must tile the rows; this weight stays float32
        else:                                                                                          # [in, out]
            calibrated = mode == "int4" and calibration is not None and calibration.covers(source_key)
            codes, scale, offset = (calibration.quantize(source_key, w, block) if calibrated
                                    else quantize_array(w, mode, block))
            use_block = block if mode == "int4" else 0
            dtype = "uint4" if mode == "int4" else "int8"
            out_in = dtype == "uint4"
            if out_in:
                codes, scale, offset = codes.T, scale.T, offset.T
        g.initializer.remove(init)
        g.initializer.extend([_codes_tensor(np.ascontiguousarray(codes), name + CODES, dtype),
                              numpy_helper.from_array(np.ascontiguousarray(scale), name + SCALE)])
        p = f"{PREFIX}{k}/"
        activation = g.node[reader].input[0]
        scale_in, nodes = _gated_float(name + SCALE, scale, activation, p)
        # [out, in]: blocks along axis 1 of the codes; [in, out]: blocks along axis 0, or one scale per column
        axis = (1 if out_in else 0) if use_block else 1
        dq_out = p + "wt" if out_in else name
        in_chain = offset is not None and not split_offsets
        nodes.append(_dq_node(name + CODES, scale_in, p + "scaled" if in_chain else dq_out, p + "dq", use_block, axis))
        if offset is not None:      # uint4 [out, in] (int4, Q4_K): + an offset per block (Q4_K's -dmin * m)
            kk, nn = w.shape
            offset = np.ascontiguousarray(offset).reshape(nn, kk // use_block, 1)
            g.initializer.append(numpy_helper.from_array(
                offset if offset.dtype == np.float16 else offset.astype(np.float32), name + OFFSET))
            if in_chain:
                nodes += _offset_in_chain(g, name + OFFSET, offset, activation, p, nn, kk, use_block, dq_out)
            else:
                nodes[-1].input.append(_zero_points(g, nn, kk // use_block))          # (C - 8) S
                offset_t, gated = _offset_t(g, name + OFFSET, offset, activation, p, nn, kk // use_block, scale_in)
                nodes += gated
                for j in read_by[name]:
                    x = g.node[j].input[0]
                    before, after_j = _add_offset_term(g, g.node[j], offset_t, kk, use_block, f"{p}{j}/", shared)
                    inserts.setdefault(first_reader[x], []).extend(before)
                    after.setdefault(j, []).extend(after_j)
        if out_in:
            nodes.append(helper.make_node("Transpose", [dq_out], [name], name=p + "t", perm=[1, 0]))
        inserts.setdefault(reader, []).extend(nodes)
        entries.append(mf.QuantizedWeight(
            onnx_name=name, source_key=source_key, transposed=transposed,
            shape=[int(d) for d in init.dims], codes=name + CODES, scale=name + SCALE,
            dtype=dtype, axis=axis, block=use_block,
            offset=name + OFFSET if offset is not None else "", source_format=fmt, codes_transposed=out_in))
    if entries:
        insert_before(g, inserts, after)
        g.initializer.append(numpy_helper.from_array(np.asarray(0, dtype=np.int64), ZERO))
    return model, entries + quantize_vocab(model, keep, exact if mode == "keep" else None)


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
        if all(reads_as_table(g.node[j], name) or _reads_as_head(g.node[j], name) for j in read_by[name]):
            out.append(name)
    return out


def reads_as_table(n: onnx.NodeProto, name: str) -> bool:
    return (n.op_type == "Gather" and n.input[0] == name and name not in n.input[1:]
            and all(a.name != "axis" or a.i == 0 for a in n.attribute))


def _reads_as_head(n: onnx.NodeProto, name: str) -> bool:
    return (n.op_type == "Gemm" and len(n.input) >= 2 and n.input[1] == name and n.input[0] != name
            and any(a.name == "transB" and a.i for a in n.attribute))


LOOKUP_PARTS = ("q", "s", "f", "s1", "w")      # gather_dequantized's node names after its prefix (read by lookups)


def gather_dequantized(codes: str, scale: str, idx: str, out: str, p: str, axis_last: str, block: int = 0
                       ) -> list[onnx.NodeProto]:
    """out = rows idx of an int8 table, dequantized: Gather the codes and the scales, then multiply (one scale
    per row) or a DequantizeLinear along the row (`block` columns per scale: the gathered scales have the codes'
    rank, as blocked DequantizeLinear needs)."""
    n = helper.make_node
    q, s, f, s1, w = (p + part for part in LOOKUP_PARTS)
    nodes = [n("Gather", [codes, idx], [q], name=q, axis=0),
             n("Gather", [scale, idx], [s], name=s, axis=0)]
    if block:
        return nodes + [n("DequantizeLinear", [q, s], [out], name=w, axis=-1, block_size=block)]
    return nodes + [n("Cast", [q], [f], name=f, to=TensorProto.FLOAT),
                    n("Unsqueeze", [s, axis_last], [s1], name=s1),
                    n("Mul", [f, s1], [out], name=w)]


def lookups(g: onnx.GraphProto, codes: str) -> list[tuple[list[int], str, str]]:
    """The row lookups of the int8 table `codes` that gather_dequantized made: (their nodes' indices, the ids
    they read, the rows they output)."""
    at = {n.name: i for i, n in enumerate(g.node) if n.name}
    found = []
    for n in g.node:
        if reads_as_table(n, codes) and n.name.endswith(LOOKUP_PARTS[0]) and n.output[0] == n.name:
            p = n.name[:-len(LOOKUP_PARTS[0])]
            members = [at[p + part] for part in LOOKUP_PARTS if p + part in at]
            found.append((members, n.input[1], g.node[at[p + LOOKUP_PARTS[-1]]].output[0]))
    return found


AXIS_LAST = PREFIX + "axis_last"


def quantize_vocab(model: onnx.ModelProto, keep: set[str], exact: dict | None = None) -> list[mf.QuantizedWeight]:
    """The token embedding and the LM head ([V, H], tied or not) as int8 codes with one scale per vocabulary row
    (or, from a GGUF source, its exact blocks along the row: Q8_0, Q5_0, Q6_K), in place. A lookup gathers the
    codes and scales of its rows only; the head's readers get a gated DequantizeLinear (the training graph's
    chunked head replaces it by one per vocabulary slice: head_loss)."""
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
        w = numpy_helper.to_array(init)
        block, fmt = 0, ""
        if exact is not None:
            ex = _exact_for(name, w, name, False, exact)
            if ex is None or ex.offset is not None:         # kept float32 (no blocks, or Q4_K's offsets)
                continue
            codes, scale, block, fmt = ex.codes, ex.scale, ex.block, ex.fmt
        else:
            codes, scale, _ = quantize_array(w, "int8-rows")
        g.initializer.remove(init)
        g.initializer.extend([numpy_helper.from_array(codes, name + CODES), numpy_helper.from_array(scale, name + SCALE)])
        for r, j in enumerate(read_by[name]):
            node, p = g.node[j], f"{PREFIX}vocab{k}/{r}/"
            if node.op_type == "Gather":
                replace[j] = gather_dequantized(name + CODES, name + SCALE, node.input[1], node.output[0], p, AXIS_LAST,
                                                block)
            else:
                gated = gate_nodes(name + SCALE, node.input[0], p, ZERO)
                gated.append(helper.make_node("DequantizeLinear", [name + CODES, p + "x"], [p + "w"], name=p + "dq",
                                              **({"axis": 1, "block_size": block} if block else {"axis": 0})))
                node.input[1] = p + "w"
                replace[j] = gated + [node]
        entries.append(mf.QuantizedWeight(onnx_name=name, source_key=name, transposed=False,
                                          shape=[int(d) for d in init.dims], codes=name + CODES, scale=name + SCALE,
                                          dtype="int8", axis=1 if block else 0, block=block, source_format=fmt))
    if not entries:
        return []
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


def dequant_chains(g: onnx.GraphProto, codes: set[str], read_by) -> dict[str, list[onnx.NodeProto]]:
    """The float32 weight each DequantizeLinear of `codes` ends in -> the nodes computing it, first to last (the DQ;
    for an offset in the chain its Reshape, Add, Reshape; for codes stored [out, in] a Transpose): the decoder's
    graph (nbits.fuse)."""
    out = {}
    for n in g.node:
        if n.op_type != "DequantizeLinear" or n.input[0] not in codes:
            continue
        chain, w = [n], n.output[0]
        while (len(read_by[w]) == 1
               and g.node[read_by[w][0]].op_type in ("Reshape", "Add", "Transpose")):
            chain.append(g.node[read_by[w][0]])
            w = chain[-1].output[0]
        out[w] = chain
    return out


def _is_gate(n: onnx.NodeProto, constants: set[str]) -> bool:
    """n is gate_nodes' alias of a constant (ours, named under PREFIX): Reshape(constant, a shape computed from an
    activation)."""
    return (n.op_type == "Reshape" and n.name.startswith(PREFIX) and n.input[0] in constants
            and n.input[1] not in constants)


def _gated_constants(g: onnx.GraphProto, constants: set[str], bwd: set[int]) -> set[str]:
    """The forward tensors computed from constants and gated aliases of constants alone (the gates' own shape
    inputs aside), in one pass: the graph's nodes are in topological order."""
    out: set[str] = set()
    for i, n in enumerate(g.node):
        if i not in bwd and (_is_gate(n, constants) or all(not x or x in constants or x in out for x in n.input)):
            out.update(n.output)
    return out


def _derivation(g: onnx.GraphProto, produced_by: dict, constants: set[str], x: str) -> list[int]:
    """Indices (in graph order) of the nodes computing x, one of _gated_constants, back to its gates (included)."""
    found, stack = set(), [x]
    while stack:
        t = stack.pop()
        if not t or t in constants or produced_by[t] in found:
            continue
        found.add(produced_by[t])
        if not _is_gate(g.node[produced_by[t]], constants):
            stack.extend(g.node[produced_by[t]].input)
    return sorted(found)


def recompute_dequantized(model: onnx.ModelProto, weights: list[str]) -> int:
    """In the training graph: each backward reader of a dequantized weight (or of an offset term's (O + 8 S)^T: what
    is computed from constants and gated constants alone, `weights`' codes or offsets among them) gets its own copy
    of that computation, its gates waiting for one of the reader's backward inputs instead, so the forward's float32
    copy dies with its forward reader. A backward reader with no backward input (e.g. a Transpose of W alone) is
    gated through its own readers'. In place; -> how many readers were rewired."""
    g = model.graph
    read_by = readers(g)
    bwd = backward_nodes(g, read_by)
    produced_by = {o: i for i, n in enumerate(g.node) for o in n.output}
    constants = {i.name for i in g.initializer}
    codes, offsets = {w + CODES for w in weights}, {w + OFFSET for w in weights}

    def of_weights(n: onnx.NodeProto) -> bool:      # a whole weight's dequantization, or a gate of its offsets
        return ((n.op_type == "DequantizeLinear" and n.input[0] in codes)
                or (_is_gate(n, constants) and n.input[0] in offsets))

    inserts: dict[int, list[onnx.NodeProto]] = {}
    gated = _gated_constants(g, constants, bwd)
    count = 0
    for j in sorted(bwd):
        reader = g.node[j]
        for x in dict.fromkeys(reader.input):
            if x not in gated:
                continue
            derivation = _derivation(g, produced_by, constants, x)
            if (not any(of_weights(g.node[i]) for i in derivation)
                    or not any(_is_gate(g.node[i], constants) for i in derivation)):     # ungated: a constant
                continue
            gate = next((d for d in reader.input if d in produced_by and produced_by[d] in bwd), None)
            if gate is None:                 # e.g. Transpose(W): gate on what its first backward reader reads
                later = [r for o in reader.output for r in read_by[o] if r in bwd]
                gate = next((d for r in later for d in g.node[r].input
                             if d in produced_by and produced_by[d] in bwd and d not in reader.output), None)
            if gate is None:
                continue
            p = f"{PREFIX}bwd/{count}/"
            nodes, renamed = [], {}
            for i in derivation:
                n = g.node[i]
                if _is_gate(n, constants):
                    nodes += gate_nodes(n.input[0], gate, f"{p}{len(renamed)}/", ZERO)
                    renamed[n.output[0]] = nodes[-1].output[0]
                    continue
                new = copy.deepcopy(n)
                new.input[:] = [renamed.get(t, t) for t in n.input]
                for o, out in enumerate(n.output):
                    renamed[out] = p + "w" if out == x else p + f"{len(renamed)}"
                    new.output[o] = renamed[out]
                new.name = p + n.op_type + str(len(renamed))
                nodes.append(new)
            inserts.setdefault(j, []).extend(nodes)
            reader.input[:] = [renamed[x] if t == x else t for t in reader.input]
            count += 1
    if count:
        insert_before(g, inserts)
        if not any(i.name == ZERO for i in g.initializer):    # ORT's constant sharing renamed the forward's
            g.initializer.append(numpy_helper.from_array(np.asarray(0, dtype=np.int64), ZERO))
    return count


def _fold_transpose_b(r: onnx.NodeProto, wt: str, w: str) -> bool:
    """Reader r of wt = Transpose(w) made to read w itself, if r is a matmul reading wt (only) as its B."""
    if len(r.input) < 2 or r.input[1] != wt or list(r.input).count(wt) != 1:
        return False
    attrs = {a.name: a for a in r.attribute}
    if r.op_type == "MatMul":
        r.op_type, r.domain = "FusedMatMul", "com.microsoft"
        r.attribute.append(helper.make_attribute("transB", 1))
    elif r.op_type in ("FusedMatMul", "Gemm") and not ("transBatchB" in attrs and attrs["transBatchB"].i):
        if "transB" in attrs:
            attrs["transB"].i = 1 - attrs["transB"].i
        else:
            r.attribute.append(helper.make_attribute("transB", 1))
    else:
        return False
    r.input[1] = w
    return True


def fuse_transposes(model: onnx.ModelProto) -> int:
    """In place: every Transpose of a dequantized [out, in] weight or offset (ours: named under PREFIX) folded into
    its matmul readers: MatMul(A, W^T) -> FusedMatMul(A, W, transB=1); FusedMatMul or Gemm (transB=t) -> transB
    1 - t. ORT's gradient builder needs the plain MatMul, so this runs on the finished training and eval graphs.
    Without it, the backward pass transposes a float32 weight per use, and ORT 1.19.2 fails to start a session
    on a Transpose reading a uint4 DequantizeLinear (without a zero point: a QuantizeLinear of the wrong type,
    "tensor(uint4) ... does not match expected type (tensor(uint8))", as for int8, module note; with one: a scale
    shape error), so this pass is required.
    -> how many readers were rewritten."""
    g = model.graph
    read_by = readers(g)
    outputs = {o.name for o in g.output}
    count, dead = 0, set()
    for i, t in enumerate(g.node):
        if (t.op_type != "Transpose" or not t.name.startswith(PREFIX)
                or [list(a.ints) for a in t.attribute if a.name == "perm"] != [[1, 0]]):
            continue
        left = 0
        for j in read_by[t.output[0]]:
            r = g.node[j]
            if _fold_transpose_b(r, t.output[0], t.input[0]):
                count += 1
            else:
                left += 1
        if not left and t.output[0] not in outputs:
            dead.add(i)
    if dead:
        kept = [n for i, n in enumerate(g.node) if i not in dead]
        del g.node[:]
        g.node.extend(kept)
    if count and not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
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
        w = dequantize_array(codes_array(inits[q.codes], q, str(bundle_dir)), read_tensor(inits[q.scale], str(bundle_dir)),
                             q.block, q.axis, read_tensor(inits[q.offset], str(bundle_dir)) if q.offset else None)
        if q.codes_transposed:
            w = w.T                                   # -> the onnx tensor
        out[q.source_key] = np.ascontiguousarray(w.T if q.transposed else w)
    return out
