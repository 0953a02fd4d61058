"""The training graph's LM head and loss, computed in slices so that no [N, vocab] tensor exists.

The traced forward ends in   h [N, H] -> Gemm(h, W) = logits [N, V] -> SoftmaxCrossEntropyLoss(sum) -> * loss_scale.
Differentiated by ORT as is, the training graph keeps the [N, V] logits, log-probabilities and their
gradients alive together: 1 GB each for Gemma3's 262k vocabulary at 1,024 labelled rows.

`chunk_head_loss` rewrites that tail for the training graph only (the eval graph keeps the plain head
and its `logits` output). The head and its gradient are computed in the forward pass:
- rows: in up to `chunks` slices of at least `min_rows` rows (fewer if N is smaller), one after another;
- vocabulary: within a row slice, in slices of at most `vocab_cols` entries with an online softmax
  (_chunk_nodes), so the largest tensor is [rows, vocab_cols]. The slices of W are views: initializers
  that point at their rows' bytes in the shard file. The tied embedding lookup reads them too, so W's
  pages are mapped once.
The slices are unrolled in the graph: ORT 1.19's gradient builder aborts on a graph that holds a Loop
node, even one it need not differentiate. Unused row slices are empty and cost nothing.

    per row slice:  nll_c = CE(h_c W^T, y_c),  G_c = (softmax(h_c W^T) - onehot(y_c)) W * loss_scale * valid_c
    loss = loss_scale * sum(nll_c) + sum((h - stop(h)) * G)

The second term is zero in value, and its gradient with respect to h is G = dLoss/dh, exactly what
the plain graph would back-propagate. For ORT's gradient builder to leave the head branch alone (it
would otherwise differentiate through the softmax), the branch reads stop(h): h * 2^40 cast to int64
and back, ORT's documented stop-gradient edge (a Cast to a non-float type). The round trip is exact
for 2^-17 <= |h| < 2^23 and off by at most 2^-40 below that. Hidden states beyond 2^23 (or NaN/inf)
overflow the cast; the surrogate term then makes the loss huge or NaN, so a broken model still shows.

Measured (Gemma3-270M, LoRA r=8, seq 128, 2 threads; rows in one slice of <= 1,024 against the
former 128-row slices over the whole vocabulary): micro-batch 8 peak RSS 4,280 -> 2,539 MiB and
9.7 -> 8.8 s per step; micro-batch 1 x accum 8 peak 1,557 -> 1,331 MiB.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from .export import ExportError
from .quantize import ZERO, gate_nodes, gather_dequantized, lookups, reads_as_table
from .recompute import drop_dead

STOP_SCALE = 2.0 ** 40
DEFAULT_CHUNKS = 8      # at most this many row slices ...
MIN_ROWS = 1024         # ... of at least this many rows: each row slice's GEMMs re-pack all of W (671 MB for
                        # Gemma3-270M, ~115 ms); with the vocabulary sliced, 1,024 rows hold ~4 x 64 MiB.
VOCAB_COLS = 16384      # vocabulary entries per slice of the head (see _chunk_nodes)
VOCAB_ALIGN = 64        # slice starts: 64 rows of W = 64 * H * 4 bytes, a multiple of 16 KiB pages for H % 64 == 0
FIXED_BOUND_MAX = 40.0  # soft-caps up to this use M = cap (exp(-2 * 40) is a normal float32)
PREFIX = "/chunked_head/"


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _const(name: str, value, dtype) -> TensorProto:
    return numpy_helper.from_array(np.asarray(value, dtype=dtype), PREFIX + name)


def _find_tail(g: onnx.GraphProto):
    """(loss Mul, SoftmaxCrossEntropyLoss, head Gemm/MatMul, nodes between head and loss)."""
    producer = {o: n for n in g.node for o in n.output}
    sces = [n for n in g.node if n.op_type == "SoftmaxCrossEntropyLoss"]
    if len(sces) != 1:
        raise ExportError(f"chunked head: expected one SoftmaxCrossEntropyLoss in the traced graph, found {len(sces)}")
    sce = sces[0]
    mul = producer.get("loss")
    if mul is None or mul.op_type != "Mul" or sce.output[0] not in mul.input:
        raise ExportError("chunked head: `loss` is not loss_scale * SoftmaxCrossEntropyLoss; re-trace the model")
    between, node = [], producer[sce.input[0]]
    while node.op_type not in ("Gemm", "MatMul"):
        between.append(node)
        node = producer[node.input[0]]
    return mul, sce, node, between


def chunk_head_loss(model: onnx.ModelProto, chunks: int, min_rows: int, softcap: float | None,
                    vocab_cols: int = VOCAB_COLS) -> None:
    """Rewrite the traced forward's head + loss in place (see the module docstring)."""
    g = model.graph
    mul, sce, head, between = _find_tail(g)
    if between and softcap is None:
        raise ExportError(f"chunked head: {[n.op_type for n in between]} between the LM head and the loss, "
                          "but the model has no logit soft-cap; re-trace the model")
    attrs = {a.name: helper.get_attribute_value(a) for a in head.attribute}
    if head.op_type == "Gemm" and (len(head.input) > 2 or attrs.get("transA", 0) or attrs.get("alpha", 1.0) != 1.0):
        raise ExportError("chunked head: the LM head Gemm has a bias, transA or alpha; not supported")
    h, w = head.input[0], head.input[1]
    w_is_vh = head.op_type == "Gemm" and attrs.get("transB", 0) == 1     # W [V, H] (tied embedding) or [H, V]
    quant = _dequantized_rows(g, w) if w_is_vh else None
    if quant:                      # a quantized base (quantize.quantize_vocab): read the codes and scales instead
        w, dq_block = quant[0], quant[2]
    elif w not in {i.name for i in g.initializer}:
        raise ExportError(f"chunked head: the LM head weight {w!r} is not an initializer")
    y = sce.input[1]
    scale = [i for i in mul.input if i != sce.output[0]][0]
    drop = {id(n) for n in [mul, sce, head, *between]}
    kept = [n for n in g.node if id(n) not in drop]
    del g.node[:]
    g.node.extend(kept)

    p, n = PREFIX, helper.make_node
    g.initializer.extend([
        _const("stop_scale", STOP_SCALE, np.float32),
        _const("chunks", [chunks], np.int64),
        _const("min_rows", [min_rows], np.int64),
        _const("zero1", [0], np.int64),
        _const("one1", [1], np.int64),
        _const("axis0", [0], np.int64),
        _const("axis1", [1], np.int64),
        _const("axis_last", [-1], np.int64),
        _const("ignore", -100, np.int64),
        _const("zero", 0, np.int64),
        _const("one", 1.0, np.float32),
    ])
    if softcap is not None:
        g.initializer.append(_const("cap", softcap, np.float32))
    w_slices = _vocab_slices(g, w, w_is_vh, vocab_cols, quant[1] if quant else None, dq_block if quant else 0)
    opset = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
    nodes = [
        # stop(h): exact copy of h that ORT's gradient builder does not differentiate through
        n("Mul", [h, p + "stop_scale"], [p + "h_scaled"]),
        n("Cast", [p + "h_scaled"], [p + "h_int"], to=TensorProto.INT64),
        n("Cast", [p + "h_int"], [p + "h_back"], to=TensorProto.FLOAT),
        n("Div", [p + "h_back", p + "stop_scale"], [p + "h_stop"]),
        # used = clamp(N // min_rows, 1, chunks) slices of rows = ceil(N / used); the slices after
        # them are empty. Pad h (zeros) and labels (-100) to used * rows.
        n("Shape", [p + "h_stop"], [p + "n"], start=0, end=1),
        n("Div", [p + "n", p + "min_rows"], [p + "fits"]),
        n("Max", [p + "fits", p + "one1"], [p + "fits_or_1"]),
        n("Min", [p + "fits_or_1", p + "chunks"], [p + "used"]),
        n("Sub", [p + "used", p + "one1"], [p + "used_minus_1"]),
        n("Add", [p + "n", p + "used_minus_1"], [p + "n_up"]),
        n("Div", [p + "n_up", p + "used"], [p + "rows"]),
        n("Mul", [p + "rows", p + "used"], [p + "n_pad"]),
        n("Sub", [p + "n_pad", p + "n"], [p + "pad"]),
        n("Concat", [p + "zero1", p + "zero1", p + "pad", p + "zero1"], [p + "h_pads"], axis=0),
        n("Pad", [p + "h_stop", p + "h_pads"], [p + "h_pad"], mode="constant"),
        n("Concat", [p + "zero1", p + "pad"], [p + "y_pads"], axis=0),
        n("Pad", [y, p + "y_pads", p + "ignore"], [p + "y_pad"], mode="constant"),
    ]
    g_parts, nll_parts = [], []
    start = p + "zero1"
    for k in range(chunks):
        c = f"{p}c{k}/"
        nodes += [n("Add", [start, p + "rows"], [c + "end"])]
        nodes += _chunk_nodes(g, c, start, c + "end", w_slices, w_is_vh, scale, softcap, opset)
        g_parts.append(c + "g")
        nll_parts.append(c + "nll")
        # The next chunk starts where this one's G ends: a real data dependency, so ORT runs the
        # chunks one after another and frees each chunk's tensors before the next.
        nodes += [n("Shape", [c + "g"], [c + "g_rows"], start=0, end=1),
                  n("Add", [start, c + "g_rows"], [c + "next"])]
        start = c + "next"
    nodes += [
        n("Concat", g_parts, [p + "g_pad"], axis=0),
        n("Slice", [p + "g_pad", p + "zero1", p + "n", p + "axis0"], [p + "g"]),
        n("Sum", nll_parts, [p + "nll"]),
        # loss = loss_scale * nll + sum((h - stop(h)) * G): value unchanged, d/dh = G
        n("Sub", [h, p + "h_stop"], [p + "h_minus_stop"]),
        n("Mul", [p + "h_minus_stop", p + "g"], [p + "surrogate_terms"]),
        n("ReduceSum", [p + "surrogate_terms"], [p + "surrogate"], keepdims=0),
        n("Mul", [p + "nll", scale], [p + "loss_value"]),
        n("Add", [p + "loss_value", p + "surrogate"], ["loss"]),
    ]
    for i, node in enumerate(nodes):
        node.name = f"{p}{node.op_type}_{i}"      # named, so that a profile tells the head's kernels apart
    g.node.extend(nodes)
    if len(w_slices) > 1:      # the tied embedding lookup reads the views too
        _route(g, lookups(g, w) if quant else [([j], node.input[1], node.output[0]) for j, node in enumerate(g.node)
                                               if reads_as_table(node, w)], w_slices)
    if quant:
        drop_dead(g)              # the whole head's DequantizeLinear, read by nothing now (and the whole table)
    elif not any(w in node.input for node in g.node):
        g.initializer.remove(next(i for i in g.initializer if i.name == w))


