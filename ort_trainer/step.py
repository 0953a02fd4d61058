"""One optimizer step: `accum` micro-batches, then clip + AdamW.

ORT sums gradients across forward/backward calls. Each micro-batch's loss is scaled by
1/N, N being the labelled tokens of the whole effective batch, so the summed gradient is
exactly the gradient of the mean loss over the effective batch, however the real tokens are
split between micro-batches (HF's num_items_in_batch semantics)."""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from .records import loss_token_count
from .session import TrainSession


@dataclass
class StepResult:
    loss: float          # mean NLL over the effective batch's labelled tokens
    grad_norm: float     # global L2 norm before clipping
    tokens: int          # real (attention_mask) tokens processed
    label_tokens: int    # tokens that carried loss
    seconds: float


def train_step(session: TrainSession, micro_batches: list[dict[str, np.ndarray]], lr: float,
               should_stop=lambda: False) -> StepResult | None:
    """Returns None, with the accumulated gradients dropped, if `should_stop()` turns true between
    micro-batches (a signal): the caller then checkpoints the last completed step."""
    t0 = time.perf_counter()
    n = sum(loss_token_count(mb["labels"]) for mb in micro_batches)
    if n == 0:
        raise ValueError("an optimizer step with no labelled tokens; the data loader should have dropped these examples")
    loss = 0.0
    for mb in micro_batches:
        if loss_token_count(mb["labels"]) == 0:
            continue
        loss += session.forward_backward(mb, 1.0 / n)
        if should_stop():
            session.drop_grads()
            return None
    grad_norm = session.grad_norm()
    session.step(lr)
    tokens = int(sum(int(mb["attention_mask"].sum()) for mb in micro_batches))
    return StepResult(loss, grad_norm, tokens, n, time.perf_counter() - t0)
