"""Replace contrib kernels of ORT 1.19 that are measured slow on CPU, in the generated training graph,
by the same math in standard elementwise ops (vectorised and multi-threaded in ORT).
`replace_slow_kernels` applies every rewrite below.

FastGeluGrad: ORT fuses GPT-2's tanh-approximated GELU into FastGelu, and its gradient builder emits
FastGeluGrad, whose CPU kernel runs at ~75 ns per element: 0.23 s per [1024, 3072] call, 16% of a
GPT-2 124M step at micro-batch 8 (ORT profiler, this machine). The same derivative in standard ops
takes a fraction of that (15 ops at first, GPT-2 micro-batch 8: 5.14-5.18 -> 4.80 s per step; 13 now,
through the sigmoid form below). Only X is kept for the backward pass, as before; the ops' temporaries
live within the backward pass.

    gelu(x)  = 0.5 x (1 + tanh(u)),  u = k (x + c x^3),  k = sqrt(2 / pi),  c = 0.044715
    gelu'(x) = 0.5 (1 + t) + 0.5 x (1 - t^2) k (1 + 3 c x^2),  t = tanh(u)
             = s + s (1 - s) x (2k + 6kc x^2),  s = 0.5 (1 + t) = sigmoid(2u)    (13 ops, not 15)

LayerNormalizationGrad (GPT-2's LayerNorm; the norm weights are frozen, so only dX is needed, while the
kernel also reduces dScale and dBias over all rows): GPT-2 124M micro-batch 8, two A/B pairs in one
session, 4.79 / 4.93 -> 4.55 / 4.49 s per step, the same losses to the printed 4 decimals, the same peak.

    xhat = (x - mean) inv,  g = dY w,  dX = inv (g - mean(g) - xhat mean(g xhat))
    with mean(g xhat) = inv (mean(g x) - mean mean(g)):  dX = g inv - x k + (mean k - inv mean(g)),  k = inv^2 mean(g xhat)

Every [N, D] op of that form reads dY, so none of them can run (and be kept) in the forward pass.
GatherGrad (the gradient of a row gather, Gather on axis 0): ORT's CPU kernel locks a mutex for every element
it adds, ~22 ms for a [1024, 768] gradient. Where the indices come from NonZero, no index repeats, and a
ScatterND of the rows into zeros is the same sum (~0.2 ms): the padding-free graph's gathers of the real
tokens (packing.py) and the LM head's gather of the labelled rows.

SimplifiedLayerNormalizationGrad (RMSNorm: Gemma3's four norms per layer plus q/k norms, Qwen2's two): the
same kind of rewrite, dX only. ORT's kernel took 768 of 6,168 ms of kernel time in a Gemma3-270M SFT step at
micro-batch 8 (~7 ms per [859, 640] call); the five [N, D] ops below take ~390 ms less in total (profiles of
one step each). Peaks unchanged within 15 MiB (Gemma3 1x8 / 8x1, Qwen2.5 1x8 / 8x1). (Tried in an earlier
session, on a graph that let ORT reuse buffers, it had raised Gemma3's 8x1 peak from 4.3 to 5.1 GB.)

    y = x inv w,  g = dY w,  dX = g inv - x inv^3 mean(g x)
"""
from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import helper, numpy_helper

K = math.sqrt(2.0 / math.pi)
C = 0.044715
PREFIX = "/fast_gelu_grad/"
LN_PREFIX = "/layer_norm_grad/"
PREFIX_GATHER = "/gather_grad/"
RMS_PREFIX = "/rms_norm_grad/"


def replace_slow_kernels(model: onnx.ModelProto) -> dict[str, int]:
    """Every rewrite of this module, in place; returns how many nodes each replaced."""
    return {"FastGeluGrad": replace_fast_gelu_grad(model), "LayerNormalizationGrad": replace_layer_norm_grad(model),
            "SimplifiedLayerNormalizationGrad": replace_rms_norm_grad(model), "GatherGrad": replace_gather_grad(model)}


def _rewrite(g: onnx.GraphProto, expand, initializers) -> int:
    """Replace every node for which `expand(node, k)` (k = how many were replaced before it) returns a node list,
    in place and in order; add `initializers` (a list) if any was. Returns how many were replaced."""
    out, count = [], 0
    for node in g.node:
        new = expand(node, count)
        if new is None:
            out.append(node)
            continue
        out += new
        count += 1
    if count:
        del g.node[:]
        g.node.extend(out)
        g.initializer.extend(initializers)
    return count


def _reads(model: onnx.ModelProto) -> set[str]:
    """Every tensor name some node or the graph's output reads."""
    return {i for node in model.graph.node for i in node.input} | {o.name for o in model.graph.output}


