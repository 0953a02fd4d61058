"""The independent PyTorch + PEFT reference trainer (never touches ONNX Runtime).

It defines what the device trainer must reproduce: for one optimizer step made of several
micro-batches, loss = mean shifted NLL over *all* labelled tokens of the step (each micro-batch
contributes sum_nll / N_step, gradients accumulate), then clip_grad_norm_ over the trainable
parameters, torch.optim.AdamW, and a transformers scheduler step. The base model runs in eval()
mode (base-model dropout disabled, as the product defines it); LoRA dropout follows its config.
"""
from __future__ import annotations

import math
import resource
import sys
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from ort_trainer.settings import TrainSettings

IGNORE_INDEX = -100
SCHEDULES = {"cosine": "cosine", "linear": "linear", "constant": "constant_with_warmup"}

# progress(step, total_steps, loss): called after each optimizer step (step counts from 1).
TrainProgress = Callable[[int, int, float], None]


@dataclass(kw_only=True)
class TrainConfig(TrainSettings):
    """The training settings, plus what the reference needs besides the batches it is handed
    (micro_batch, accum, seed and group_by_length shaped those batches; they are not read here)."""
    total_steps: int
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8

    def scheduler_name(self) -> str:
        try:
            return SCHEDULES[self.schedule]
        except KeyError:
            raise ValueError(f"schedule must be one of {sorted(SCHEDULES)}, got {self.schedule!r}") from None


@dataclass
class ReferenceRun:
    losses: list[float]               # per optimizer step: mean NLL over all labelled tokens of the step
    grad_norms: list[float]           # per step: total L2 norm of trainable grads before clipping
    lrs: list[float]                  # per step: the LR the optimizer used for that step
    lora_state: dict[str, np.ndarray]  # PEFT keys (get_peft_model_state_dict) -> float arrays, after training
    seconds: float                    # wall time of the training loop
    tokens: int                       # labelled (scored) tokens trained on, over all steps
    peak_rss_mb: float                # process peak resident set size (ru_maxrss), MiB


# --------------------------------------------------------------------------------------------
# PEFT helpers
# --------------------------------------------------------------------------------------------
def make_peft_model(base_model, r: int, alpha: float, dropout: float, target_modules: Sequence[str] | str,
                    fan_in_fan_out: bool = False):
    """peft.get_peft_model(base_model, LoraConfig(...)) for causal-LM LoRA (bias="none")."""
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(
        r=r, lora_alpha=alpha, lora_dropout=dropout,
        target_modules=list(target_modules) if not isinstance(target_modules, str) else target_modules,
        fan_in_fan_out=fan_in_fan_out, bias="none", task_type="CAUSAL_LM",
    )
    return get_peft_model(base_model, cfg)


def get_lora_state(peft_model) -> dict[str, np.ndarray]:
    """The adapter's state dict (PEFT keys) as numpy copies."""
    from peft import get_peft_model_state_dict

    out = {}
    for k, v in get_peft_model_state_dict(peft_model).items():
        t = v.detach().cpu()
        out[k] = (t.float() if t.dtype == torch.bfloat16 else t).numpy().copy()
    return out


def set_lora_state(peft_model, state: dict[str, np.ndarray]) -> None:
    """Load LoRA weights by PEFT key. Strict: the keys must be exactly the adapter's keys, shapes must match."""
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    current = get_peft_model_state_dict(peft_model)
    unknown = sorted(set(state) - set(current))
    missing = sorted(set(current) - set(state))
    if unknown or missing:
        raise KeyError(f"LoRA state does not match the adapter: unknown keys {unknown[:5]}"
                       f"{'...' if len(unknown) > 5 else ''}, missing keys {missing[:5]}{'...' if len(missing) > 5 else ''}")
    tensors = {}
    for k, v in state.items():
        arr = np.asarray(v)
        if tuple(arr.shape) != tuple(current[k].shape):
            raise ValueError(f"{k}: shape {tuple(arr.shape)} != adapter's {tuple(current[k].shape)}")
        tensors[k] = torch.from_numpy(np.ascontiguousarray(arr)).to(current[k].dtype)
    result = set_peft_model_state_dict(peft_model, tensors)
    unexpected = list(getattr(result, "unexpected_keys", []) or [])
    if unexpected:
        raise KeyError(f"PEFT did not place these LoRA keys: {unexpected[:5]}")
    after = get_peft_model_state_dict(peft_model)
    for k, t in tensors.items():
        if not torch.equal(after[k].detach().cpu(), t.cpu()):
            raise RuntimeError(f"{k}: value did not load")


