"""Parity of the device trainer (ONNX Runtime) with an independent PyTorch + PEFT trainer.

One concern, the parity job from start to report (its checks are in parity_checks.py); it is over 400 lines
because both sides, their subprocess workers and the evaluation of their adapters are the job's own steps.

`run_parity(cfg)`:

1. ORT side: the device runner `android_runner.loop.train` trains the bundle into REPORT/ort_run.
2. PyTorch side: `eval.reference.reference_train` trains a PEFT model of the same base model
   (loaded from the manifest's model.source through artifacts_gen.source.load_source) from the same
   initial LoRA weights (the bundle's checkpoint, mapped to PEFT keys), on the same micro-batches
   in the same order (rebuilt with ort_trainer.batching exactly as the loop builds them),
   with the same hyperparameters (LR schedule, clip, weight decay; AdamW betas/eps from the
   bundle's manifest.optimizer). The adapter is saved with PEFT's save_pretrained to
   REPORT/torch_run/adapter.

   Each side runs in its own subprocess (`python -m eval.parity --worker ort|torch CONFIG`), so the
   peak RSS reported for a side is that process's own ru_maxrss (interpreter, libraries, model and
   training), not a difference of one process's counters.
3. Comparison (in this process): per-step loss curves, final LoRA weights, held-out perplexity of
   base / ORT-trained / PyTorch-trained weights through both backends (so training differences
   and inference differences can be told apart), optional MMLU the same way, speed and memory.
   The thresholds and comparisons are eval.parity_checks'.
4. eval.report writes report.md, report.json and the plots.

Each training side and the evaluation import their heavy stack (onnxruntime through android_runner.loop or
eval.ort_scorer; torch, transformers and peft through eval.reference_model) inside the functions that run
them: a worker process then holds only its own side, and this process loads neither before the workers run
(a child's ru_maxrss starts from its parent's at fork).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from ort_trainer.bundle import Bundle, open_bundle
from ort_trainer.tokenizer import TextTokenizer
from ort_trainer.records import load_examples
from ort_trainer.batching import data_order, step_batches
from ort_trainer.adapter import to_peft
from ort_trainer.settings import TrainSettings
from ort_trainer.versions import tool_versions
from android_runner.metrics import peak_rss_mb

from .inputs import letter_ids, mmlu_max_len, ppl_settings, prompt_encoder, text_token_ids
from .parity_checks import THRESHOLDS, ParityError, parity_checks, rel_diffs, weight_diffs
from .report import write_report
from .scoring import mmlu_eval, mmlu_summary, perplexity

REPO = Path(__file__).resolve().parents[1]
ORT_RUN = "ort_run"
ORT_FLOOR_RUN = "ort_floor_run"     # --floor: ORT again, the same steps split differently
TORCH_RUN = "torch_run"
TORCH_RESULT = "result.json"
ADAPTER = "adapter"
CONFIG_FILE = "parity_config.json"


@dataclass(kw_only=True)
class ParityConfig(TrainSettings):
    bundle: str
    data: str
    out: str
    steps: int = 200
    heldout: str | None = None
    ppl_seq_len: int | None = None        # default: the bundle's seq_len
    ppl_stride: int | None = None         # default: min(128, seq_len)
    heldout_max_tokens: int | None = None
    mmlu_data: str | None = None
    mmlu_subjects: list[str] | None = None
    mmlu_limit: int | None = None
    mmlu_split: str = "test"
    shots: int = 5
    threads: int = 0                      # ORT intra-op threads and torch threads (0: each library's default)
    isolate: bool = True                  # each side in its own subprocess (False: both in this process)
    force: bool = False                   # replace an existing ort_run / torch_run in out
    floor: bool = False                   # also train ORT with another micro-batch split: the noise floor

    def validate(self) -> None:
        super().validate()
        if self.steps < 1:
            raise ValueError("--steps must be >= 1")
        if self.shots < 0:
            raise ValueError("--shots must be >= 0")
        for name in ("bundle", "data", "heldout", "mmlu_data"):
            v = getattr(self, name)
            if v is not None and not Path(v).exists():
                raise FileNotFoundError(f"--{name.replace('_', '-')} {v}: not found")

    def absolute(self) -> "ParityConfig":
        d = asdict(self)
        for name in ("bundle", "data", "out", "heldout", "mmlu_data"):
            if d[name] is not None:
                d[name] = str(Path(d[name]).absolute())
        return ParityConfig(**d)


def floor_split(micro_batch: int, accum: int) -> tuple[int, int]:
    """Another (micro-batch, accum) with the same examples per step, for the noise floor: micro-batches halved
    (or, with an odd micro-batch, doubled)."""
    if micro_batch % 2 == 0:
        return micro_batch // 2, accum * 2
    if accum % 2 == 0:
        return micro_batch * 2, accum // 2
    if micro_batch * accum > 1:
        return (1, micro_batch * accum) if micro_batch > 1 else (accum, 1)
    raise ValueError("--floor needs more than one sequence per step (micro-batch x accum > 1): the floor is the same "
                     "step split into other micro-batches")


def floor_config(cfg: "ParityConfig") -> "ParityConfig":
    m, a = floor_split(cfg.micro_batch, cfg.accum)
    return replace(cfg, micro_batch=m, accum=a)


def check_same_steps(bundle: Bundle, cfg: "ParityConfig") -> None:
    """The floor compares the same math: every step must hold the same sequences under both splits (length
    grouping regroups them, and an epoch's dropped remainder depends on the micro-batch)."""
    if cfg.group_by_length:
        raise ValueError("--floor with --group-by-length: the two splits would group other sequences into each step")

    def rows(steps):
        return [sorted(tuple(int(t) for t, m in zip(r, mr) if m) for mb in st
                       for r, mr in zip(mb["input_ids"], mb["attention_mask"])) for st in steps]

    a, b = rows(parity_steps(bundle, cfg.data, cfg.steps, cfg)), rows(parity_steps(bundle, cfg.data, cfg.steps,
                                                                                  floor_config(cfg)))
    if a != b:
        k = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y) + 1
        raise ValueError(f"--floor: from step {k} the {cfg.micro_batch}x{cfg.accum} and "
                         f"{'x'.join(map(str, floor_split(cfg.micro_batch, cfg.accum)))} splits take different "
                         "sequences (an epoch ends with a partial micro-batch); use more data or fewer --steps")