def _dx_only(node: onnx.NodeProto, op_type: str, n_inputs: int, read: set[str]) -> bool:
    """Whether `node` is a com.microsoft norm gradient `op_type` over the last axis whose outputs after dX
    (the gradients of the frozen scale and bias) nothing reads."""
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    return (node.op_type == op_type and node.domain == "com.microsoft" and len(node.input) == n_inputs
            and attrs.get("axis", -1) == -1 and not any(o in read for o in node.output[1:] if o))


def _mean_last(model: onnx.ModelProto, axes: str, x: str, out: str) -> onnx.NodeProto:
    """ReduceMean over the last axis, keepdims; its axes became an input (the initializer `axes`) in opset 18."""
    opset = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
    if opset >= 18:
        return helper.make_node("ReduceMean", [x, axes], [out], keepdims=1)
    return helper.make_node("ReduceMean", [x], [out], axes=[-1], keepdims=1)


def _nonzero_rows(g: onnx.GraphProto, producer: dict, name: str) -> bool:
    """Whether `name` is NonZero(x) of a 1-D x as a flat index list: NonZero -> Transpose -> Squeeze(axis 1)
    (torch.nonzero(x).squeeze(1)), possibly cast. Such indices are strictly increasing: no index repeats."""
    node = producer.get(name)
    while node is not None and node.op_type == "Cast":
        node = producer.get(node.input[0])
    if node is None or node.op_type != "Squeeze":
        return False
    axes = [a.ints for a in node.attribute if a.name == "axes"]
    if len(node.input) > 1:
        axes_init = next((i for i in g.initializer if i.name == node.input[1]), None)
        const = producer.get(node.input[1])
        if axes_init is not None:
            axes = [list(numpy_helper.to_array(axes_init).reshape(-1))]
        elif const is not None and const.op_type == "Constant":
            axes = [list(numpy_helper.to_array(const.attribute[0].t).reshape(-1))]
    if not axes or [int(a) for a in axes[0]] not in ([1], [-1]):
        return False
    tr = producer.get(node.input[0])
    if tr is None or tr.op_type != "Transpose" or [list(a.ints) for a in tr.attribute if a.name == "perm"] != [[1, 0]]:
        return False
    nz = producer.get(tr.input[0])
    return nz is not None and nz.op_type == "NonZero"


def replace_gather_grad(model: onnx.ModelProto) -> int:
    """Rewrite every com.microsoft GatherGrad(shape, indices, dY) on axis 0 whose indices are a NonZero row
    list (no index repeats) as ScatterND(zeros(shape), indices[:, None], dY); returns how many.

    ORT's CPU GatherGrad takes a mutex for every element it adds (~22 ms for [1024, 768] on this machine, a
    memcpy's work): the padding-free graph (packing.py) has one per attention layer, and the LM head's
    gather of the labelled rows one more. With no repeated index the scatter writes each row once, which is
    all a sum over repeats would do, and ScatterND's CPU kernel copies rows in parallel (~0.2 ms)."""
    g = model.graph
    n = helper.make_node
    axes = PREFIX_GATHER + "last_axis"
    producer = {o: node for node in g.node for o in node.output}

    def expand(node, k):
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if not (node.op_type == "GatherGrad" and node.domain == "com.microsoft" and attrs.get("axis", 0) == 0
                and _nonzero_rows(g, producer, node.input[1])):
            return None
        shape, idx, dy = node.input
        b = f"{PREFIX_GATHER}{k}/"
        return [
            n("ConstantOfShape", [shape], [b + "zeros"], value=numpy_helper.from_array(np.zeros(1, np.float32))),
            n("Unsqueeze", [idx, axes], [b + "rows"]),
            n("ScatterND", [b + "zeros", b + "rows", dy], [node.output[0]]),
        ]

    return _rewrite(g, expand, [numpy_helper.from_array(np.asarray([-1], np.int64), axes)])


