"""The AdamW optimizer graph, with PyTorch's semantics and global-norm clipping.

ORT's onnxblock AdamW hard-codes adam_mode=1 (HF's old AdamW: bias correction folded into the
learning rate, weight decay after the update), whose effective eps differs from
torch.optim.AdamW's. We set adam_mode=0, PyTorch's: bias correction on m and v, decoupled weight
decay before the update. Clipping is ORT's InplaceClipGradNorm, the rule of
torch.nn.utils.clip_grad_norm_. The graph depends only on these hyperparameters, not on the
parameters, so the device can rebuild it when a run asks for a different clip or eps.
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
        clip_grad=onnxblock.optim.ClipGradNorm(spec.clip) if spec.clip else None,
    )
    with onnxblock.empty_base(opset_version=17):
        block(([placeholder], []))
        model = block.to_model_proto()
    for node in model.graph.node:
        if node.op_type == "AdamWOptimizer":
            for attr in node.attribute:
                if attr.name == "adam_mode":
                    attr.i = 0
    return model


def write_adamw(path: str | Path, spec: AdamWSpec) -> None:
    onnx.save(build_adamw(spec), str(path))