def parity_steps(bundle: Bundle, data: str | Path, steps: int, settings: TrainSettings) -> list[list[dict[str, np.ndarray]]]:
    """The micro-batches of each optimizer step, exactly as android_runner.loop builds them."""
    tok = TextTokenizer.from_dir(bundle.tokenizer_dir)
    examples, _ = load_examples(data, tok, bundle.manifest.seq_len)
    order = data_order(examples, settings.seed, settings.micro_batch, settings.group_by_length)
    return [step_batches(examples, order, settings.accum, tok.pad_id) for _ in range(steps)]


# --------------------------------------------------------------------------------------------
# The two training sides (each run in its own subprocess by run_parity)
# --------------------------------------------------------------------------------------------
def ort_side(cfg: ParityConfig, log=print, run: str = ORT_RUN) -> dict:
    from android_runner.loop import RunConfig, train

    rc = RunConfig(**asdict(cfg.train_settings()), bundle=cfg.bundle, data=cfg.data, max_steps=cfg.steps,
                   save_every=cfg.steps, battery="none", threads=cfg.threads)
    return train(rc, Path(cfg.out) / run, log=log, progress=False)


def ort_floor_side(cfg: ParityConfig, log=print) -> dict:
    return ort_side(floor_config(cfg), log, ORT_FLOOR_RUN)





def torch_side(cfg: ParityConfig, log=print) -> dict:
    import torch

    from ort_trainer.adapter import initial_lora
    from .reference import TrainConfig, reference_train
    from .reference_model import torch_lora_model

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    out = Path(cfg.out) / TORCH_RUN
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    bundle = open_bundle(cfg.bundle, verify="sizes")
    man = bundle.manifest
    steps = parity_steps(bundle, cfg.data, cfg.steps, cfg)
    model = torch_lora_model(bundle, to_peft(man, initial_lora(bundle)))
    setup_s = time.perf_counter() - t0
    opt = man.optimizer
    tc = TrainConfig(**asdict(cfg.train_settings()), betas=(float(opt["beta1"]), float(opt["beta2"])),
                     eps=float(opt["eps"]), total_steps=cfg.steps)
    log(f"PyTorch reference: {cfg.steps} steps x {cfg.accum} micro-batches of {cfg.micro_batch}; "
        f"AdamW betas {tc.betas} eps {tc.eps} weight_decay {tc.weight_decay}, clip {tc.clip}, {tc.schedule}")

    def progress(step, total, loss):
        if step == 1 or step == total or step % 10 == 0:
            log(f"step {step}/{total} loss {loss:.6f}")

    run = reference_train(model, steps, tc, progress=progress)
    model.save_pretrained(str(out / ADAPTER))
    result = {
        "losses": run.losses, "grad_norms": run.grad_norms, "lrs": run.lrs,
        "train_s": run.seconds, "setup_s": setup_s, "label_tokens": run.tokens,
        "tokens": int(sum(int(mb["attention_mask"].sum()) for s in steps for mb in s)),
        "peak_rss_mb": run.peak_rss_mb, "threads": torch.get_num_threads(),
    }
    (out / TORCH_RESULT).write_text(json.dumps(result, indent=1))
    return result


