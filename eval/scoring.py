"""Scoring a model, backend-agnostic: sliding-window perplexity and k-shot MMLU.

Everything here talks to a model only through the small `Scorer` protocol, so the same code
scores the PyTorch reference (eval.torch_scorer.TorchScorer) and the ONNX Runtime eval model on
the device. numpy and the standard library only: no torch import in this module.

Loss convention (the product's contract): position t predicts labels[t+1] (HF shift), label -100
is ignored, and NLLs are *summed* exactly over labelled tokens (never mean * count).
"""
from __future__ import annotations

import csv
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Protocol, Sequence, runtime_checkable

import numpy as np

IGNORE_INDEX = -100
LETTERS = ("A", "B", "C", "D")

# progress(done, total): called after each scored batch.
Progress = Callable[[int, int], None]


@runtime_checkable
class Scorer(Protocol):
    def nll(self, input_ids: np.ndarray, attention_mask: np.ndarray, labels: np.ndarray) -> tuple[float, int]:
        """Sum of the shifted NLL over labelled tokens, and their count (int64 arrays [B,S])."""
        ...

    def last_logits(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        """Logits [B, V] at each row's last real (attention_mask==1) position; right padding."""
        ...


def scored_tokens(labels: np.ndarray) -> int:
    """How many tokens a [B,S] (or [S]) label array scores under the HF shift."""
    labels = np.asarray(labels)
    return int((labels[..., 1:] != IGNORE_INDEX).sum())


def pad_right(rows: Sequence[np.ndarray], pad_id: int = 0, label_rows: Sequence[np.ndarray] | None = None):
    """Right-pad 1-D int rows into (input_ids, attention_mask[, labels]) int64 [B, S_max]."""
    width = max(len(r) for r in rows)
    n = len(rows)
    ids = np.full((n, width), pad_id, dtype=np.int64)
    mask = np.zeros((n, width), dtype=np.int64)
    labels = np.full((n, width), IGNORE_INDEX, dtype=np.int64) if label_rows is not None else None
    for i, r in enumerate(rows):
        ids[i, : len(r)] = r
        mask[i, : len(r)] = 1
        if labels is not None:
            labels[i, : len(r)] = label_rows[i]
    return (ids, mask, labels) if labels is not None else (ids, mask)


# --------------------------------------------------------------------------------------------
# Perplexity
# --------------------------------------------------------------------------------------------
@dataclass
class PerplexityResult:
    ppl: float
    nll_sum: float
    tokens: int       # scored tokens (labels[1:] != -100 summed over windows)
    windows: int
    seq_len: int
    stride: int


def perplexity_windows(n_tokens: int, seq_len: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, trg_len) of each window, exactly as HF's perplexity guide iterates."""
    out = []
    prev_end = 0
    for begin in range(0, n_tokens, stride):
        end = min(begin + seq_len, n_tokens)
        trg_len = end - prev_end
        out.append((begin, end, trg_len))
        prev_end = end
        if end == n_tokens:
            break
    return out


def perplexity(
    scorer: Scorer,
    token_ids: np.ndarray,
    seq_len: int,
    stride: int,
    progress: Progress | None = None,
    *,
    batch_size: int = 8,
    pad_id: int = 0,
    prefix: Sequence[int] = (),
    positions: tuple[int, int] | None = None,
) -> PerplexityResult:
    """Sliding-window perplexity of one token stream, HF's perplexity guide with exact sums.

    Window i covers ids[begin:end]; its labels are the window with all but the last `trg_len`
    positions set to -100 (trg_len = end - previous end). With the shift, a window scores
    (labels[1:] != -100).sum() tokens; ppl = exp(total NLL / total scored tokens).
    Windows are scored `batch_size` at a time, right-padded (mask 0, label -100).

    `prefix` (e.g. [BOS]): tokens put in front of every window and never scored; the windows then
    slide over `token_ids` with seq_len - len(prefix) text tokens each. For models trained with a BOS
    on every sequence (Gemma), HF's definition scores all windows after the first without it, which
    is a different regime; `prefix=[bos]` with the stream's own leading BOS removed measures the model
    as it is used. Both are reported where it matters (docs/EVALUATION.md).

    `positions=(lo, hi)`: score only the tokens at window positions lo..hi-1 (position 0 is the window's
    first token, the prefix included); with a BOS prefix and stride = window, this says whether a model
    changed at the start of a context or deep into it (perplexity_by_position).
    """
    ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
    pre = np.asarray(list(prefix), dtype=np.int64)
    n = int(ids.shape[0])
    if seq_len - len(pre) < 2:
        raise ValueError(f"seq_len must be >= len(prefix) + 2, got {seq_len} with a prefix of {len(pre)}")
    seq_len -= len(pre)
    if not 1 <= stride <= seq_len:
        raise ValueError(f"stride must be in [1, seq_len={seq_len}], got {stride}")
    if n < 2:
        raise ValueError(f"need at least 2 tokens to score, got {n}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")

    windows = perplexity_windows(n, seq_len, stride)
    nll_sum = 0.0
    tokens = 0
    done = 0
    for b0 in range(0, len(windows), batch_size):
        chunk = windows[b0 : b0 + batch_size]
        rows, label_rows = [], []
        for begin, end, trg_len in chunk:
            window = ids[begin:end]
            labels = window.copy()
            labels[: len(window) - trg_len] = IGNORE_INDEX   # == labels[:-trg_len] when trg_len < len
            if len(pre):
                window = np.concatenate([pre, window])
                labels = np.concatenate([np.full(len(pre), IGNORE_INDEX, dtype=np.int64), labels])
            if positions is not None:
                labels[: positions[0]] = IGNORE_INDEX
                labels[positions[1]:] = IGNORE_INDEX
            rows.append(window)
            label_rows.append(labels)
        input_ids, attention_mask, labels = pad_right(rows, pad_id, label_rows)
        expect = scored_tokens(labels)
        s, c = scorer.nll(input_ids, attention_mask, labels)
        if int(c) != expect:
            raise RuntimeError(f"scorer counted {c} labelled tokens, expected {expect}")
        nll_sum += float(s)
        tokens += int(c)
        done += len(chunk)
        if progress is not None:
            progress(done, len(windows))
    return PerplexityResult(
        ppl=math.exp(nll_sum / tokens), nll_sum=nll_sum, tokens=tokens,
        windows=len(windows), seq_len=seq_len + len(pre), stride=stride,
    )


def perplexity_by_position(scorer: Scorer, token_ids: np.ndarray, seq_len: int, prefix: Sequence[int],
                           ranges: Sequence[tuple[int, int]], **kw) -> dict[str, PerplexityResult]:
    """Perplexity of disjoint prefix-started windows, split by position in the window: {"lo-hi": result}
    for each range [lo, hi) (hi is exclusive; the label shows it inclusive, e.g. "48-127")."""
    stride = seq_len - len(prefix)
    return {f"{lo}-{hi - 1}": perplexity(scorer, token_ids, seq_len, stride, prefix=prefix, positions=(lo, hi), **kw)
            for lo, hi in ranges}


# --------------------------------------------------------------------------------------------
# MMLU
# --------------------------------------------------------------------------------------------
Row = Sequence[str]   # question, A, B, C, D, answer letter


def mmlu_subjects(data_dir: str | Path) -> list[str]:
    """Sorted subject names found under data_dir/{dev,val,test}/{subject}_{split}.csv."""
    data_dir = Path(data_dir)
    found: set[str] = set()
    for split in ("dev", "val", "test"):
        d = data_dir / split
        if d.is_dir():
            suffix = f"_{split}.csv"
            found.update(p.name[: -len(suffix)] for p in d.glob(f"*{suffix}"))
    if not found:
        raise FileNotFoundError(f"no MMLU csv files under {data_dir}/{{dev,val,test}}")
    return sorted(found)


def load_mmlu_split(data_dir: str | Path, subject: str, split: str) -> list[list[str]]:
    """Rows (question, A, B, C, D, answer) of one subject's csv (no header)."""
    path = Path(data_dir) / split / f"{subject}_{split}.csv"
    if not path.is_file():
        raise FileNotFoundError(f"MMLU file not found: {path}")
    rows = []
    with path.open(newline="", encoding="utf-8") as f:
        for lineno, row in enumerate(csv.reader(f), 1):
            if not row:
                continue
            if len(row) != 6:
                raise ValueError(f"{path}:{lineno}: expected 6 columns, got {len(row)}")
            row = [str(x) for x in row]
            row[5] = row[5].strip()
            if row[5] not in LETTERS:
                raise ValueError(f"{path}:{lineno}: answer {row[5]!r} is not one of A-D")
            rows.append(row)
    return rows


def format_subject(s: str) -> str:
    """"high_school_biology" -> "high school biology"."""
    return " ".join(s.split("_"))


def format_example(row: Row, include_answer: bool = True) -> str:
    text = str(row[0])
    for letter, choice in zip(LETTERS, row[1:5]):
        text += f"\n{letter}. {choice}"
    text += "\nAnswer:"
    if include_answer:
        text += f" {row[5]}\n\n"
    return text


def mmlu_prompt(subject: str, shots: Sequence[Row], question_row: Row) -> str:
    """Hendrycks' k-shot prompt; the test question ends with "Answer:"."""
    text = f"The following are multiple choice questions (with answers) about {format_subject(subject)}.\n\n"
    for shot in shots:
        text += format_example(shot, include_answer=True)
    return text + format_example(question_row, include_answer=False)


@dataclass
class MMLUResult:
    micro: float                        # correct / n over all questions
    macro: float                        # mean of per-subject accuracies (subjects with n > 0)
    per_subject: dict[str, dict]        # subject -> {"acc", "n", "correct"}
    n: int
    shots: int                          # shots requested
    shots_dropped: int                  # total shots removed to fit max_len, over all questions
    split: str
    predictions: list[dict]             # one per question, in (subject, index) order
    truncated: int = 0                  # questions whose 0-shot prompt was left-truncated to max_len


def mmlu_summary(res: MMLUResult) -> dict:
    """The result without the per-question predictions."""
    d = asdict(res)
    d.pop("predictions")
    return d


def _build_prompt_ids(encode, subject, pool, row, shots, max_len):
    """Token ids of the largest prompt with <= `shots` shots that fits; (ids, shots_used, truncated)."""
    k = min(shots, len(pool))
    while True:
        ids = list(encode(mmlu_prompt(subject, pool[:k], row)))
        if len(ids) <= max_len or k == 0:
            break
        k -= 1
    truncated = len(ids) > max_len
    if truncated:
        ids = ids[-max_len:]
    return ids, k, truncated


def mmlu_eval(
    scorer: Scorer,
    encode: Callable[[str], list[int]],
    data_dir: str | Path,
    subjects: Sequence[str] | None = None,
    split: str = "val",
    shots: int = 5,
    max_len: int = 1024,
    letter_ids: Sequence[int] | None = None,
    limit_per_subject: int | None = None,
    progress: Progress | None = None,
    *,
    batch_size: int = 8,
    pad_id: int = 0,
) -> MMLUResult:
    """k-shot MMLU accuracy: argmax over the next-token logits restricted to `letter_ids`.

    Shots are the first `shots` rows of the subject's dev split (for split="dev" the question
    itself is excluded from its pool). A prompt longer than max_len tokens loses shots from the
    last until it fits; if even the 0-shot prompt is too long its ids are truncated from the left
    (keeping the last max_len tokens, so the "Answer:" end survives). letter_ids default to the
    single tokens of encode(" A") .. encode(" D"). Prompts are sorted by length and scored
    `batch_size` at a time, right-padded.
    """
    if subjects is None:
        subjects = mmlu_subjects(data_dir)
    subjects = list(subjects)
    if shots < 0:
        raise ValueError(f"shots must be >= 0, got {shots}")
    if max_len < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len}")
    if letter_ids is None:
        letter_ids = []
        for letter in LETTERS:
            ids = list(encode(" " + letter))
            if len(ids) != 1:
                raise ValueError(f"encode(' {letter}') gives {ids}, not one token; pass letter_ids")
            letter_ids.append(ids[0])
    letter_ids = [int(i) for i in letter_ids]
    if len(letter_ids) != 4 or len(set(letter_ids)) != 4:
        raise ValueError(f"letter_ids must be 4 distinct token ids, got {letter_ids}")

    items = []   # (subject, index, row, ids, shots_used, truncated)
    shots_dropped = 0
    n_truncated = 0
    for subject in subjects:
        rows = load_mmlu_split(data_dir, subject, split)
        if limit_per_subject is not None:
            rows = rows[:limit_per_subject]
        dev = load_mmlu_split(data_dir, subject, "dev") if shots > 0 else []
        for i, row in enumerate(rows):
            pool = [r for j, r in enumerate(dev) if not (split == "dev" and j == i)][:shots]
            ids, used, truncated = _build_prompt_ids(encode, subject, pool, row, shots, max_len)
            shots_dropped += len(pool) - used
            n_truncated += int(truncated)
            items.append((subject, i, row, ids, used, truncated))

    order = sorted(range(len(items)), key=lambda j: len(items[j][3]))
    letter_logits = np.zeros((len(items), 4), dtype=np.float64)
    done = 0
    for b0 in range(0, len(order), batch_size):
        idx = order[b0 : b0 + batch_size]
        input_ids, attention_mask = pad_right([np.asarray(items[j][3], dtype=np.int64) for j in idx], pad_id)
        logits = np.asarray(scorer.last_logits(input_ids, attention_mask))
        if logits.shape[0] != len(idx):
            raise RuntimeError(f"scorer returned {logits.shape[0]} rows for {len(idx)} prompts")
        letter_logits[idx] = logits[:, letter_ids]
        done += len(idx)
        if progress is not None:
            progress(done, len(items))

    per_subject: dict[str, dict] = {s: {"acc": float("nan"), "n": 0, "correct": 0} for s in subjects}
    predictions = []
    for j, (subject, i, row, ids, used, truncated) in enumerate(items):
        pred = LETTERS[int(np.argmax(letter_logits[j]))]
        correct = pred == row[5]
        per_subject[subject]["n"] += 1
        per_subject[subject]["correct"] += int(correct)
        predictions.append({
            "subject": subject, "index": i, "answer": row[5], "pred": pred, "correct": bool(correct),
            "shots": used, "truncated": bool(truncated), "prompt_tokens": len(ids),
            "letter_logits": [float(x) for x in letter_logits[j]],
        })
    for stats in per_subject.values():
        if stats["n"]:
            stats["acc"] = stats["correct"] / stats["n"]
    n = len(items)
    correct_total = sum(s["correct"] for s in per_subject.values())
    accs = [s["acc"] for s in per_subject.values() if s["n"]]
    return MMLUResult(
        micro=correct_total / n if n else float("nan"),
        macro=float(np.mean(accs)) if accs else float("nan"),
        per_subject=per_subject, n=n, shots=shots, shots_dropped=shots_dropped, split=split,
        predictions=predictions, truncated=n_truncated,
    )
