"""Greedy one-line answers to chat questions from a bundle's KV-cache decoder, and exact match against the
expected answers: the demo's held-out score, and each federated device's. Device-side: no torch."""
from __future__ import annotations

import re


def normalize(text: str) -> str:
    return re.sub(r"[^a-z0-9. ]", "", text.lower().replace(",", "")).strip(" .")


def stop_ids(tok) -> set[int]:
    """The end of the assistant's turn, or of its first line: the answers are one line."""
    from ort_trainer.tokenizer import turn_end_ids

    return turn_end_ids(tok) | set(tok.encode("\n", add_special_tokens=False)[-1:])


def prompts(tok, questions: list[str]) -> list[list[int]]:
    from ort_trainer.tokenizer import generation_prompt_ids

    return [generation_prompt_ids(tok, [{"role": "user", "content": q}]) for q in questions]


def answers(decoder, tok, questions: list[str], max_new: int, batch: int = 16) -> list[str]:
    """Greedy answers from the bundle's KV-cache decoder with its current adapter."""
    from ort_trainer.decoder import generate
    from ort_trainer.sampling import Sampling

    ps, out = prompts(tok, questions), []
    for start in range(0, len(ps), batch):
        out += generate(decoder, ps[start:start + batch], Sampling(max_new_tokens=max_new, temperature=0),
                        stop_ids(tok), tok.pad_id if tok.pad_id is not None else 0)
    return [tok.decode(g.token_ids, skip_special_tokens=True).strip() for g in out]


def exact(answer: str, expected: str) -> bool:
    return normalize(answer) == normalize(expected)