def _dequantized_rows(g: onnx.GraphProto, w: str) -> tuple[str, str, int] | None:
    """(codes, scales, block) if `w` is a DequantizeLinear of initializers (through the gate's aliases), one scale
    per row (block 0) or per `block` entries along the row."""
    producer = {o: n for n in g.node for o in n.output}
    inits = {i.name for i in g.initializer}
    dq = producer.get(w)
    if dq is None or dq.op_type != "DequantizeLinear" or dq.input[0] not in inits:
        return None
    scale = dq.input[1]
    while scale not in inits and scale in producer:
        scale = producer[scale].input[0]
    block = next((a.i for a in dq.attribute if a.name == "block_size"), 0)
    return (dq.input[0], scale, block) if scale in inits else None


def vocab_slice_width(vocab: int, vocab_cols: int = VOCAB_COLS) -> int:
    """Entries per vocabulary slice of the head: even slices of <= vocab_cols entries, each a multiple of
    VOCAB_ALIGN rows (so each starts on a page boundary of the weight); the last one may be shorter."""
    k = _ceil_div(vocab, vocab_cols)
    while (cols := _ceil_div(_ceil_div(vocab, k), VOCAB_ALIGN) * VOCAB_ALIGN) > vocab_cols and cols > VOCAB_ALIGN:
        k += 1
    return cols