def _write_rss(cfg: ParityConfig, side: str) -> None:
    """This process's peak RSS (VmHWM; see android_runner.metrics.peak_rss_mb) into OUT/{side}_rss.json."""
    (Path(cfg.out) / f"{side}_rss.json").write_text(json.dumps({"peak_rss_mb": peak_rss_mb()}))


def _run_side(side: str, cfg: ParityConfig, log) -> float:
    """Train one side as cfg.isolate says; returns its wall time. Its output goes to OUT/{side}_run.log."""
    out = Path(cfg.out)
    if cfg.isolate:
        return _run_worker(side, out / CONFIG_FILE, out / f"{side}_run.log", log)
    return _run_in_process(side, cfg, out / f"{side}_run.log", log)


def _run_in_process(side: str, cfg: ParityConfig, log_path: Path, log) -> float:
    """Run one side in this process (no subprocess start-up; memory numbers are then not per side)."""
    import signal

    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    t0 = time.perf_counter()
    try:
        with open(log_path, "w") as f:
            def to_file(msg):
                print(msg, file=f, flush=True)

            _side_fn(side)(cfg, to_file)
        _write_rss(cfg, side)
    finally:
        for sig, handler in saved.items():          # the device loop installs its own SIGINT/SIGTERM handlers
            signal.signal(sig, handler)
    wall = time.perf_counter() - t0
    log(f"      done in {wall:.1f} s (in this process; log: {log_path})")
    return wall


def _side_fn(side: str):
    return {"ort": ort_side, "torch": torch_side, "ort_floor": ort_floor_side}[side]


def _run_worker(side: str, config_path: Path, log_path: Path, log) -> float:
    """Run one side in its own process; returns its wall time. Output goes to log_path."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    cmd = [sys.executable, "-m", "eval.parity", "--worker", side, str(config_path)]
    t0 = time.perf_counter()
    with open(log_path, "w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=str(REPO))
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        tail = "".join(log_path.read_text(errors="replace").splitlines(keepends=True)[-25:])
        raise ParityError(f"the {side} training process failed (exit {proc.returncode}); "
                          f"end of {log_path}:\n{tail}")
    log(f"      done in {wall:.1f} s (log: {log_path})")
    return wall


# --------------------------------------------------------------------------------------------
# What the two runs left behind
# --------------------------------------------------------------------------------------------
def read_metrics(run_dir: Path) -> list[dict]:
    """A device run's metrics.jsonl, one record per step (the last record of a step wins), by step."""
    rows = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            rows[int(rec["step"])] = rec
    return [rows[s] for s in sorted(rows)]


@dataclass
class TrainedSides:
    summary: dict                       # the ORT run's summary.json
    metrics: list[dict]                 # the ORT run's metrics.jsonl, by step
    torch: dict                         # the PyTorch side's result.json
    ort_losses: list[float]
    torch_losses: list[float]
    ort_lora: dict[str, np.ndarray]     # final LoRA weights, ONNX names
    ort_step: int
    torch_lora: dict[str, np.ndarray]
    weights: dict                       # parity_checks.weight_diffs of the two (PEFT keys)


