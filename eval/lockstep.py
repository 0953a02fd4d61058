"""Lockstep parity: ORT and PyTorch + PEFT compared one optimizer step at a time, from the same state.

A free-running loss curve cannot tell a bug from float noise: training amplifies rounding, and two ORT runs that
differ only in their micro-batch split drift apart by ~2e-3 over 200 steps (eval.noise_floor). Here every step
starts both sides from the same adapter and optimizer state, so each step's differences are that step's alone:

1. PyTorch's LoRA tensors are set to ORT's current ones (the device trainer leads; nothing drifts).
2. Both run the step's micro-batches (the same ones, built as the loop builds them: eval.parity.parity_steps),
   each micro-batch's loss scaled by 1 / the step's labelled tokens. Compared: the step's loss, and its gradients
   before clipping (global relative L2 norm).
3. The update. PyTorch's AdamW (torch.optim.AdamW with transformers' scheduler and clip_grad_norm_) is given
   ORT's gradients, so its moments are built from exactly the gradients ORT's optimizer saw: both optimizers hold
   the same state, and the step's update (new weights - old) is compared. This checks the optimizer graph (clip,
   bias correction, weight decay, eps) and the learning-rate schedule, step by step.

A float64 reference (`float64_every` N > 0; `--float64-every N`): at step 1, every Nth step and every step whose
loss is over its bar or whose gradients are over 10x theirs, the same step's loss and gradients from a float64 copy
of the PyTorch model, from the same adapter, so that a gap above a bar can be read: how far each float32 side is from
the exact value (ORT's error and PyTorch's own, separately). The report then also checks ORT alone against float64
at the same bars.

Bars (issue 31): loss <= 1e-5 relative, gradient and update <= 1e-4 relative norm, at every step. The update is
read as new weights - old in float32, so one ulp of rounding per weight is allowed for (see run_lockstep); the raw
ratio is reported beside it.

    pocketlora eval parity --lockstep --bundle B --data D --out DIR [--steps 200] [training flags]

writes DIR/lockstep.json, DIR/lockstep.md and DIR/lockstep.png. Both sides run in this process (they take turns;
there is nothing to time).
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from ort_trainer.bundle import open_bundle
from ort_trainer.faults import write_atomic
from ort_trainer.schedule import lr_at

BARS = {"loss": 1e-5, "grad": 1e-4, "update": 1e-4}
WHAT = {"loss": "step loss, |L_ort - L_torch| / |L_torch|",
        "grad": "gradients before clipping, ‖g_ort - g_torch‖ / ‖g_torch‖ over all LoRA tensors",
        "update": "AdamW update from the same state, ‖u_ort - u_torch‖ / ‖u_torch‖ beyond one float32 ulp of "
                  "the new weights"}


def rel_norm(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    """||a - b|| / ||b|| over all tensors (float64); 0 when both are zero."""
    num = sum(float(np.sum((np.asarray(a[k], np.float64) - np.asarray(b[k], np.float64)) ** 2)) for k in b)
    den = sum(float(np.sum(np.asarray(b[k], np.float64) ** 2)) for k in b)
    if den == 0:
        return 0.0 if num == 0 else float("inf")
    return float(np.sqrt(num / den))


def _torch_side(bundle, cfg, steps_total: int):
    """The PEFT model at the bundle's initial adapter, its trainable parameters by PEFT key, its AdamW, its
    scheduler."""
    import torch
    from transformers import get_scheduler

    from ort_trainer.adapter import initial_lora, to_peft

    from .reference import TrainConfig
    from .reference_model import torch_lora_model

    man = bundle.manifest
    model = torch_lora_model(bundle, to_peft(man, initial_lora(bundle)))
    params = {name.replace(".default.", "."): p for name, p in model.named_parameters() if p.requires_grad}
    expected = {t.peft_key for t in man.trainable}
    if set(params) != expected:
        raise RuntimeError(f"PEFT's trainable parameters are not the bundle's LoRA tensors: only PEFT "
                           f"{sorted(set(params) - expected)[:3]}, only the bundle {sorted(expected - set(params))[:3]}")
    opt = man.optimizer
    tc = TrainConfig(**asdict(cfg.train_settings()), betas=(float(opt["beta1"]), float(opt["beta2"])),
                     eps=float(opt["eps"]), total_steps=steps_total)
    optimizer = torch.optim.AdamW(list(params.values()), lr=cfg.lr, betas=tc.betas, eps=tc.eps,
                                  weight_decay=cfg.weight_decay)
    scheduler = get_scheduler(tc.scheduler_name(), optimizer, num_warmup_steps=cfg.warmup,
                              num_training_steps=steps_total)
    return model, params, optimizer, scheduler


def _torch_step(model, params: dict, before: dict, micro: list[dict], n: int) -> tuple[float, dict]:
    """PyTorch's loss and gradients of one step from the adapter `before` (in the model's own dtype)."""
    import torch

    from ort_trainer.records import loss_token_count

    from .reference import shifted_nll_sum

    with torch.no_grad():
        for k, p in params.items():
            p.copy_(torch.from_numpy(before[k]).to(p.dtype))
            p.grad = None
    loss = 0.0
    for mb in micro:
        if loss_token_count(mb["labels"]):
            nll, _ = shifted_nll_sum(model, mb)
            (nll / n).backward()
            loss += float(nll.detach()) / n
    return loss, {k: p.grad.detach().numpy().copy() for k, p in params.items()}


def run_lockstep(cfg, log=print, float64_every: int = 0) -> dict:
    """cfg: an eval.parity.ParityConfig (bundle, data, out, steps, the training settings, threads).
    float64_every: N > 0 adds the float64 reference at step 1 and every Nth step (see the module's doc)."""
    import copy
    import torch

    from ort_trainer.adapter import to_peft
    from ort_trainer.optimizer_graph import AdamWSpec
    from ort_trainer.records import loss_token_count
    from ort_trainer.session import RuntimeOptions, TrainSession

    from .parity import parity_steps

    cfg.validate()
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    bundle = open_bundle(cfg.bundle, verify="sizes")
    man = bundle.manifest
    if man.lora.dropout > 0:
        raise ValueError(f"the bundle's LoRA dropout is {man.lora.dropout}: the two sides would draw different masks; "
                         "lockstep needs a bundle built with --lora-dropout 0")
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    steps = parity_steps(bundle, cfg.data, cfg.steps, cfg)
    adamw = AdamWSpec(**{**man.optimizer, "clip": cfg.clip, "weight_decay": cfg.weight_decay})
    session = TrainSession(bundle, adamw=adamw, options=RuntimeOptions(threads=cfg.threads), work_dir=out)
    model, params, optimizer, scheduler = _torch_side(bundle, cfg, cfg.steps)
    peft = lambda lora: to_peft(man, lora)  # noqa: E731   ORT names and layout -> PEFT keys and layout
    if float64_every:
        model64 = copy.deepcopy(model).double()
        params64 = {name.replace(".default.", "."): p for name, p in model64.named_parameters() if p.requires_grad}
    rows = []
    t0 = time.perf_counter()
    for s, micro in enumerate(steps):
        n = sum(loss_token_count(mb["labels"]) for mb in micro)
        before = peft(session.lora())
        # ORT: the device trainer's step, split open to read its gradients
        lr = lr_at(s, cfg.lr, cfg.warmup, cfg.steps, cfg.schedule)
        loss_ort = sum(session.forward_backward(mb, 1.0 / n) for mb in micro if loss_token_count(mb["labels"]))
        grad_ort = peft({k: v.copy() for k, v in session.grads().items()})
        session.step(lr)
        update_ort = {k: v - before[k] for k, v in peft(session.lora()).items()}
        # PyTorch from the same adapter
        loss_torch, grad_torch = _torch_step(model, params, before, micro, n)
        # PyTorch's AdamW on ORT's gradients: the same optimizer state as ORT's
        for k, p in params.items():
            p.grad = torch.from_numpy(grad_ort[k].copy())         # a copy: clipping scales it in place
        if cfg.clip:
            torch.nn.utils.clip_grad_norm_(list(params.values()), cfg.clip)
        lr_torch = float(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
        after = {k: p.detach().numpy().copy() for k, p in params.items()}
        update_torch = {k: v - before[k] for k, v in after.items()}
        update_raw = rel_norm(update_ort, update_torch)
        # An update is read as new weights - old, in float32: each side's new weight is rounded to its nearest
        # float, so the two reads may differ by up to one ulp per weight whatever the optimizers did (late in a
        # cosine schedule the update is ~1e-5 of the weight and an ulp is ~1e-7 of it). The check counts only
        # what exceeds that: (||u_ort - u_torch|| - ||ulp(new weights)||)+ / ||u_torch||.
        ulp = np.sqrt(sum(float(np.sum(np.spacing(np.abs(v)).astype(np.float64) ** 2)) for v in after.values()))
        u_norm = np.sqrt(sum(float(np.sum(v.astype(np.float64) ** 2)) for v in update_torch.values()))
        row = {"step": s + 1, "loss_ort": loss_ort, "loss_torch": loss_torch, "lr_ort": lr, "lr_torch": lr_torch,
               "loss": abs(loss_ort - loss_torch) / abs(loss_torch), "grad": rel_norm(grad_ort, grad_torch),
               "update": max(0.0, update_raw - ulp / u_norm) if u_norm else update_raw, "update_raw": update_raw,
               "grad_norm": float(np.sqrt(sum(float(np.sum(g.astype(np.float64) ** 2)) for g in grad_torch.values())))}
        outlier = row["loss"] > BARS["loss"] or row["grad"] > 10 * BARS["grad"]
        if float64_every and (s == 0 or (s + 1) % float64_every == 0 or outlier):
            loss64, grad64 = _torch_step(model64, params64, before, micro, n)
            row.update(loss_ort_f64=abs(loss_ort - loss64) / abs(loss64),
                       loss_torch_f64=abs(loss_torch - loss64) / abs(loss64),
                       grad_ort_f64=rel_norm(grad_ort, grad64), grad_torch_f64=rel_norm(grad_torch, grad64))
            log(f"step {s + 1}: from float64, loss ORT {row['loss_ort_f64']:.2e} PyTorch {row['loss_torch_f64']:.2e}, "
                f"grad ORT {row['grad_ort_f64']:.2e} PyTorch {row['grad_torch_f64']:.2e}")
        rows.append(row)
        if s == 0 or (s + 1) % 10 == 0 or s + 1 == len(steps):
            log(f"step {s + 1}/{len(steps)}: loss {loss_ort:.6f}, rel diff loss {row['loss']:.2e}, "
                f"grad {row['grad']:.2e}, update {row['update']:.2e}")
    result = summarize(rows)
    result.update(bundle=str(cfg.bundle), data=str(cfg.data), settings=asdict(cfg.train_settings()),
                  model=man.model.source, family=man.family, quant=man.quant.mode,
                  seconds=round(time.perf_counter() - t0, 1), threads=cfg.threads, rows=rows)
    write_atomic(out / "lockstep.json", json.dumps(result, indent=1) + "\n")
    plot(result, out / "lockstep.png")
    write_atomic(out / "lockstep.md", render(result))
    return result


def summarize(rows: list[dict]) -> dict:
    checks = []
    for key, bar in BARS.items():
        values = np.array([r[key] for r in rows], dtype=np.float64)
        worst = int(np.argmax(values))
        checks.append({"name": key, "what": WHAT[key], "bar": bar, "max": float(values.max()),
                       "median": float(np.median(values)), "worst_step": rows[worst]["step"],
                       "over": int((values > bar).sum()), "pass": bool(values.max() <= bar)})
    lr_gap = max(abs(r["lr_ort"] - r["lr_torch"]) for r in rows)
    result = {"steps": len(rows), "checks": checks, "max_lr_diff": lr_gap,
              "update_raw_max": max(r["update_raw"] for r in rows),
              "pass": all(c["pass"] for c in checks) and lr_gap <= 1e-12}
    f64 = [r for r in rows if "grad_ort_f64" in r]
    if f64:     # ORT alone against the exact value, at the same bars
        worst = {k: max(r[f"{k}_ort_f64"] for r in f64) for k in ("loss", "grad")}
        result["float64"] = {"steps": len(f64), **{f"{k}_ort_max": v for k, v in worst.items()},
                             **{f"{k}_torch_max": max(r[f"{k}_torch_f64"] for r in f64) for k in ("loss", "grad")},
                             "pass": all(worst[k] <= BARS[k] for k in worst)}
    return result


def plot(result: dict, path: Path) -> Path:
    from .report import _plt, save_line_plot

    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 3.8))
    steps = [r["step"] for r in result["rows"]]
    for key, style in (("loss", "-"), ("grad", "--"), ("update", ":")):
        ax.semilogy(steps, np.maximum([r[key] for r in result["rows"]], 1e-12), style, lw=1.2,
                    label=f"{key} (bar {BARS[key]:g})")
    return save_line_plot(plt, fig, ax, path, "ORT vs PyTorch, each step from the same state", "relative difference",
                          grid_which="both")