def lora_dropout_modules(peft_model) -> list[torch.nn.Module]:
    """The nn.Dropout modules PEFT inserted on the LoRA path (empty if lora_dropout == 0)."""
    from peft.tuners.lora import LoraLayer

    out = []
    for m in peft_model.modules():
        if isinstance(m, LoraLayer):
            for d in m.lora_dropout.values():
                if isinstance(d, torch.nn.Dropout):
                    out.append(d)
    return out


# --------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------
def shifted_nll_sum(model, batch: dict[str, np.ndarray]) -> tuple[torch.Tensor, int]:
    """(sum of shifted NLL over labelled tokens as a graph-attached tensor, their count)."""
    dev = next(model.parameters()).device
    ids = torch.from_numpy(np.ascontiguousarray(batch["input_ids"], dtype=np.int64)).to(dev)
    mask = torch.from_numpy(np.ascontiguousarray(batch["attention_mask"], dtype=np.int64)).to(dev)
    labels = torch.from_numpy(np.ascontiguousarray(batch["labels"], dtype=np.int64)).to(dev)
    if ids.ndim != 2 or mask.shape != ids.shape or labels.shape != ids.shape:
        raise ValueError("input_ids, attention_mask and labels must all be [B, S]")
    logits = model(input_ids=ids, attention_mask=mask).logits
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))    # half -> float32; float64 stays
    shift_labels = labels[:, 1:].reshape(-1)
    nll = F.cross_entropy(logits[:, :-1, :].reshape(-1, logits.shape[-1]), shift_labels,
                          reduction="sum", ignore_index=IGNORE_INDEX)
    return nll, int((shift_labels != IGNORE_INDEX).sum())


def count_labelled(batch: dict[str, np.ndarray]) -> int:
    return int((np.asarray(batch["labels"])[:, 1:] != IGNORE_INDEX).sum())


def peak_rss_mb() -> float:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024   # bytes on macOS, KiB on Linux


def reference_train(peft_model, steps: Iterable[list[dict[str, np.ndarray]]], cfg: TrainConfig,
                    progress: TrainProgress | None = None) -> ReferenceRun:
    """Train the LoRA parameters of `peft_model` in place; see the module docstring for the exact semantics."""
    from transformers import get_scheduler

    if cfg.total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {cfg.total_steps}")
    params = [p for p in peft_model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the model has no trainable parameters")
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps,
                                  weight_decay=cfg.weight_decay)
    scheduler = get_scheduler(cfg.scheduler_name(), optimizer, num_warmup_steps=cfg.warmup,
                              num_training_steps=cfg.total_steps)

    modes = [(m, m.training) for m in peft_model.modules()]
    peft_model.eval()                                  # base-model dropouts off
    for d in lora_dropout_modules(peft_model):
        d.train(d.p > 0)                               # LoRA dropout follows its config

    losses: list[float] = []
    grad_norms: list[float] = []
    lrs: list[float] = []
    tokens = 0
    optimizer.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    try:
        for step_idx, micro_batches in enumerate(steps):
            if step_idx >= cfg.total_steps:
                raise ValueError(f"more steps than cfg.total_steps={cfg.total_steps}")
            micro_batches = list(micro_batches)
            if not micro_batches:
                raise ValueError(f"step {step_idx}: no micro-batches")
            n_step = sum(count_labelled(b) for b in micro_batches)
            if n_step == 0:
                raise ValueError(f"step {step_idx}: no labelled tokens")
            total = 0.0
            for b in micro_batches:
                nll, _ = shifted_nll_sum(peft_model, b)
                loss = nll / n_step
                loss.backward()
                total += float(loss.detach())
            if cfg.clip is not None:
                norm = torch.nn.utils.clip_grad_norm_(params, cfg.clip)
            else:
                norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
            lrs.append(float(optimizer.param_groups[0]["lr"]))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(total)
            grad_norms.append(float(norm))
            tokens += n_step
            if progress is not None:
                progress(step_idx + 1, cfg.total_steps, total)
            if not math.isfinite(total):
                raise FloatingPointError(f"step {step_idx}: non-finite loss {total}")
        seconds = time.perf_counter() - t0
    finally:
        for m, training in modes:
            m.training = training
    return ReferenceRun(losses=losses, grad_norms=grad_norms, lrs=lrs, lora_state=get_lora_state(peft_model),
                        seconds=seconds, tokens=tokens, peak_rss_mb=peak_rss_mb())