def read_sides(cfg: ParityConfig, man, log) -> TrainedSides:
    """Losses and final weights of both sides from OUT; raises ParityError if a side did not finish."""
    from safetensors.numpy import load_file

    from ort_trainer.adapter import lora_from_peft, lora_from_run

    out = Path(cfg.out)
    summary = json.loads((out / ORT_RUN / "summary.json").read_text())
    if not summary.get("finished"):
        raise ParityError(f"the ORT run stopped at step {summary.get('step')}/{cfg.steps}")
    metrics = read_metrics(out / ORT_RUN)
    tres = json.loads((out / TORCH_RUN / TORCH_RESULT).read_text())
    ort_losses = [float(m["loss"]) for m in metrics]
    torch_losses = [float(x) for x in tres["losses"]]
    if len(ort_losses) != cfg.steps or len(torch_losses) != cfg.steps:
        raise ParityError(f"expected {cfg.steps} losses, got {len(ort_losses)} (ORT) and {len(torch_losses)} (PyTorch)")
    ort_lora, ort_step = lora_from_run(out / ORT_RUN, man, warn=log)
    torch_lora = lora_from_peft(out / TORCH_RUN / ADAPTER, man)
    torch_peft_file = load_file(str(out / TORCH_RUN / ADAPTER / "adapter_model.safetensors"))
    return TrainedSides(summary=summary, metrics=metrics, torch=tres, ort_losses=ort_losses,
                        torch_losses=torch_losses, ort_lora=ort_lora, ort_step=ort_step, torch_lora=torch_lora,
                        weights=weight_diffs(to_peft(man, ort_lora), torch_peft_file))


# --------------------------------------------------------------------------------------------
# Evaluation: base / ORT-trained / PyTorch-trained weights through both backends
# --------------------------------------------------------------------------------------------
def _scorers(bundle: Bundle, weights: dict[str, dict], log):
    """(label, backend, scorer) for each of `weights` (label -> LoRA, ONNX names), ORT then PyTorch: one ORT
    session and one PyTorch model, their LoRA weights swapped from one label to the next."""
    from .ort_scorer import OrtScorer
    from .reference import set_lora_state
    from .reference_model import torch_lora_model
    from .torch_scorer import TorchScorer

    man = bundle.manifest
    ort_scorer = torch_model = None
    for label, lora in weights.items():
        log(f"      {label}: ORT")
        if ort_scorer is None:
            ort_scorer = OrtScorer(bundle, lora)
        else:
            ort_scorer.set_lora(lora)
        yield label, "ort", ort_scorer
        log(f"      {label}: PyTorch")
        if torch_model is None:
            torch_model = torch_lora_model(bundle, to_peft(man, lora))
        else:
            set_lora_state(torch_model, to_peft(man, lora))
        yield label, "torch", TorchScorer(torch_model)


def _score(cfg: ParityConfig, bundle: Bundle, tok: TextTokenizer, scorer, heldout) -> tuple[dict | None, dict | None]:
    """(perplexity, MMLU) of one scorer; None for what cfg does not ask for. heldout: (ids, seq_len, stride)."""
    ppl = mmlu = None
    if heldout is not None:
        ids, seq_len, stride = heldout
        r = perplexity(scorer, ids, seq_len, stride, pad_id=tok.pad_id)
        ppl = {"ppl": r.ppl, "nll_sum": r.nll_sum, "tokens": r.tokens, "windows": r.windows}
    if cfg.mmlu_data:
        r = mmlu_eval(scorer, prompt_encoder(tok), cfg.mmlu_data, subjects=cfg.mmlu_subjects or None,
                      split=cfg.mmlu_split, shots=cfg.shots, max_len=mmlu_max_len(bundle),
                      letter_ids=letter_ids(tok), limit_per_subject=cfg.mmlu_limit, pad_id=tok.pad_id)
        mmlu = mmlu_summary(r)
        mmlu["preds"] = [p["pred"] for p in r.predictions]
    return ppl, mmlu


def evaluate(cfg: ParityConfig, bundle: Bundle, ort_lora: dict, torch_lora: dict, log=print) -> dict:
    """Perplexity and MMLU of base / ORT-trained / PyTorch-trained weights through both backends."""
    from ort_trainer.adapter import initial_lora

    tok = TextTokenizer.from_dir(bundle.tokenizer_dir)
    weights = {"base": initial_lora(bundle), "ort_trained": ort_lora, "torch_trained": torch_lora}
    heldout = None
    if cfg.heldout:
        seq_len, stride = ppl_settings(bundle, cfg.ppl_seq_len, cfg.ppl_stride)
        heldout = (text_token_ids(cfg.heldout, tok, cfg.heldout_max_tokens), seq_len, stride)
    ppl: dict = {}
    mmlu: dict = {}
    seconds = {"ort": 0.0, "torch": 0.0}
    for label, backend, scorer in _scorers(bundle, weights, log):
        t0 = time.perf_counter()
        p, m = _score(cfg, bundle, tok, scorer, heldout)
        seconds[backend] += time.perf_counter() - t0
        if p is not None:
            ppl.setdefault(label, {})[backend] = p
        if m is not None:
            mmlu.setdefault(label, {})[backend] = m

    out: dict = {"eval_seconds": {k: round(v, 3) for k, v in seconds.items()}}
    if heldout is not None:
        first = ppl["base"]["ort"]
        out["perplexity"] = {"data": cfg.heldout, "text_tokens": int(len(heldout[0])), "tokens": first["tokens"],
                             "windows": first["windows"], "seq_len": seq_len, "stride": stride, "matrix": ppl}
    if cfg.mmlu_data:
        out["mmlu"] = {"data": cfg.mmlu_data, "split": cfg.mmlu_split, "shots": cfg.shots,
                       "limit_per_subject": cfg.mmlu_limit, "max_len": mmlu_max_len(bundle), "matrix": mmlu}
    return out