def _vocab_slices(g: onnx.GraphProto, w: str, w_is_vh: bool, vocab_cols: int, scale: str | None = None,
                  block: int = 0) -> list[tuple[str, int, int, str | None, int]]:
    """The head weight in vocabulary slices of <= vocab_cols entries: [(name, first, end, scales or None)].

    A [V, H] weight in external data (the build always makes it so: graph_fixes.untie_head, shards) is
    sliced for free: each slice is another initializer pointing at its rows' bytes in the same shard file.
    Any other weight is read whole: one slice, W itself. A quantized head (`scale`: w is then its int8 codes,
    one scale per row) is sliced the same way, codes and scales alike."""
    init = next(i for i in g.initializer if i.name == w)
    vocab = init.dims[0] if w_is_vh else init.dims[1]
    cols = vocab_slice_width(vocab, vocab_cols)
    bounds = [(a, min(a + cols, vocab)) for a in range(0, vocab, cols)]
    sliceable = w_is_vh and init.data_location == TensorProto.EXTERNAL and init.data_type in (
        TensorProto.FLOAT, TensorProto.INT8)
    if len(bounds) == 1 or not sliceable:
        return [(w, 0, vocab, scale, block)]      # not sliceable in place: the whole vocabulary at once
    scales = next(i for i in g.initializer if i.name == scale) if scale else None
    slices = []
    for j, (a, b) in enumerate(bounds):
        view = _row_view(init, a, b, f"{PREFIX}w{j}")
        s_view = _row_view(scales, a, b, f"{PREFIX}w{j}_scale") if scales is not None else None
        g.initializer.extend([view] + ([s_view] if s_view is not None else []))
        slices.append((view.name, a, b, s_view.name if s_view is not None else None, block))
    return slices


