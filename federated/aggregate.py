"""Aggregation rules for LoRA adapters, plain numpy. Tensors are keyed by their ONNX names (the manifest's
`trainable`); weights are what each device's update counts for (run.py: the label tokens it trained on this
round, or the examples it holds). Sums run in float64 and the result is float32, the tensors' own dtype.

A LoRA module adds B·A (PEFT layout: A [r, in], B [out, r]) to a frozen weight.
"""
from __future__ import annotations

import numpy as np

from ort_trainer.manifest import Manifest

STRATEGIES = ("fedavg", "ffa")
WEIGHTS = ("tokens", "examples")


def lora_pairs(manifest: Manifest) -> list[tuple[str, str]]:
    """(A's ONNX name, B's ONNX name) of every adapted module."""
    by_key = {t.peft_key: t.onnx_name for t in manifest.trainable}
    pairs = []
    for key, name in by_key.items():
        if ".lora_A." in key:
            b = key.replace(".lora_A.", ".lora_B.")
            if b not in by_key:
                raise ValueError(f"{key}: no matching lora_B tensor in the manifest")
            pairs.append((name, by_key[b]))
    if len(pairs) * 2 != len(by_key):
        raise ValueError("the manifest's trainable tensors are not LoRA A/B pairs")
    return pairs


def a_names(manifest: Manifest) -> list[str]:
    return [a for a, _ in lora_pairs(manifest)]


def b_names(manifest: Manifest) -> list[str]:
    return [b for _, b in lora_pairs(manifest)]


def weighted_mean(tensors: list[np.ndarray], weights: list[float]) -> np.ndarray:
    w = np.asarray(weights, dtype=np.float64)
    if len(tensors) != len(w) or not len(w):
        raise ValueError("weighted_mean: one weight per tensor, at least one tensor")
    if np.any(w < 0) or w.sum() <= 0:
        raise ValueError(f"weighted_mean: weights must be >= 0 with a positive sum, got {weights}")
    acc = np.zeros(tensors[0].shape, dtype=np.float64)
    for t, wi in zip(tensors, w):
        acc += wi * np.asarray(t, dtype=np.float64)
    return (acc / w.sum()).astype(np.float32)


def fedavg(updates: list[dict[str, np.ndarray]], weights: list[float], names: list[str]) -> dict[str, np.ndarray]:
    """Average A and B separately: the new adapter is avg(B)·avg(A), which is not avg(B·A), the average of the
    devices' adapters (the cross terms B_i·A_j, i != j, come in), so FedAvg on LoRA is inexact when devices differ."""
    return {n: weighted_mean([u[n] for u in updates], weights) for n in names}


def ffa(updates: list[dict[str, np.ndarray]], weights: list[float], frozen_a: dict[str, np.ndarray],
        b: list[str]) -> dict[str, np.ndarray]:
    """FFA-LoRA: A stays at its shared initialization on every device (frozen), only B is trained and averaged;
    then avg(B)·A = avg(B·A) exactly. Devices send only B."""
    out = {n: np.asarray(v, dtype=np.float32).copy() for n, v in frozen_a.items()}
    out.update({n: weighted_mean([u[n] for u in updates], weights) for n in b})
    return out


def _peft(manifest: Manifest, name: str, value: np.ndarray) -> np.ndarray:
    t = next(t for t in manifest.trainable if t.onnx_name == name)
    return value.T if t.transposed else value


def product_gap(manifest: Manifest, updates: list[dict[str, np.ndarray]], weights: list[float],
                merged: dict[str, np.ndarray]) -> float:
    """How far the merged adapter's B·A is from the weighted average of the devices' B_i·A_i, relative, over all
    modules: ||merged - avg|| / ||avg|| (Frobenius). 0 for FFA-LoRA; > 0 for FedAvg once devices differ."""
    w = np.asarray(weights, dtype=np.float64) / float(np.sum(weights))
    num = den = 0.0
    for a, b in lora_pairs(manifest):
        avg = sum(wi * (_peft(manifest, b, u[b]).astype(np.float64) @ _peft(manifest, a, u[a]).astype(np.float64))
                  for wi, u in zip(w, updates))
        got = _peft(manifest, b, merged[b]).astype(np.float64) @ _peft(manifest, a, merged[a]).astype(np.float64)
        num += float(np.sum((got - avg) ** 2))
        den += float(np.sum(avg ** 2))
    return float(np.sqrt(num / den)) if den > 0 else 0.0
