"""What `pocketlora eval ppl|mmlu` do, callable from Python; pocketlora_cli only parses options.

Both verbs score a bundle's model with LoRA weights from --run (a training run's latest
checkpoint), --peft (a PEFT adapter directory) or neither (the bundle's initial weights = the
base model), through ONNX Runtime (`ort`, the bundle's eval graph) or PyTorch (`torch`, the
model named by the manifest's model.source with a PEFT LoRA). Text and prompts are tokenized
with the bundle's tokenizer in both cases.
"""
from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Sequence

import numpy as np

from ort_trainer.bundle import Bundle
from ort_trainer.tokenizer import DataError, TextTokenizer, tokenize_text
from ort_trainer.session import RuntimeOptions

from .metrics import LETTERS, MMLUResult, PerplexityResult, mmlu_eval, perplexity
from .ort_scorer import as_bundle, resolve_lora

BACKENDS = ("ort", "torch")
DEFAULT_STRIDE = 128
MMLU_MAX_LEN = 2048        # prompt budget (tokens) unless the model allows fewer


# --------------------------------------------------------------------------------------------
# Tokenization (the same as ort_trainer.data's text path)
# --------------------------------------------------------------------------------------------
def text_token_ids(path: str | Path, tok: TextTokenizer, max_tokens: int | None = None) -> np.ndarray:
    """The file's token stream as training sees it: the body tokenized without special tokens
    (ort_trainer.data's chunked tokenization, equal to tokenizing the whole file at once), the
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


# --------------------------------------------------------------------------------------------
# Scorers
# --------------------------------------------------------------------------------------------
def make_scorer(bundle: Bundle, lora: dict[str, np.ndarray], backend: str, threads: int = 0):
    """An eval.metrics.Scorer for these LoRA weights (ONNX names) on the chosen backend."""
    if backend == "ort":
        from .ort_scorer import OrtScorer

        return OrtScorer(bundle, lora, RuntimeOptions(threads=threads))
    if backend == "torch":
        from ort_trainer.adapter import to_peft

        from .parity import torch_lora_model
        from .torch_scorer import TorchScorer

        if threads:
            import torch

            torch.set_num_threads(threads)
        return TorchScorer(torch_lora_model(bundle.manifest, to_peft(bundle.manifest, lora)))
    raise ValueError(f"--backend {backend!r}: use one of {', '.join(BACKENDS)}")


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


def bos_windows(ids: np.ndarray, tok: TextTokenizer) -> tuple[np.ndarray, list[int]]:
    """(text stream without its leading special prefix, that prefix): for perplexity(prefix=...), so
    that every window starts with the tokenizer's BOS. Raises if the tokenizer adds no BOS."""
    prefix = list(tok.prefix_ids)
    if not prefix:
        raise ValueError("--bos-per-window: this tokenizer adds no BOS token; use the default definition")
    return ids[len(prefix):], prefix


def mmlu_max_len(bundle: Bundle) -> int:
    """Prompt budget: MMLU_MAX_LEN, or one less than the model's positions (the ORT scorer appends a column)."""
    return min(MMLU_MAX_LEN, int(bundle.manifest.model.max_positions) - 1)


def _progress(label: str, quiet: bool):
    if quiet:
        return None
    last = [0.0]

    def report(done: int, total: int) -> None:
        now = time.time()
        if done == total or now - last[0] > 2.0:
            last[0] = now
            print(f"\r{label}: {done}/{total}", end="\n" if done == total else "", file=sys.stderr, flush=True)

    return report


# --------------------------------------------------------------------------------------------
# The verbs
# --------------------------------------------------------------------------------------------
def run_ppl(bundle, data, *, run=None, peft=None, seq_len=None, stride=None, max_tokens=None,
            backend="ort", threads=0, batch_size=8, quiet=False, bos_per_window=False) -> dict:
    bundle = as_bundle(bundle)
    lora, weights = resolve_lora(bundle, run, peft)
    tok = TextTokenizer.from_dir(bundle.tokenizer_dir)
    ids = text_token_ids(data, tok, max_tokens)
    prefix: list[int] = []
    if bos_per_window:
        ids, prefix = bos_windows(ids, tok)
    seq_len, stride = ppl_settings(bundle, seq_len, stride, len(prefix))
    scorer = make_scorer(bundle, lora, backend, threads)
    t0 = time.perf_counter()
    res: PerplexityResult = perplexity(scorer, ids, seq_len, stride, _progress("windows", quiet),
                                       batch_size=batch_size, pad_id=tok.pad_id, prefix=prefix)
    return {"ppl": res.ppl, "bos_per_window": bool(prefix), "tokens": res.tokens, "windows": res.windows, "seq_len": res.seq_len,
            "stride": res.stride, "nll_sum": res.nll_sum, "text_tokens": int(len(ids)), "data": str(data),
            "backend": backend, "weights": weights, "bundle": str(bundle.path),
            "seconds": round(time.perf_counter() - t0, 3)}


def mmlu_summary(res: MMLUResult) -> dict:
    """The result without the per-question predictions."""
    d = asdict(res)
    d.pop("predictions")
    return d


def run_mmlu(bundle, data, *, run=None, peft=None, shots=5, subjects: Sequence[str] | None = None,
             split="test", limit=None, backend="ort", threads=0, max_len=None, batch_size=8,
             quiet=False, predictions=False) -> dict:
    bundle = as_bundle(bundle)
    lora, weights = resolve_lora(bundle, run, peft)
    tok = TextTokenizer.from_dir(bundle.tokenizer_dir)
    scorer = make_scorer(bundle, lora, backend, threads)
    t0 = time.perf_counter()
    res = mmlu_eval(scorer, prompt_encoder(tok), data, subjects=subjects or None, split=split, shots=shots,
                    max_len=int(max_len or mmlu_max_len(bundle)), letter_ids=letter_ids(tok),
                    limit_per_subject=limit, progress=_progress("questions", quiet),
                    batch_size=batch_size, pad_id=tok.pad_id)
    out = mmlu_summary(res)
    if predictions:
        out["predictions"] = res.predictions
    out.update(backend=backend, weights=weights, bundle=str(bundle.path), data=str(data),
               seconds=round(time.perf_counter() - t0, 3))
    return out


def write_json(result: dict, out: str | Path | None) -> None:
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(result, indent=1) + "\n")


def print_ppl(r: dict) -> None:
    print(f"perplexity {r['ppl']:.4f} over {r['tokens']} scored tokens ({r['windows']} windows, seq_len "
          f"{r['seq_len']}, stride {r['stride']}{', BOS per window' if r.get('bos_per_window') else ''}; "
          f"{r['backend']}, {r['weights']})")


def print_mmlu(r: dict) -> None:
    print(f"MMLU {r['split']} {r['shots']}-shot ({r['backend']}, {r['weights']}): micro {100 * r['micro']:.2f}%, "
          f"macro {100 * r['macro']:.2f}% over {r['n']} questions; {r['shots_dropped']} shots dropped to fit, "
          f"{r['truncated']} prompts truncated")
    width = max((len(s) for s in r["per_subject"]), default=7)
    for subject, s in r["per_subject"].items():
        acc = "n/a" if not s["n"] else f"{100 * s['acc']:6.2f}%"
        print(f"  {subject:<{width}}  {acc}  ({s['correct']}/{s['n']})")
