"""Learning-rate schedules with linear warmup, the same curves as transformers.get_scheduler
("cosine", "linear", "constant_with_warmup"), written out so the device needs no transformers.
`lr_at(s)` is the rate used by optimizer step s (0-based), as LambdaLR gives it."""
from __future__ import annotations

import math

SCHEDULES = ("cosine", "linear", "constant")


def lr_factor(step: int, warmup: int, total: int, schedule: str) -> float:
    if schedule not in SCHEDULES:
        raise ValueError(f"--schedule {schedule!r}: use one of {', '.join(SCHEDULES)}")
    if step < warmup:
        return step / max(1, warmup)
    if schedule == "constant":
        return 1.0
    progress = (step - warmup) / max(1, total - warmup)
    if schedule == "linear":
        return max(0.0, 1.0 - progress)
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))


def lr_at(step: int, base_lr: float, warmup: int, total: int, schedule: str) -> float:
    return base_lr * lr_factor(step, warmup, total, schedule)
