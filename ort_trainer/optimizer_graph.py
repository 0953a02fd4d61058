"""The AdamW optimizer graph, with PyTorch's semantics and global-norm clipping.

ORT's onnxblock AdamW hard-codes adam_mode=1 (HF's old AdamW: bias correction folded into the
learning rate, weight decay after the update), whose effective eps differs from
torch.optim.AdamW's. We set adam_mode=0, PyTorch's: bias correction on m and v, decoupled weight
decay before the update. The graph depends only on these hyperparameters, not on the
parameters, so the device can rebuild it when a run asks for a different clip or eps.

Clipping is torch.nn.utils.clip_grad_norm_'s rule, g *= min(max_norm / (||g|| + 1e-6), 1), built here
rather than with ORT's InplaceClipGradNorm. That kernel adds the tensors' sums of squares in the order of
the parameter sequence, which ORT builds by iterating an unordered map of the parameters
(orttraining/training_api/optimizer.cc, Optimizer::ConstructInputs), and that order changed from process to
process here: the same step from the same state gave clip coefficients
0.28642457 or 0.28642455 (Gemma3-270M, 144 LoRA tensors), and a resumed run (a new process) was not
bitwise the run it continues. Here the per-tensor sums are sorted (TopK, ascending) before they are
added, so the norm does not depend on the order.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import onnx


@dataclass(frozen=True)
class AdamWSpec:
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8              # torch's default; ORT's onnxblock default is 1e-6
    weight_decay: float = 0.0
    clip: float | None = 1.0       # max global L2 norm of the gradients; None: no clipping

    def to_dict(self) -> dict:
        return asdict(self)


def build_adamw(spec: AdamWSpec) -> onnx.ModelProto:
    from .ort_training import onnxblock as _onnxblock

    onnxblock = _onnxblock()

    placeholder = onnx.helper.make_tensor("p", onnx.TensorProto.FLOAT, [1], [0.0])
    block = onnxblock.optim.AdamW(
        betas=(spec.beta1, spec.beta2),
        eps=spec.eps,
        weight_decay=spec.weight_decay,
        clip_grad=None,
    )
    with onnxblock.empty_base(opset_version=17):
        block(([placeholder], []))
        model = block.to_model_proto()
    for node in model.graph.node:
        if node.op_type == "AdamWOptimizer":
            for attr in node.attribute:
                if attr.name == "adam_mode":
                    attr.i = 0
    if spec.clip:
        _clip_in_front(model, spec.clip)
    return model


def _clip_in_front(model: onnx.ModelProto, max_norm: float) -> None:
    """Clip the gradient sequence by its global norm, summed in an order that does not depend on the sequence's."""
    h, T = onnx.helper, onnx.TensorProto
    adam = next(n for n in model.graph.node if n.op_type == "AdamWOptimizer")
    grads = adam.input[3]
    sum_squares = h.make_graph(
        [h.make_node("ReduceSumSquare", ["g"], ["s"], keepdims=0), h.make_node("Reshape", ["s", "one"], ["s1"])],
        "sum_squares", [h.make_tensor_value_info("g", T.FLOAT, None)], [h.make_tensor_value_info("s1", T.FLOAT, [1])],
        initializer=[h.make_tensor("one", T.INT64, [1], [1])])
    scale = h.make_graph([h.make_node("Mul", ["g", "c"], ["y"])], "scale",
                         [h.make_tensor_value_info("g", T.FLOAT, None), h.make_tensor_value_info("c", T.FLOAT, [])],
                         [h.make_tensor_value_info("y", T.FLOAT, None)])
    nodes = [
        h.make_node("SequenceMap", [grads], ["clip.sums"], body=sum_squares),
        h.make_node("ConcatFromSequence", ["clip.sums"], ["clip.sums_vec"], axis=0),
        h.make_node("SequenceLength", [grads], ["clip.n0"]),
        h.make_node("Reshape", ["clip.n0", "clip.one"], ["clip.n"]),
        h.make_node("TopK", ["clip.sums_vec", "clip.n"], ["clip.sorted", "clip.order"], largest=0, sorted=1),
        h.make_node("ReduceSum", ["clip.sorted"], ["clip.total"], keepdims=0),
        h.make_node("Sqrt", ["clip.total"], ["clip.norm"]),
        h.make_node("Add", ["clip.norm", "clip.eps"], ["clip.den"]),
        h.make_node("Div", ["clip.max_norm", "clip.den"], ["clip.ratio"]),
        h.make_node("Min", ["clip.ratio", "clip.unit"], ["clip.coef"]),
        h.make_node("SequenceMap", [grads, "clip.coef"], ["clip.gradients"], body=scale),
    ]
    model.graph.initializer.extend([
        h.make_tensor("clip.one", T.INT64, [1], [1]), h.make_tensor("clip.eps", T.FLOAT, [], [1e-6]),
        h.make_tensor("clip.max_norm", T.FLOAT, [], [max_norm]), h.make_tensor("clip.unit", T.FLOAT, [], [1.0])])
    adam.input[3] = "clip.gradients"
    at = list(model.graph.node).index(adam)
    for k, node in enumerate(nodes):
        model.graph.node.insert(at + k, node)


def is_order_dependent(path: str | Path) -> bool:
    """An optimizer graph of a bundle built before 2026-12-06: ORT's InplaceClipGradNorm (see the module's doc)."""
    return any(n.op_type == "InplaceClipGradNorm" for n in onnx.load(str(path)).graph.node)


def write_adamw(path: str | Path, spec: AdamWSpec) -> None:
    onnx.save(build_adamw(spec), str(path))