def _row_view(init: TensorProto, a: int, b: int, name: str) -> TensorProto:
    """Rows [a, b) of an initializer: a view of its bytes in the shard file when it is external data, else a copy."""
    if init.data_location != TensorProto.EXTERNAL:
        return numpy_helper.from_array(numpy_helper.to_array(init)[a:b], name)
    ext = {e.key: e.value for e in init.external_data}
    row_bytes = {TensorProto.FLOAT: 4, TensorProto.INT8: 1}[init.data_type] * int(np.prod(init.dims[1:], dtype=np.int64))
    view = TensorProto(name=name, dims=[b - a, *init.dims[1:]], data_type=init.data_type,
                       data_location=TensorProto.EXTERNAL)
    for key, value in (("location", ext["location"]), ("offset", str(int(ext.get("offset", 0)) + a * row_bytes)),
                       ("length", str((b - a) * row_bytes))):
        entry = view.external_data.add()
        entry.key, entry.value = key, value
    return view


def _gather_rows(g: onnx.GraphProto, prefix: str, slices: list[tuple], idx: str, out: str
                 ) -> list[onnx.NodeProto]:
    """out = W[idx] (rows of a [V, H] weight) from its vocabulary views: each view gathers the indices that
    fall in it (others read its row 0 and are zeroed), and the parts are summed. Reading the views
    instead of W keeps W's own mapping untouched, so its pages are not counted twice in RSS."""
    p, n = PREFIX, helper.make_node
    nodes, parts = [], []
    for j, (name, a, b, scale, block) in enumerate(slices):
        q = f"{prefix}{j}/"
        g.initializer.extend([_const(q[len(p):] + "first", a, np.int64), _const(q[len(p):] + "size", b - a, np.int64)])
        nodes += [n("Sub", [idx, q + "first"], [q + "i"]),
                  n("GreaterOrEqual", [q + "i", p + "zero"], [q + "above"]),
                  n("Less", [q + "i", q + "size"], [q + "below"]),
                  n("And", [q + "above", q + "below"], [q + "inside"]),
                  n("Where", [q + "inside", q + "i", p + "zero"], [q + "i_safe"]),
                  *_gather(name, scale, q + "i_safe", q + "rows", q + "dq/", block),
                  n("Cast", [q + "inside"], [q + "inside_f"], to=TensorProto.FLOAT),
                  n("Unsqueeze", [q + "inside_f", p + "axis_last"], [q + "mask"]),
                  n("Mul", [q + "rows", q + "mask"], [q + "part"])]
        parts.append(q + "part")
    return nodes + [n("Sum", parts, [out])]