def render(result: dict) -> str:
    s = result["settings"]
    lines = [f"# Lockstep parity: {result['model']} ({result['family']}, quant {result['quant']})", "",
             f"{result['steps']} optimizer steps of {s['micro_batch']} x {s['accum']} sequences, lr {s['lr']}, "
             f"warmup {s['warmup']}, {s['schedule']}, clip {s['clip']}, weight decay {s['weight_decay']}; data "
             f"`{result['data']}`; {result['seconds']} s for both sides. Each step starts PyTorch from ORT's "
             "adapter; PyTorch's AdamW steps on ORT's gradients, so both optimizers hold the same state "
             "(eval/lockstep.py).", "",
             "| compared | bar | max | median | worst step | steps over the bar | |", "|---|---:|---:|---:|---:|---:|---|"]
    for c in result["checks"]:
        lines.append(f"| {c['what'].replace('|', chr(92) + '|')} | {c['bar']:g} | {c['max']:.2e} | {c['median']:.2e} | {c['worst_step']} | "
                     f"{c['over']} | {'PASS' if c['pass'] else 'FAIL'} |")
    lines += ["", f"The update's raw ratio, rounding included: largest {result['update_raw_max']:.2e}.",
              "", f"Learning rates (ORT's schedule vs transformers'): largest difference {result['max_lr_diff']:.1e}.",
              "", f"**{'PASS' if result['pass'] else 'FAIL'}**", "", "![per-step differences](lockstep.png)", ""]
    f64 = [r for r in result["rows"] if "grad_ort_f64" in r]
    if f64:
        lines += ["## Each side against float64", "",
                  "The same step from the same adapter in a float64 copy of the PyTorch model: how far each float32 "
                  "side is from the exact value.", "",
                  "| step | loss: ORT | loss: PyTorch fp32 | gradients: ORT | gradients: PyTorch fp32 "
                  "| ORT vs PyTorch |",
                  "|---:|---:|---:|---:|---:|---:|"]
        lines += [f"| {r['step']} | {r['loss_ort_f64']:.2e} | {r['loss_torch_f64']:.2e} | {r['grad_ort_f64']:.2e} | "
                  f"{r['grad_torch_f64']:.2e} | {r['grad']:.2e} |" for r in f64]
        x = result["float64"]
        lines += ["", f"ORT against float64 at these {x['steps']} steps: loss {x['loss_ort_max']:.2e} (bar "
                  f"{BARS['loss']:g}), gradients {x['grad_ort_max']:.2e} (bar {BARS['grad']:g}): "
                  f"**{'PASS' if x['pass'] else 'FAIL'}**; PyTorch float32 against float64: loss "
                  f"{x['loss_torch_max']:.2e}, gradients {x['grad_torch_max']:.2e}.", ""]
    return "\n".join(lines)


def print_lockstep(result: dict, out) -> None:
    for c in result["checks"]:
        print(f"{'PASS' if c['pass'] else 'FAIL'}  {c['name']}: max {c['max']:.2e}, median {c['median']:.2e} "
              f"(bar {c['bar']:g}; worst at step {c['worst_step']})")
    if "float64" in result:
        x = result["float64"]
        print(f"{'PASS' if x['pass'] else 'FAIL'}  ORT against float64 at {x['steps']} steps: loss "
              f"{x['loss_ort_max']:.2e}, grad {x['grad_ort_max']:.2e} (PyTorch float32: {x['loss_torch_max']:.2e}, "
              f"{x['grad_torch_max']:.2e})")
    print(f"lockstep {'PASS' if result['pass'] else 'FAIL'} over {result['steps']} steps; report in {out}/lockstep.md")