# --------------------------------------------------------------------------------------------
# The report
# --------------------------------------------------------------------------------------------
def _perf(cfg: ParityConfig, sides: TrainedSides, walls: dict[str, float], ev: dict) -> tuple[dict, list[str]]:
    """Speed and memory of both sides, and how they were measured; (perf, notes)."""
    summary, tres = sides.summary, sides.torch
    ort_train_s = float(sum(float(m["step_s"]) for m in sides.metrics))
    timing = ("train_s = time inside optimizer steps (ORT: sum of the loop's step_s; PyTorch: reference_train's "
              "loop with batches prebuilt); tokens/s = real (attention-mask) tokens / train_s; runner_peak_rss_mb "
              "is the device runner's own summary figure (ru_maxrss, which on Linux a subprocess inherits from "
              "its parent at fork, so it can overstate)")
    rss = {side: json.loads((Path(cfg.out) / f"{side}_rss.json").read_text())["peak_rss_mb"] for side in ("ort", "torch")}
    notes = []
    if cfg.isolate:
        how = ("each side trained in its own subprocess, one after the other; peak RSS = that process's peak "
               "resident set (Linux VmHWM: interpreter, libraries, model, training); " + timing +
               "; process_wall_s includes start-up, model/session loading and saving")
    else:
        how = ("in-process mode: both sides trained in the evaluating process, one after the other; peak RSS is "
               "that process's high-water mark (VmHWM) after each side, so it includes everything loaded "
               "before and does NOT measure either side alone; " + timing + "; process_wall_s is the wall time "
               "of each side's call (model/session loading and saving included, no interpreter start-up)")
        notes.append("in-process mode (isolate=False): peak RSS numbers are not per side")
    perf = {
        "how": how,
        "isolated": cfg.isolate,
        "ort": {"train_s": ort_train_s, "loop_wall_s": summary.get("wall_s"), "process_wall_s": walls["ort"],
                "tokens": summary.get("tokens_this_session"),
                "tokens_per_s": summary["tokens_this_session"] / ort_train_s if ort_train_s > 0 else None,
                "peak_rss_mb": rss["ort"], "runner_peak_rss_mb": summary.get("peak_rss_mb"),
                "threads": cfg.threads or "ORT default"},
        "torch": {"train_s": tres["train_s"], "setup_s": tres["setup_s"], "process_wall_s": walls["torch"],
                  "tokens": tres["tokens"],
                  "tokens_per_s": tres["tokens"] / tres["train_s"] if tres["train_s"] > 0 else None,
                  "peak_rss_mb": rss["torch"], "threads": tres["threads"]},
        "eval_seconds": ev["eval_seconds"],
    }
    return perf, notes


def _report(cfg: ParityConfig, bundle: Bundle, sides: TrainedSides, rel: np.ndarray, ev: dict, checks: list[dict],
            perf: dict, notes: list[str]) -> dict:
    """report.json: everything eval.report renders."""
    man, metrics, tres = bundle.manifest, sides.metrics, sides.torch
    return {
        "schema": 1,
        "created": time.strftime("%Y-%m-%d %H:%M:%S"),
        "config": asdict(cfg),
        "bundle": {"path": str(bundle.path), "family": man.family, "architecture": man.model.architecture,
                   "source": man.model.source, "seq_len": man.seq_len, "vocab_size": man.model.vocab_size,
                   "lora": asdict(man.lora), "optimizer": man.optimizer,
                   "trainable_params": int(sum(int(np.prod(t.shape)) for t in man.trainable))},
        "thresholds": THRESHOLDS,
        "checks": checks,
        "pass": all(c["pass"] for c in checks),
        "loss": {"steps": [int(m["step"]) for m in metrics], "ort": sides.ort_losses, "torch": sides.torch_losses,
                 "rel_diff": [float(x) for x in rel], "max_rel_diff": float(rel.max()),
                 "mean_rel_diff": float(rel.mean()),
                 "lr_ort": [float(m["lr"]) for m in metrics], "lr_torch": tres["lrs"],
                 "grad_norm_ort": [float(m["grad_norm"]) for m in metrics], "grad_norm_torch": tres["grad_norms"],
                 "label_tokens": tres["label_tokens"]},
        "weights": {"ort_step": sides.ort_step, **sides.weights},
        "perplexity": ev.get("perplexity"),
        "mmlu": ev.get("mmlu"),
        "perf": perf,
        "data_report": sides.summary.get("data_report"),
        "versions": {"python": platform.python_version(), **tool_versions()},
        "notes": notes,
    }