def _gather(table: str, scale: str | None, idx: str, out: str, p: str, block: int = 0) -> list[onnx.NodeProto]:
    """out = table[idx] (rows), dequantized when the table is int8 codes with `scale`s (per row, or per block)."""
    if scale is None:
        return [helper.make_node("Gather", [table, idx], [out], axis=0)]
    return gather_dequantized(table, scale, idx, out, p, PREFIX + "axis_last", block)


def _route(g: onnx.GraphProto, found: list[tuple[list[int], str, str]], slices: list[tuple]) -> None:
    """Every lookup in `found` ((its nodes' indices, the ids, the rows out): the tied embedding's) reads the
    vocabulary views instead of the whole table: so the table's pages are mapped once, not once by the views and
    again by the lookup (RSS counts a page once per mapping: Qwen2.5-0.5B int4 had its 130 MiB int8 table in RSS
    twice). The whole table is then read by nothing; the caller drops it."""
    replace = {min(members): _gather_rows(g, f"{PREFIX}lookup{r}/", slices, ids, out)
               for r, (members, ids, out) in enumerate(found)}
    drop = {i for members, _, _ in found for i in members}
    nodes = []
    for i, node in enumerate(g.node):
        nodes += replace.get(i, [])
        if i not in drop:
            nodes.append(node)
    del g.node[:]
    g.node.extend(nodes)


