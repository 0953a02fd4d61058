"""Greedy decoding through any Scorer (ORT eval graph, standalone ONNX model, or PyTorch).

No KV cache: each new token re-runs the prompt. Prompts are short here, and this keeps one
code path for every backend; the rows of a batch decode together."""
from __future__ import annotations

from collections.abc import Callable

import numpy as np


def greedy_generate(last_logits: Callable[[np.ndarray, np.ndarray], np.ndarray], prompts: list[list[int]],
                    max_new_tokens: int, stop_ids: set[int], pad_id: int, batch_size: int = 16) -> list[list[int]]:
    """New token ids for each prompt (without the prompt), stopping at any of `stop_ids`."""
    out: list[list[int]] = []
    for start in range(0, len(prompts), batch_size):
        rows = [list(p) for p in prompts[start:start + batch_size]]
        new = [[] for _ in rows]
        done = [False] * len(rows)
        for _ in range(max_new_tokens):
            width = max(len(r) for r in rows)
            ids = np.full((len(rows), width), pad_id, dtype=np.int64)
            mask = np.zeros_like(ids)
            for i, r in enumerate(rows):
                ids[i, :len(r)] = r
                mask[i, :len(r)] = 1
            nxt = last_logits(ids, mask).argmax(axis=-1)
            for i, tok in enumerate(nxt.tolist()):
                if done[i]:
                    continue
                if tok in stop_ids:
                    done[i] = True
                else:
                    new[i].append(tok)
                    rows[i].append(tok)
            if all(done):
                break
        out.extend(new)
    return out