def replace_fast_gelu_grad(model: onnx.ModelProto) -> int:
    """Rewrite every com.microsoft FastGeluGrad(dY, X) without a bias input; returns how many."""
    g = model.graph
    consts = {"two_k": 2 * K, "two_kc": 2 * K * C, "six_kc": 6 * K * C, "one": 1.0}
    c = {name: PREFIX + name for name in consts}
    n = helper.make_node

    def expand(node, k):
        if not (node.op_type == "FastGeluGrad" and node.domain == "com.microsoft" and len(node.input) == 2):
            return None
        dy, x = node.input
        dx = node.output[0]
        b = f"{PREFIX}{k}/"
        return [
            n("Mul", [x, x], [b + "x2"]),
            n("Mul", [b + "x2", c["two_kc"]], [b + "p"]),
            n("Add", [b + "p", c["two_k"]], [b + "two_u_over_x"]),
            n("Mul", [x, b + "two_u_over_x"], [b + "two_u"]),
            n("Sigmoid", [b + "two_u"], [b + "s"]),                        # 0.5 (1 + tanh(u))
            n("Mul", [b + "x2", c["six_kc"]], [b + "q"]),
            n("Add", [b + "q", c["two_k"]], [b + "du"]),                     # 2k (1 + 3 c x^2)
            n("Mul", [x, b + "du"], [b + "x_du"]),
            n("Sub", [c["one"], b + "s"], [b + "one_minus_s"]),
            n("Mul", [b + "s", b + "one_minus_s"], [b + "s_1ms"]),          # (1 - t^2) / 4
            n("Mul", [b + "s_1ms", b + "x_du"], [b + "slope"]),
            n("Add", [b + "s", b + "slope"], [b + "dgelu"]),
            n("Mul", [dy, b + "dgelu"], [dx]),
        ]

    return _rewrite(g, expand, [numpy_helper.from_array(np.asarray(v, np.float32), PREFIX + name)
                                for name, v in consts.items()])


def replace_layer_norm_grad(model: onnx.ModelProto) -> int:
    """Rewrite every com.microsoft LayerNormalizationGrad(dY, X, scale, mean, inv_std) over the last axis
    whose dScale / dBias outputs nothing reads; returns how many."""
    g = model.graph
    read = _reads(model)
    axes = LN_PREFIX + "axes"
    n = helper.make_node

    def expand(node, k):
        if not _dx_only(node, "LayerNormalizationGrad", 5, read):
            return None
        dy, x, w, mean, inv = node.input
        b = f"{LN_PREFIX}{k}/"
        return [
            n("Mul", [dy, w], [b + "g"]),
            _mean_last(model, axes, b + "g", b + "mean_g"),
            n("Mul", [b + "g", x], [b + "gx"]),
            _mean_last(model, axes, b + "gx", b + "mean_gx"),
            n("Mul", [mean, b + "mean_g"], [b + "mean_mean_g"]),                   # [N, 1] from here ...
            n("Sub", [b + "mean_gx", b + "mean_mean_g"], [b + "centered"]),
            n("Mul", [b + "centered", inv], [b + "mean_g_xhat"]),
            n("Mul", [inv, inv], [b + "inv2"]),
            n("Mul", [b + "inv2", b + "mean_g_xhat"], [b + "k"]),
            n("Mul", [mean, b + "k"], [b + "mean_k"]),
            n("Mul", [inv, b + "mean_g"], [b + "inv_mean_g"]),
            n("Sub", [b + "mean_k", b + "inv_mean_g"], [b + "shift"]),             # ... to here
            n("Mul", [b + "g", inv], [b + "g_inv"]),
            n("Add", [b + "g_inv", b + "shift"], [b + "g_inv_shift"]),
            n("Mul", [x, b + "k"], [b + "x_k"]),
            n("Sub", [b + "g_inv_shift", b + "x_k"], [node.output[0]]),
        ]

    return _rewrite(g, expand, [numpy_helper.from_array(np.asarray([-1], np.int64), axes)])


def replace_rms_norm_grad(model: onnx.ModelProto) -> int:
    """Rewrite every com.microsoft SimplifiedLayerNormalizationGrad(dY, X, scale, inv_std) over the last axis
    whose dScale output nothing reads; returns how many."""
    g = model.graph
    read = _reads(model)
    axes = RMS_PREFIX + "axes"
    n = helper.make_node

    def expand(node, k):
        if not _dx_only(node, "SimplifiedLayerNormalizationGrad", 4, read):
            return None
        dy, x, w, inv = node.input
        b = f"{RMS_PREFIX}{k}/"
        return [
            n("Mul", [dy, w], [b + "g"]),
            n("Mul", [b + "g", x], [b + "gx"]),
            _mean_last(model, axes, b + "gx", b + "mean_gx"),
            n("Mul", [inv, inv], [b + "inv2"]),                                    # [N, 1] from here ...
            n("Mul", [b + "inv2", inv], [b + "inv3"]),
            n("Mul", [b + "mean_gx", b + "inv3"], [b + "k"]),                      # ... to here
            n("Mul", [b + "g", inv], [b + "g_inv"]),
            n("Mul", [x, b + "k"], [b + "x_k"]),
            n("Sub", [b + "g_inv", b + "x_k"], [node.output[0]]),
        ]

    return _rewrite(g, expand, [numpy_helper.from_array(np.asarray([-1], np.int64), axes)])