def _chunk_nodes(g: onnx.GraphProto, c: str, start: str, end: str, w_slices: list[tuple],
                 w_is_vh: bool, scale: str, softcap: float | None, opset: int) -> list[onnx.NodeProto]:
    """Rows [start, end) of the padded h / labels -> c+"nll" (summed NLL) and c+"g" (their dLoss/dh).

    The vocabulary is visited in slices with an online softmax, so that no [rows, V] tensor exists:
        z_k = h W_k^T (soft-capped: cap * tanh(z_k / cap)),  M = running row max,  e_k = exp(z_k - M)
        S   = sum_k rowsum(e_k)           (rescaled by exp(M_old - M) when M grows)
        A   = sum_k (e_k * dcap_k) W_k    (likewise; dcap = 1 - tanh^2, or 1 without a cap)
        nll = M + log S - z_y,   dLoss/dh = (A / S - dcap_y * W_y) * loss_scale * valid
    With a soft-cap |z| <= cap, so M = cap is a fixed bound and nothing is rescaled (for caps up to
    FIXED_BOUND_MAX: below exp(-2 cap) float32 underflows)."""
    p, n = PREFIX, helper.make_node
    nodes = [
        n("Slice", [p + "h_pad", start, end, p + "axis0"], [c + "h"]),
        n("Slice", [p + "y_pad", start, end, p + "axis0"], [c + "y"]),
        n("Equal", [c + "y", p + "ignore"], [c + "ignored"]),
        n("Not", [c + "ignored"], [c + "valid_b"]),
        n("Cast", [c + "valid_b"], [c + "valid"], to=TensorProto.FLOAT),
        n("Unsqueeze", [c + "valid", p + "axis1"], [c + "valid_col"]),
        n("Where", [c + "ignored", p + "zero", c + "y"], [c + "y_safe"]),
    ]
    # the target's logit from its row of W: [rows, H] . h, summed per row
    w_y = c + "w_y_raw"
    if len(w_slices) > 1:      # views of a [V, H] weight
        nodes += _gather_rows(g, c + "w_y/", w_slices, c + "y_safe", w_y)
    elif w_is_vh:
        nodes += _gather(w_slices[0][0], w_slices[0][3], c + "y_safe", w_y, c + "w_y/", w_slices[0][4])
    else:
        nodes.append(n("Gather", [w_slices[0][0], c + "y_safe"], [w_y], axis=1))
    if not w_is_vh:
        nodes.append(n("Transpose", [w_y], [c + "w_y"], perm=[1, 0]))
        w_y = c + "w_y"
    nodes += [n("Mul", [c + "h", w_y], [c + "hw_y"]),
              n("ReduceSum", [c + "hw_y", p + "axis1"], [c + "u_y"], keepdims=1)]
    if softcap is not None:
        nodes += [n("Div", [c + "u_y", p + "cap"], [c + "u_y_over_cap"]),
                  n("Tanh", [c + "u_y_over_cap"], [c + "t_y"]),
                  n("Mul", [c + "t_y", p + "cap"], [c + "z_y"]),
                  n("Mul", [c + "t_y", c + "t_y"], [c + "t_y2"]),
                  n("Sub", [p + "one", c + "t_y2"], [c + "dcap_y"])]
    else:
        nodes += [n("Identity", [c + "u_y"], [c + "z_y"])]
    inv_cap = 1.0 / softcap if softcap is not None else 1.0
    fixed_bound = p + "cap" if softcap is not None and softcap <= FIXED_BOUND_MAX else None
    m = s = a = None
    for k, (w_k, _, _, scale_k, block_k) in enumerate(w_slices):
        v = f"{c}v{k}/"
        h_k = c + "h"
        if a is not None:
            # Read h through the previous slices' results (a Slice of all its rows), so that ORT runs the
            # slices one after another and frees each slice's [rows, V_k] tensors before the next. Both
            # sums are needed: ORT defers a node until its output is used, and e_k stays alive until
            # the last of its readers has run.
            nodes += [n("Shape", [a], [v + "after_a"], start=0, end=1),
                      n("Shape", [s], [v + "after_s"], start=0, end=1),
                      n("Min", [v + "after_a", v + "after_s"], [v + "after"]),
                      n("Slice", [c + "h", p + "zero1", v + "after", p + "axis0"], [v + "h"])]
            h_k = v + "h"
        if scale_k is not None:    # this slice's rows dequantized just before their use, once h_k exists
            # An empty row slice (the chunks after the used ones) dequantizes no rows: its codes and scales are cut
            # to V_k rows, or to 1 when it has no rows. Without the cut, each step dequantized the
            # whole head once per chunk, used or not (Gemma3's 262k x 640 head: 8 x 16 slices, ~2 s per step).
            nodes += gate_nodes(scale_k, h_k, v + "dq/", ZERO)
            nodes += [n("Shape", [h_k], [v + "rows"], start=0, end=1),
                      n("Shape", [w_k], [v + "width"], start=0, end=1),
                      n("Mul", [v + "rows", v + "width"], [v + "rows_x_width"]),
                      n("Max", [v + "rows_x_width", p + "one1"], [v + "at_least_1"]),     # Gemm needs K > 0
                      n("Min", [v + "at_least_1", v + "width"], [v + "needed"]),
                      n("Slice", [w_k, p + "zero1", v + "needed", p + "axis0"], [v + "codes"]),
                      n("Slice", [v + "dq/x", p + "zero1", v + "needed", p + "axis0"], [v + "scale"]),
                      n("DequantizeLinear", [v + "codes", v + "scale"], [v + "w"],
                        **({"axis": 1, "block_size": block_k} if block_k else {"axis": 0}))]
            w_k = v + "w"
        nodes.append(n("Gemm", [h_k, w_k], [v + "u"], transB=1 if w_is_vh else 0, alpha=inv_cap))
        z = v + "u"
        if softcap is not None:
            nodes += [n("Tanh", [v + "u"], [v + "t"]), n("Mul", [v + "t", p + "cap"], [v + "z"])]
            z = v + "z"
        if fixed_bound:
            m_k = fixed_bound
        else:
            nodes.append(n("ReduceMax", [z, p + "axis1"], [v + "zmax"], keepdims=1) if opset >= 18
                         else n("ReduceMax", [z], [v + "zmax"], axes=[1], keepdims=1))
            if m is None:
                m_k = v + "zmax"
            else:
                nodes += [n("Max", [m, v + "zmax"], [v + "m"]),
                          n("Sub", [m, v + "m"], [v + "m_shift"]),
                          n("Exp", [v + "m_shift"], [v + "rescale"])]
                m_k = v + "m"
        nodes += [n("Sub", [z, m_k], [v + "z_shift"]),
                  n("Exp", [v + "z_shift"], [v + "e"]),
                  n("ReduceSum", [v + "e", p + "axis1"], [v + "s"], keepdims=1)]
        weighted = v + "e"
        if softcap is not None:
            nodes += [n("Mul", [v + "t", v + "t"], [v + "t2"]),
                      n("Sub", [p + "one", v + "t2"], [v + "dcap"]),
                      n("Mul", [v + "e", v + "dcap"], [v + "e_dcap"])]
            weighted = v + "e_dcap"
        nodes.append(n("Gemm", [weighted, w_k], [v + "a"], transB=0 if w_is_vh else 1))
        if s is None:
            s, a = v + "s", v + "a"
        elif fixed_bound:
            nodes += [n("Add", [s, v + "s"], [v + "s_sum"]), n("Add", [a, v + "a"], [v + "a_sum"])]
            s, a = v + "s_sum", v + "a_sum"
        else:
            nodes += [n("Mul", [s, v + "rescale"], [v + "s_old"]), n("Add", [v + "s_old", v + "s"], [v + "s_sum"]),
                      n("Mul", [a, v + "rescale"], [v + "a_old"]), n("Add", [v + "a_old", v + "a"], [v + "a_sum"])]
            s, a = v + "s_sum", v + "a_sum"
        m = m_k
    dcap_w_y = w_y
    if softcap is not None:
        nodes.append(n("Mul", [w_y, c + "dcap_y"], [c + "dcap_w_y"]))
        dcap_w_y = c + "dcap_w_y"
    return nodes + [
        n("Log", [s], [c + "log_s"]),
        n("Add", [m, c + "log_s"], [c + "lse"]),
        n("Sub", [c + "lse", c + "z_y"], [c + "nll_rows"]),
        n("Mul", [c + "nll_rows", c + "valid_col"], [c + "nll_valid"]),
        n("ReduceSum", [c + "nll_valid"], [c + "nll"], keepdims=0),
        n("Div", [a, s], [c + "softmax_w"]),
        n("Sub", [c + "softmax_w", dcap_w_y], [c + "g_unscaled"]),
        n("Mul", [c + "valid_col", scale], [c + "row_scale"]),
        n("Mul", [c + "g_unscaled", c + "row_scale"], [c + "g"]),
    ]
