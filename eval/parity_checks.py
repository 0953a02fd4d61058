"""What parity requires of the two trainings, and the comparisons that decide it: the thresholds,
relative and per-tensor differences, and the PASS/FAIL checks the report lists.

Numbers in, numbers out (numpy only): eval.parity produces the losses, weights and evaluation matrices.
"""
from __future__ import annotations

import math

import numpy as np

THRESHOLDS = {
    "loss_max_rel": 1e-3,        # max over steps of |L_ort - L_torch| / |L_torch|
    "ppl_rel": 5e-3,             # |ppl_ort - ppl_torch| / ppl_torch of the final models (0.5 %)
    "mmlu_points": 0.5,          # |acc_ort - acc_torch| in percentage points
    "floor_ratio": 1.5,          # with a measured noise floor: max ORT-vs-PyTorch <= 1.5 x max ORT-vs-ORT ...
    "floor_min": 1e-5,           # ... or <= the per-step loss bar of lockstep (nothing amplified yet)
}


class ParityError(RuntimeError):
    pass


def rel_diffs(a, b) -> np.ndarray:
    """|a - b| / |b| elementwise (b is the PyTorch reference)."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return np.abs(a - b) / np.maximum(np.abs(b), np.finfo(np.float64).tiny)


def weight_diffs(ort_peft: dict[str, np.ndarray], torch_peft: dict[str, np.ndarray]) -> dict:
    """Per tensor (PEFT key): max |ort - torch| and that relative to max |torch| of the tensor."""
    if set(ort_peft) != set(torch_peft):
        raise ParityError(f"LoRA keys differ: only ORT {sorted(set(ort_peft) - set(torch_peft))[:3]}, "
                          f"only PyTorch {sorted(set(torch_peft) - set(ort_peft))[:3]}")
    tensors = {}
    for k in sorted(torch_peft):
        a, b = np.asarray(ort_peft[k], np.float64), np.asarray(torch_peft[k], np.float64)
        if a.shape != b.shape:
            raise ParityError(f"{k}: shape {a.shape} (ORT) != {b.shape} (PyTorch)")
        d = float(np.abs(a - b).max())
        ref = float(np.abs(b).max())
        tensors[k] = {"max_abs": d, "max_rel": d / ref if ref > 0 else (0.0 if d == 0 else math.inf),
                      "ref_max_abs": ref, "shape": list(b.shape)}
    return {"tensors": tensors,
            "max_abs": max(t["max_abs"] for t in tensors.values()),
            "max_rel": max(t["max_rel"] for t in tensors.values())}


def threshold_check(name: str, value: float | None, threshold: float, detail: str, unit: str = "") -> dict:
    """One check of the report: PASS when `value` is finite and at most `threshold`."""
    ok = value is not None and math.isfinite(value) and value <= threshold
    return {"name": name, "value": value, "threshold": threshold, "unit": unit, "pass": bool(ok),
            "status": "PASS" if ok else "FAIL", "detail": detail}


# --------------------------------------------------------------------------------------------
# The checks of one parity run
# --------------------------------------------------------------------------------------------
def loss_check(rel: np.ndarray) -> dict:
    """The loss curves: `rel` = rel_diffs(ORT losses, PyTorch losses), one per step."""
    return threshold_check("loss_curve_max_rel_diff", float(rel.max()), THRESHOLDS["loss_max_rel"],
                           f"max over {len(rel)} steps of |L_ort - L_torch| / |L_torch| (mean {float(rel.mean()):.3g})")


def floor_check(rel: np.ndarray, floor: dict) -> dict:
    """The loss curves against their noise floor: floor["rel_diff"] = ORT with another micro-batch split vs ORT,
    per step (the same math in another rounding order). Free-running curves drift apart by amplified rounding;
    ORT vs PyTorch passes when it drifts no more than 1.5x as far as ORT does from itself (or stays within the
    per-step loss bar)."""
    worst = float(np.max(floor["rel_diff"]))
    limit = max(THRESHOLDS["floor_ratio"] * worst, THRESHOLDS["floor_min"])
    return threshold_check("loss_curve_vs_noise_floor", float(rel.max()), limit,
                           f"max over {len(rel)} steps of |L_ort - L_torch| / |L_torch| (mean {float(rel.mean()):.3g}) "
                           f"against max(1.5 x the noise floor {worst:.3g}: ORT {floor['split']} vs ORT, "
                           f"{THRESHOLDS['floor_min']:g}); {float(rel.max()) / worst if worst else float('inf'):.2f}x "
                           "the floor")


def perplexity_check(block: dict) -> dict:
    """Held-out perplexity of the final models. Adds to `block` (the evaluation's perplexity, whose
    matrix is [weights][backend]) the differences that tell training from inference apart."""
    m = block["matrix"]
    p_ort, p_torch = m["ort_trained"]["ort"]["ppl"], m["torch_trained"]["torch"]["ppl"]
    d = abs(p_ort - p_torch) / p_torch
    block["final_rel_diff"] = d
    block["training_rel_diff"] = abs(m["ort_trained"]["torch"]["ppl"] - p_torch) / p_torch
    block["inference_rel_diff"] = abs(m["ort_trained"]["ort"]["ppl"] - m["ort_trained"]["torch"]["ppl"]) / \
        m["ort_trained"]["torch"]["ppl"]
    block["base_rel_diff"] = abs(m["base"]["ort"]["ppl"] - m["base"]["torch"]["ppl"]) / m["base"]["torch"]["ppl"]
    return threshold_check("final_ppl_rel_diff", d, THRESHOLDS["ppl_rel"],
                           f"held-out ppl, ORT-trained LoRA in ORT {p_ort:.6g} vs PyTorch-trained in PyTorch "
                           f"{p_torch:.6g}")


def mmlu_checks(block: dict) -> list[dict]:
    """MMLU accuracy, base and fine-tuned, ORT vs PyTorch. Adds the differences and the share of questions
    answered alike to `block` (the evaluation's MMLU, whose matrix is [weights][backend])."""
    m = block["matrix"]
    checks = []
    for label, a, b in (("base", ("base", "ort"), ("base", "torch")),
                        ("finetuned", ("ort_trained", "ort"), ("torch_trained", "torch"))):
        ra, rb = m[a[0]][a[1]], m[b[0]][b[1]]
        diff = 100 * abs(ra["micro"] - rb["micro"])
        agree = float(np.mean([x == y for x, y in zip(ra["preds"], rb["preds"])])) if ra["preds"] else float("nan")
        block[f"{label}_points_diff"] = diff
        block[f"{label}_prediction_agreement"] = agree
        checks.append(threshold_check(f"mmlu_{label}_points_diff", diff, THRESHOLDS["mmlu_points"],
                                      f"micro accuracy ORT {100 * ra['micro']:.2f}% vs PyTorch {100 * rb['micro']:.2f}% "
                                      f"({a[0]} in ORT vs {b[0]} in PyTorch; same answer on {100 * agree:.1f}% of "
                                      "questions)", unit="points"))
    return checks


def parity_checks(rel: np.ndarray, evaluation: dict, lora_dropout: float, floor: dict | None = None
                  ) -> tuple[list[dict], list[str]]:
    """(checks, notes) of a parity run: the loss curves (`rel` as for loss_check; against the noise floor when
    one was measured), then held-out perplexity and MMLU where the evaluation has them (their blocks gain their
    differences)."""
    checks = [loss_check(rel) if floor is None else floor_check(rel, floor)]
    notes = []
    if evaluation.get("perplexity"):
        checks.append(perplexity_check(evaluation["perplexity"]))
    else:
        notes.append("no --heldout file: the perplexity check was not run")
    if evaluation.get("mmlu"):
        checks += mmlu_checks(evaluation["mmlu"])
    if lora_dropout > 0:
        notes.append(f"the bundle's LoRA dropout is {lora_dropout}: the two sides draw different dropout "
                     "masks, so their loss curves cannot match step for step")
    return checks, notes
