"""What scoring is fed: a text file's token stream, MMLU prompts and answer letters, and the perplexity
and prompt settings a bundle allows. Used by `pocketlora eval ppl|mmlu` (eval.verbs), parity and the demo.

Text and prompts are tokenized with the bundle's tokenizer, exactly as training tokenizes them.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ort_trainer.bundle import Bundle
from ort_trainer.tokenizer import DataError, TextTokenizer, tokenize_text

from .scoring import LETTERS

DEFAULT_STRIDE = 128
MMLU_MAX_LEN = 2048        # prompt budget (tokens) unless the model allows fewer


# --------------------------------------------------------------------------------------------
# Tokenization (the same as ort_trainer.tokenizer's text path)
# --------------------------------------------------------------------------------------------
def text_token_ids(path: str | Path, tok: TextTokenizer, max_tokens: int | None = None) -> np.ndarray:
    """The file's token stream as training sees it: the body tokenized without special tokens
    (ort_trainer.tokenizer's chunked tokenization, equal to tokenizing the whole file at once), the
    tokenizer's special prefix (its BOS, if it adds one) once at the start. Optionally cut to the
    first `max_tokens` tokens."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"{p}: file not found")
    try:
        text = p.read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise DataError(f"{p}: not valid UTF-8 ({e.reason} at byte {e.start}); save the file as UTF-8") from e
    text = text.replace("\r\n", "\n").replace("\r", "\n")      # universal newlines, as load_examples
    if not text.strip():
        raise DataError(f"{p}: the file has no text")
    ids = tokenize_text(text, tok)
    if max_tokens is not None:
        if max_tokens < 2:
            raise ValueError(f"--max-tokens must be >= 2, got {max_tokens}")
        ids = ids[:max_tokens]
    return ids


def prompt_encoder(tok: TextTokenizer):
    """encode(prompt) -> ids: the tokenizer's special prefix (BOS if it adds one), then the text
    without special tokens (so no EOS or other suffix)."""
    prefix = tok.prefix_ids

    def encode(text: str) -> list[int]:
        return prefix + tok.encode(text, add_special_tokens=False)

    return encode


def letter_ids(tok: TextTokenizer) -> list[int]:
    """Token ids of " A" .. " D" (add_special_tokens=False); each must be a single token."""
    out = []
    for letter in LETTERS:
        ids = tok.encode(" " + letter, add_special_tokens=False)
        if len(ids) != 1:
            raise ValueError(f"the tokenizer encodes ' {letter}' as {ids}, not one token; MMLU scoring needs "
                             "single-token answer letters")
        out.append(int(ids[0]))
    return out


def bos_windows(ids: np.ndarray, tok: TextTokenizer) -> tuple[np.ndarray, list[int]]:
    """(text stream without its leading special prefix, that prefix): for perplexity(prefix=...), so
    that every window starts with the tokenizer's BOS. Raises if the tokenizer adds no BOS."""
    prefix = list(tok.prefix_ids)
    if not prefix:
        raise ValueError("--bos-per-window: this tokenizer adds no BOS token; use the default definition")
    return ids[len(prefix):], prefix


# --------------------------------------------------------------------------------------------
# Settings a bundle allows
# --------------------------------------------------------------------------------------------
def ppl_settings(bundle: Bundle, seq_len: int | None, stride: int | None, prefix_len: int = 0) -> tuple[int, int]:
    """seq_len defaults to the bundle's block length; stride to min(128, the text tokens a window holds)."""
    man = bundle.manifest
    seq_len = int(seq_len or man.seq_len)
    if seq_len > man.model.max_positions:
        raise ValueError(f"--seq-len {seq_len} is above the model's {man.model.max_positions} positions")
    room = seq_len - prefix_len
    stride = int(stride or min(DEFAULT_STRIDE, room))
    if not 1 <= stride <= room:
        raise ValueError(f"--stride {stride} must be in [1, {room}] (seq_len {seq_len}"
                         + (f" minus the {prefix_len} BOS token(s) of each window)" if prefix_len else ")"))
    return seq_len, stride


def mmlu_max_len(bundle: Bundle) -> int:
    """Prompt budget: MMLU_MAX_LEN, or one less than the model's positions (the ORT scorer appends a column)."""
    return min(MMLU_MAX_LEN, int(bundle.manifest.model.max_positions) - 1)
