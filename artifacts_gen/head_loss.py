"""The training graph's LM head and loss, computed in row chunks so that no [N, vocab] tensor exists.

The traced forward ends in   h [N, H] -> Gemm(h, W) = logits [N, V] -> SoftmaxCrossEntropyLoss(sum) -> * loss_scale.
Differentiated by ORT as is, the training graph keeps the [N, V] logits, log-probabilities and their
gradients alive together: 1 GB each for Gemma3's 262k vocabulary at 1,024 labelled rows.

`chunk_head_loss` rewrites that tail for the training graph only (the eval graph keeps the plain head
and its `logits` output). The head and its gradient are computed in the forward pass, in up to
`chunks` slices of at least `min_rows` rows (fewer if N is smaller), one slice after another. The
slices are unrolled in the graph: ORT 1.19's gradient builder aborts on a graph that holds a Loop
node, even one it need not differentiate. Unused slices are empty and cost nothing.

    per chunk:  z = h_c W^T,  nll_c = CE(z, y_c),  G_c = (softmax(z) - onehot(y_c)) W * loss_scale * valid_c
    loss = loss_scale * sum(nll_c) + sum((h - stop(h)) * G)

The second term is zero in value, and its gradient with respect to h is G = dLoss/dh, exactly what
the plain graph would back-propagate. For ORT's gradient builder to leave the chunk branch alone (it
would otherwise differentiate through the softmax), the branch reads stop(h): h * 2^40 cast to int64
and back, ORT's documented stop-gradient edge (a Cast to a non-float type). The round trip is exact
for 2^-17 <= |h| < 2^23 and off by at most 2^-40 below that. Hidden states beyond 2^23 (or NaN/inf)
overflow the cast; the surrogate term then makes the loss huge or NaN, so a broken model still shows.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from .export import ExportError

STOP_SCALE = 2.0 ** 40
DEFAULT_CHUNKS = 8      # at most this many slices ...
MIN_ROWS = 128          # ... of at least this many rows: each slice's two GEMMs re-pack all of W (545 MB for
                        # Qwen2.5-0.5B). Qwen2.5 at micro-batch 8: 48 rows 18.2-18.7 s/step, 128 rows 16.2-16.5 s
PREFIX = "/chunked_head/"


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


def chunk_head_loss(model: onnx.ModelProto, chunks: int, min_rows: int, softcap: float | None) -> None:
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
    if w not in {i.name for i in g.initializer}:
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
        _const("ignore", -100, np.int64),
        _const("zero", 0, np.int64),
        _const("one", 1.0, np.float32),
    ])
    if softcap is not None:
        g.initializer.append(_const("cap", softcap, np.float32))
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
        nodes += _chunk_nodes(c, start, c + "end", w, w_is_vh, scale, softcap)
        g_parts.append(c + "g")
        nll_parts.append(c + "nll")
        # The next chunk starts where this one's G ends: a real data dependency, so ORT runs the
        # chunks one after another and frees each chunk's [rows, V] tensors before the next.
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
    g.node.extend(nodes)


def _chunk_nodes(c: str, start: str, end: str, w: str, w_is_vh: bool, scale: str,
                 softcap: float | None) -> list[onnx.NodeProto]:
    """Rows [start, end) of the padded h / labels -> c+"nll" (summed NLL) and c+"g" (their dLoss/dh)."""
    p, n = PREFIX, helper.make_node
    nodes = [
        n("Slice", [p + "h_pad", start, end, p + "axis0"], [c + "h"]),
        n("Slice", [p + "y_pad", start, end, p + "axis0"], [c + "y"]),
        n("Gemm", [c + "h", w], [c + "z"], transB=1 if w_is_vh else 0),
    ]
    logits = c + "z"
    if softcap is not None:
        nodes += [n("Div", [c + "z", p + "cap"], [c + "z_over_cap"]),
                  n("Tanh", [c + "z_over_cap"], [c + "t"]),
                  n("Mul", [c + "t", p + "cap"], [c + "z_capped"])]
        logits = c + "z_capped"
    nodes += [
        # summed NLL of the valid rows; dLoss/dlogits = (softmax - onehot(y)) * loss_scale, zero on ignored rows
        n("Equal", [c + "y", p + "ignore"], [c + "ignored"]),
        n("Not", [c + "ignored"], [c + "valid_b"]),
        n("Cast", [c + "valid_b"], [c + "valid"], to=TensorProto.FLOAT),
        n("Unsqueeze", [c + "valid", p + "axis1"], [c + "valid_col"]),
        n("Where", [c + "ignored", p + "zero", c + "y"], [c + "y_safe"]),
        n("Unsqueeze", [c + "y_safe", p + "axis1"], [c + "y_col"]),
        n("LogSoftmax", [logits], [c + "logp"], axis=1),
        n("GatherElements", [c + "logp", c + "y_col"], [c + "logp_y"], axis=1),
        n("Mul", [c + "logp_y", c + "valid_col"], [c + "logp_y_valid"]),
        n("ReduceSum", [c + "logp_y_valid"], [c + "logp_sum"], keepdims=0),
        n("Neg", [c + "logp_sum"], [c + "nll"]),
        n("Exp", [c + "logp"], [c + "prob"]),
        n("GatherElements", [c + "prob", c + "y_col"], [c + "prob_y"], axis=1),
        n("Sub", [c + "prob_y", p + "one"], [c + "prob_y_minus_1"]),
        n("ScatterElements", [c + "prob", c + "y_col", c + "prob_y_minus_1"], [c + "dz"], axis=1),
    ]
    dz = c + "dz"
    if softcap is not None:
        nodes += [n("Mul", [c + "t", c + "t"], [c + "t2"]),
                  n("Sub", [p + "one", c + "t2"], [c + "dtanh"]),
                  n("Mul", [c + "dz", c + "dtanh"], [c + "dz_raw"])]
        dz = c + "dz_raw"
    return nodes + [
        n("Gemm", [dz, w], [c + "g_unscaled"], transB=0 if w_is_vh else 1),
        n("Mul", [c + "valid_col", scale], [c + "row_scale"]),
        n("Mul", [c + "g_unscaled", c + "row_scale"], [c + "g"]),
    ]
