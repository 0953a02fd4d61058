"""The `pocketlora eval` verbs: what ppl, mmlu and parity do and print, callable from Python (pocketlora_cli
only parses their options).

ppl and mmlu score a bundle's model with LoRA weights from --run (a training run's latest
checkpoint), --peft (a PEFT adapter directory) or neither (the bundle's initial weights = the
base model), through ONNX Runtime (`ort`, the bundle's eval graph) or PyTorch (`torch`, the
model named by the manifest's model.source with a PEFT LoRA). Text and prompts are tokenized
with the bundle's tokenizer in both cases (eval.inputs). parity: eval.parity.run_parity, printed here.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Sequence

import numpy as np

from ort_trainer.bundle import Bundle
from ort_trainer.faults import write_atomic
from ort_trainer.tokenizer import TextTokenizer
from ort_trainer.session import RuntimeOptions

from .inputs import bos_windows, letter_ids, mmlu_max_len, ppl_settings, prompt_encoder, text_token_ids
from ort_trainer.adapter import resolve_lora

from .ort_scorer import OrtScorer, as_bundle
from .scoring import PerplexityResult, mmlu_eval, mmlu_summary, perplexity

BACKENDS = ("ort", "torch")


def make_scorer(bundle: Bundle, lora: dict[str, np.ndarray], backend: str, threads: int = 0):
    """An eval.scoring.Scorer for these LoRA weights (ONNX names) on the chosen backend."""
    if backend == "ort":
        return OrtScorer(bundle, lora, RuntimeOptions(threads=threads))
    if backend == "torch":
        import torch                                  # the PyTorch stack only for --backend torch

        from ort_trainer.adapter import to_peft

        from .reference_model import torch_lora_model
        from .torch_scorer import TorchScorer

        if threads:
            torch.set_num_threads(threads)
        return TorchScorer(torch_lora_model(bundle, to_peft(bundle.manifest, lora)))
    raise ValueError(f"--backend {backend!r}: use one of {', '.join(BACKENDS)}")


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
        write_atomic(out, json.dumps(result, indent=1) + "\n")     # whole or not at all (ort_trainer.faults)


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


def print_parity(report: dict, out: str | Path) -> None:
    """One line per check, then the verdict and where the report is (`out` as the user gave it)."""
    for check in report["checks"]:
        print(f"{check['status']}  {check['name']} = {check['value']:.3g} (threshold {check['threshold']:g}): "
              f"{check['detail']}")
    print(f"parity {'PASS' if report['pass'] else 'FAIL'}; report in {out}/report.md")