# --------------------------------------------------------------------------------------------
# The job
# --------------------------------------------------------------------------------------------
def _prepare(cfg: ParityConfig) -> Bundle:
    """OUT made (and earlier runs' sides removed with cfg.force), the bundle opened, OUT/parity_config.json written."""
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    for sub in (ORT_RUN, TORCH_RUN, ORT_FLOOR_RUN):
        if (out / sub).exists():
            if not cfg.force:
                raise FileExistsError(f"{out / sub} exists from an earlier parity run; pass --force to replace it "
                                      "or choose another --out")
            shutil.rmtree(out / sub)
    bundle = open_bundle(cfg.bundle)            # full hash check once; the workers check sizes
    if cfg.floor:
        check_same_steps(bundle, cfg)
    (out / CONFIG_FILE).write_text(json.dumps(asdict(cfg), indent=1) + "\n")
    return bundle


def run_parity(cfg: ParityConfig, log=print) -> dict:
    cfg = cfg.absolute()
    cfg.validate()
    out = Path(cfg.out)
    bundle = _prepare(cfg)
    walls = {}
    log(f"[1/4] ORT device runner: {cfg.steps} steps ({cfg.accum} x {cfg.micro_batch} per step) -> {out / ORT_RUN}")
    walls["ort"] = _run_side("ort", cfg, log)
    log(f"[2/4] PyTorch + PEFT reference, same batches and settings -> {out / TORCH_RUN}")
    walls["torch"] = _run_side("torch", cfg, log)
    floor = None
    if cfg.floor:
        m, a = floor_split(cfg.micro_batch, cfg.accum)
        log(f"[2b/4] the noise floor: ORT again, the same steps as {a} x {m} -> {out / ORT_FLOOR_RUN}")
        walls["ort_floor"] = _run_side("ort_floor", cfg, log)
    sides = read_sides(cfg, bundle.manifest, log)
    if cfg.floor:
        second = [float(r["loss"]) for r in read_metrics(out / ORT_FLOOR_RUN)]
        if len(second) != cfg.steps:
            raise ParityError(f"the floor's ORT run logged {len(second)} of {cfg.steps} steps")
        floor = {"split": f"{m}x{a}", "rel_diff": [float(x) for x in rel_diffs(second, sides.ort_losses)]}

    log("[3/4] evaluation: base / ORT-trained / PyTorch-trained weights through ORT and PyTorch")
    ev = evaluate(cfg, bundle, sides.ort_lora, sides.torch_lora, log=log)
    rel = rel_diffs(sides.ort_losses, sides.torch_losses)
    checks, notes = parity_checks(rel, ev, bundle.manifest.lora.dropout, floor)
    perf, perf_notes = _perf(cfg, sides, walls, ev)
    report = _report(cfg, bundle, sides, rel, ev, checks, perf, notes + perf_notes)
    report["loss"]["floor"] = floor

    log("[4/4] report")
    paths = write_report(report, out)
    log(f"      {paths['md']}")
    return report


# --------------------------------------------------------------------------------------------
# Worker entry point: python -m eval.parity --worker ort|torch CONFIG.json
# --------------------------------------------------------------------------------------------
def _worker_main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m eval.parity")
    ap.add_argument("--worker", choices=["ort", "torch", "ort_floor"], required=True)
    ap.add_argument("config")
    args = ap.parse_args(argv)
    cfg = ParityConfig(**json.loads(Path(args.config).read_text()))

    def log(msg):
        print(msg, flush=True)

    _side_fn(args.worker)(cfg, log)
    _write_rss(cfg, args.worker)
    return 0


if __name__ == "__main__":
    sys.exit(_worker_main())
