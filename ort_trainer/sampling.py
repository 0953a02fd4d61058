"""How the next token is picked from a step's logits: greedy, or temperature / top-k / top-p with a seed. Its
defaults are held here once (the `chat` and `generate` flags read them). numpy only."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .faults import InputError


@dataclass(frozen=True)
class Sampling:
    """How the next token is picked. temperature 0: greedy (argmax). Otherwise HF's order: logits / temperature,
    keep the top_k (0: all), keep the smallest set whose probability reaches top_p (1: all), sample with `seed`."""
    max_new_tokens: int = 128
    temperature: float = 0.7
    top_k: int = 50
    top_p: float = 0.95
    seed: int = 0

    def check(self) -> None:
        if self.max_new_tokens < 1:
            raise InputError(f"--max-new-tokens {self.max_new_tokens}: use 1 or more.")
        if self.temperature < 0:
            raise InputError(f"--temperature {self.temperature}: use 0 (greedy) or more.")
        if self.top_k < 0:
            raise InputError(f"--top-k {self.top_k}: use 0 (no limit) or more.")
        if not 0 < self.top_p <= 1:
            raise InputError(f"--top-p {self.top_p}: use a value in (0, 1].")


GREEDY = Sampling(temperature=0.0)


def pick(logits: np.ndarray, sampling: Sampling, rng: np.random.Generator) -> np.ndarray:
    """[B, V] logits -> [B] token ids."""
    if sampling.temperature == 0:
        return logits.argmax(axis=-1)
    scores = logits.astype(np.float64) / sampling.temperature
    if sampling.top_k and sampling.top_k < scores.shape[-1]:
        kth = np.partition(scores, -sampling.top_k, axis=-1)[:, -sampling.top_k][:, None]
        scores = np.where(scores < kth, -np.inf, scores)
    probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    if sampling.top_p < 1:
        order = np.argsort(-probs, axis=-1, kind="stable")
        sorted_p = np.take_along_axis(probs, order, axis=-1)
        before = np.cumsum(sorted_p, axis=-1) - sorted_p          # mass of the tokens ranked above each one
        drop = np.zeros_like(probs, dtype=bool)
        np.put_along_axis(drop, order, before >= sampling.top_p, axis=-1)
        probs = np.where(drop, 0.0, probs)
        probs /= probs.sum(axis=-1, keepdims=True)
    return np.array([rng.choice(probs.shape[-1], p=row) for row in probs], dtype=np.int64)
