"""Parity of the device trainer (ONNX Runtime) with an independent PyTorch + PEFT trainer.

`run_parity(cfg)`:

1. ORT side: the device runner `android_runner.loop.train` trains the bundle into REPORT/ort_run.
2. PyTorch side: `eval.reference.reference_train` trains a PEFT model of the same base model
   (loaded from the manifest's model.source through artifacts_gen.source.load_source) from the same
   initial LoRA weights (the bundle's checkpoint, mapped to PEFT keys), on the same micro-batches
   in the same order (rebuilt with ort_trainer.data + DataOrder exactly as the loop builds them),
   with the same hyperparameters (LR schedule, clip, weight decay; AdamW betas/eps from the
   bundle's manifest.optimizer). The adapter is saved with PEFT's save_pretrained to
   REPORT/torch_run/adapter.

   Each side runs in its own subprocess (`python -m eval.parity --worker ort|torch CONFIG`), so the
   peak RSS reported for a side is that process's own ru_maxrss (interpreter, libraries, model and
   training), not a difference of one process's counters.
3. Comparison (in this process): per-step loss curves, final LoRA weights, held-out perplexity of
   base / ORT-trained / PyTorch-trained weights through both backends (so training differences
   and inference differences can be told apart), optional MMLU the same way, speed and memory.
4. eval.report writes report.md, report.json and the plots.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from ort_trainer.bundle import Bundle, open_bundle
from ort_trainer.tokenizer import TextTokenizer
from ort_trainer.records import load_examples
from ort_trainer.batching import data_order, step_batches
from ort_trainer.adapter import to_peft
from ort_trainer.settings import TrainSettings

REPO = Path(__file__).resolve().parents[1]
ORT_RUN = "ort_run"
TORCH_RUN = "torch_run"
TORCH_RESULT = "result.json"
ADAPTER = "adapter"
CONFIG_FILE = "parity_config.json"

THRESHOLDS = {
    "loss_max_rel": 1e-3,        # max over steps of |L_ort - L_torch| / |L_torch|
    "ppl_rel": 5e-3,             # |ppl_ort - ppl_torch| / ppl_torch of the final models (0.5 %)
    "mmlu_points": 0.5,          # |acc_ort - acc_torch| in percentage points
}


class ParityError(RuntimeError):
    pass


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


# --------------------------------------------------------------------------------------------
# Shared definitions: the data both sides train on, and the PyTorch model
# --------------------------------------------------------------------------------------------
def parity_steps(bundle: Bundle, data: str | Path, steps: int, settings: TrainSettings) -> list[list[dict[str, np.ndarray]]]:
    """The micro-batches of each optimizer step, exactly as android_runner.loop builds them."""
    tok = TextTokenizer.from_dir(bundle.tokenizer_dir)
    examples, _ = load_examples(data, tok, bundle.manifest.seq_len)
    order = data_order(examples, settings.seed, settings.micro_batch, settings.group_by_length)
    return [step_batches(examples, order, settings.accum, tok.pad_id) for _ in range(steps)]


def split_source(source: str) -> tuple[Path, str | None]:
    """manifest.model.source -> (directory, gguf file or None)."""
    p = Path(source)
    if p.suffix.lower() == ".gguf":
        return p.parent, p.name
    return p, None


def load_base_model(manifest):
    """The float32 HF base model named by the manifest, through artifacts_gen.source."""
    from artifacts_gen.source import load_source

    path, gguf = split_source(manifest.model.source)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: the bundle's source model (manifest model.source) is not on this "
                                "machine; the PyTorch side needs the checkpoint the bundle was built from")
    return load_source(path, gguf).model


def torch_lora_model(manifest, peft_state: dict[str, np.ndarray] | None = None, base=None):
    """A PEFT model of the base with the manifest's LoRA config, loaded with `peft_state` (PEFT keys)."""
    from .reference import make_peft_model, set_lora_state

    base = load_base_model(manifest) if base is None else base
    lora = manifest.lora
    model = make_peft_model(base, r=lora.r, alpha=lora.alpha, dropout=lora.dropout,
                            target_modules=lora.target_modules, fan_in_fan_out=lora.fan_in_fan_out)
    if peft_state is not None:
        set_lora_state(model, peft_state)
    return model.eval()


# --------------------------------------------------------------------------------------------
# The two training sides (each run in its own subprocess by run_parity)
# --------------------------------------------------------------------------------------------
def ort_side(cfg: ParityConfig, log=print) -> dict:
    from android_runner.loop import RunConfig, train

    rc = RunConfig(**asdict(cfg.train_settings()), bundle=cfg.bundle, data=cfg.data, max_steps=cfg.steps,
                   save_every=cfg.steps, battery="none", threads=cfg.threads)
    return train(rc, Path(cfg.out) / ORT_RUN, log=log, progress=False)


def torch_side(cfg: ParityConfig, log=print) -> dict:
    import torch

    from .ort_scorer import initial_lora
    from .reference import TrainConfig, reference_train

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    out = Path(cfg.out) / TORCH_RUN
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    bundle = open_bundle(cfg.bundle, verify="sizes")
    man = bundle.manifest
    steps = parity_steps(bundle, cfg.data, cfg.steps, cfg)
    model = torch_lora_model(man, to_peft(man, initial_lora(bundle)))
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


def process_peak_rss_mb() -> float:
    """Peak RSS of this process (VmHWM; see android_runner.metrics.peak_rss_mb)."""
    from android_runner.metrics import peak_rss_mb

    return peak_rss_mb()


def _write_rss(cfg: ParityConfig, side: str) -> None:
    (Path(cfg.out) / f"{side}_rss.json").write_text(json.dumps({"peak_rss_mb": process_peak_rss_mb()}))


def _run_in_process(side: str, cfg: ParityConfig, log_path: Path, log) -> float:
    """Run one side in this process (no subprocess start-up; memory numbers are then not per side)."""
    import signal

    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    t0 = time.perf_counter()
    try:
        with open(log_path, "w") as f:
            def to_file(msg):
                print(msg, file=f, flush=True)

            (ort_side if side == "ort" else torch_side)(cfg, to_file)
        _write_rss(cfg, side)
    finally:
        for sig, handler in saved.items():          # the device loop installs its own SIGINT/SIGTERM handlers
            signal.signal(sig, handler)
    wall = time.perf_counter() - t0
    log(f"      done in {wall:.1f} s (in this process; log: {log_path})")
    return wall


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
# Comparison
# --------------------------------------------------------------------------------------------
def rel_diffs(a, b) -> np.ndarray:
    """|a - b| / |b| elementwise (b is the PyTorch reference)."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return np.abs(a - b) / np.maximum(np.abs(b), np.finfo(np.float64).tiny)


def weight_diffs(ort_peft: dict[str, np.ndarray], torch_peft: dict[str, np.ndarray]) -> dict:
    """Per tensor (PEFT key): max |ort - torch| and that relative to max |torch| of the tensor."""
    if set(ort_peft) != set(torch_peft):
        raise ParityError(f"LoRA keys differ: only ORT {sorted(set(ort_peft) - set(torch_peft))[:3]}, "
                          f"only PyTorch {sorted(set(torch_peft) - set(ort_peft))[:3]}")
    tensors = {}
    for k in sorted(torch_peft):
        a, b = np.asarray(ort_peft[k], np.float64), np.asarray(torch_peft[k], np.float64)
        if a.shape != b.shape:
            raise ParityError(f"{k}: shape {a.shape} (ORT) != {b.shape} (PyTorch)")
        d = float(np.abs(a - b).max())
        ref = float(np.abs(b).max())
        tensors[k] = {"max_abs": d, "max_rel": d / ref if ref > 0 else (0.0 if d == 0 else math.inf),
                      "ref_max_abs": ref, "shape": list(b.shape)}
    return {"tensors": tensors,
            "max_abs": max(t["max_abs"] for t in tensors.values()),
            "max_rel": max(t["max_rel"] for t in tensors.values())}


def _read_metrics(run_dir: Path) -> list[dict]:
    rows = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            rows[int(rec["step"])] = rec
    return [rows[s] for s in sorted(rows)]


def _check(name: str, value: float | None, threshold: float, detail: str, unit: str = "") -> dict:
    ok = value is not None and math.isfinite(value) and value <= threshold
    return {"name": name, "value": value, "threshold": threshold, "unit": unit, "pass": bool(ok),
            "status": "PASS" if ok else "FAIL", "detail": detail}


def _versions() -> dict:
    import importlib.metadata as md

    out = {"python": sys.version.split()[0]}
    for pkg in ("onnxruntime-training", "onnxruntime-training-cpu", "onnxruntime", "torch", "transformers", "peft"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    return out


def evaluate(cfg: ParityConfig, bundle: Bundle, ort_lora: dict, torch_lora: dict, log=print) -> dict:
    """Perplexity and MMLU of base / ORT-trained / PyTorch-trained weights through both backends."""
    from .cli import letter_ids, mmlu_max_len, mmlu_summary, ppl_settings, prompt_encoder, text_token_ids
    from .metrics import mmlu_eval, perplexity
    from .ort_scorer import OrtScorer, initial_lora
    from .reference import set_lora_state
    from .torch_scorer import TorchScorer

    man = bundle.manifest
    tok = TextTokenizer.from_dir(bundle.tokenizer_dir)
    weights = {"base": initial_lora(bundle), "ort_trained": ort_lora, "torch_trained": torch_lora}
    ppl_ids = None
    if cfg.heldout:
        seq_len, stride = ppl_settings(bundle, cfg.ppl_seq_len, cfg.ppl_stride)
        ppl_ids = text_token_ids(cfg.heldout, tok, cfg.heldout_max_tokens)
    ppl: dict = {}
    mmlu: dict = {}
    seconds = {"ort": 0.0, "torch": 0.0}
    torch_model = None

    def score(backend: str, label: str, scorer) -> None:
        t0 = time.perf_counter()
        if ppl_ids is not None:
            r = perplexity(scorer, ppl_ids, seq_len, stride, pad_id=tok.pad_id)
            ppl.setdefault(label, {})[backend] = {"ppl": r.ppl, "nll_sum": r.nll_sum, "tokens": r.tokens,
                                                  "windows": r.windows}
        if cfg.mmlu_data:
            r = mmlu_eval(scorer, prompt_encoder(tok), cfg.mmlu_data, subjects=cfg.mmlu_subjects or None,
                          split=cfg.mmlu_split, shots=cfg.shots, max_len=mmlu_max_len(bundle),
                          letter_ids=letter_ids(tok), limit_per_subject=cfg.mmlu_limit, pad_id=tok.pad_id)
            summary = mmlu_summary(r)
            summary["preds"] = [p["pred"] for p in r.predictions]
            mmlu.setdefault(label, {})[backend] = summary
        seconds[backend] += time.perf_counter() - t0

    ort_scorer = None
    for label, lora in weights.items():
        log(f"      {label}: ORT")
        if ort_scorer is None:
            ort_scorer = OrtScorer(bundle, lora)
        else:
            ort_scorer.set_lora(lora)
        score("ort", label, ort_scorer)
        log(f"      {label}: PyTorch")
        if torch_model is None:
            torch_model = torch_lora_model(man, to_peft(man, lora))
        else:
            set_lora_state(torch_model, to_peft(man, lora))
        score("torch", label, TorchScorer(torch_model))

    out: dict = {"eval_seconds": {k: round(v, 3) for k, v in seconds.items()}}
    if ppl_ids is not None:
        first = ppl["base"]["ort"]
        out["perplexity"] = {"data": cfg.heldout, "text_tokens": int(len(ppl_ids)), "tokens": first["tokens"],
                             "windows": first["windows"], "seq_len": seq_len, "stride": stride, "matrix": ppl}
    if cfg.mmlu_data:
        out["mmlu"] = {"data": cfg.mmlu_data, "split": cfg.mmlu_split, "shots": cfg.shots,
                       "limit_per_subject": cfg.mmlu_limit, "max_len": mmlu_max_len(bundle), "matrix": mmlu}
    return out


def run_parity(cfg: ParityConfig, log=print) -> dict:
    cfg = cfg.absolute()
    cfg.validate()
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    for sub in (ORT_RUN, TORCH_RUN):
        if (out / sub).exists():
            if not cfg.force:
                raise FileExistsError(f"{out / sub} exists from an earlier parity run; pass --force to replace it "
                                      "or choose another --out")
            shutil.rmtree(out / sub)
    bundle = open_bundle(cfg.bundle)            # full hash check once; the workers check sizes
    man = bundle.manifest
    config_path = out / CONFIG_FILE
    config_path.write_text(json.dumps(asdict(cfg), indent=1) + "\n")

    def run_side(side: str) -> float:
        if cfg.isolate:
            return _run_worker(side, config_path, out / f"{side}_run.log", log)
        return _run_in_process(side, cfg, out / f"{side}_run.log", log)

    log(f"[1/4] ORT device runner: {cfg.steps} steps ({cfg.accum} x {cfg.micro_batch} per step) -> {out / ORT_RUN}")
    ort_wall = run_side("ort")
    log(f"[2/4] PyTorch + PEFT reference, same batches and settings -> {out / TORCH_RUN}")
    torch_wall = run_side("torch")

    from .ort_scorer import lora_from_peft, lora_from_run
    from safetensors.numpy import load_file

    summary = json.loads((out / ORT_RUN / "summary.json").read_text())
    if not summary.get("finished"):
        raise ParityError(f"the ORT run stopped at step {summary.get('step')}/{cfg.steps}")
    metrics = _read_metrics(out / ORT_RUN)
    tres = json.loads((out / TORCH_RUN / TORCH_RESULT).read_text())
    ort_losses = [float(m["loss"]) for m in metrics]
    torch_losses = [float(x) for x in tres["losses"]]
    if len(ort_losses) != cfg.steps or len(torch_losses) != cfg.steps:
        raise ParityError(f"expected {cfg.steps} losses, got {len(ort_losses)} (ORT) and {len(torch_losses)} (PyTorch)")
    rel = rel_diffs(ort_losses, torch_losses)

    ort_lora, ort_step = lora_from_run(out / ORT_RUN, man, warn=log)
    torch_lora = lora_from_peft(out / TORCH_RUN / ADAPTER, man)
    torch_peft_file = load_file(str(out / TORCH_RUN / ADAPTER / "adapter_model.safetensors"))
    wd = weight_diffs(to_peft(man, ort_lora), torch_peft_file)

    log("[3/4] evaluation: base / ORT-trained / PyTorch-trained weights through ORT and PyTorch")
    ev = evaluate(cfg, bundle, ort_lora, torch_lora, log=log)

    checks = [_check("loss_curve_max_rel_diff", float(rel.max()), THRESHOLDS["loss_max_rel"],
                     f"max over {cfg.steps} steps of |L_ort - L_torch| / |L_torch| (mean {float(rel.mean()):.3g})")]
    notes = []
    ppl_block = ev.get("perplexity")
    if ppl_block:
        m = ppl_block["matrix"]
        p_ort, p_torch = m["ort_trained"]["ort"]["ppl"], m["torch_trained"]["torch"]["ppl"]
        d = abs(p_ort - p_torch) / p_torch
        ppl_block["final_rel_diff"] = d
        ppl_block["training_rel_diff"] = abs(m["ort_trained"]["torch"]["ppl"] - p_torch) / p_torch
        ppl_block["inference_rel_diff"] = abs(m["ort_trained"]["ort"]["ppl"] - m["ort_trained"]["torch"]["ppl"]) / \
            m["ort_trained"]["torch"]["ppl"]
        ppl_block["base_rel_diff"] = abs(m["base"]["ort"]["ppl"] - m["base"]["torch"]["ppl"]) / \
            m["base"]["torch"]["ppl"]
        checks.append(_check("final_ppl_rel_diff", d, THRESHOLDS["ppl_rel"],
                             f"held-out ppl, ORT-trained LoRA in ORT {p_ort:.6g} vs PyTorch-trained in PyTorch "
                             f"{p_torch:.6g}"))
    else:
        notes.append("no --heldout file: the perplexity check was not run")
    mm = ev.get("mmlu")
    if mm:
        m = mm["matrix"]
        for label, a, b in (("base", ("base", "ort"), ("base", "torch")),
                            ("finetuned", ("ort_trained", "ort"), ("torch_trained", "torch"))):
            ra, rb = m[a[0]][a[1]], m[b[0]][b[1]]
            diff = 100 * abs(ra["micro"] - rb["micro"])
            agree = float(np.mean([x == y for x, y in zip(ra["preds"], rb["preds"])])) if ra["preds"] else float("nan")
            mm[f"{label}_points_diff"] = diff
            mm[f"{label}_prediction_agreement"] = agree
            checks.append(_check(f"mmlu_{label}_points_diff", diff, THRESHOLDS["mmlu_points"],
                                 f"micro accuracy ORT {100 * ra['micro']:.2f}% vs PyTorch {100 * rb['micro']:.2f}% "
                                 f"({a[0]} in ORT vs {b[0]} in PyTorch; same answer on {100 * agree:.1f}% of "
                                 "questions)", unit="points"))
    if man.lora.dropout > 0:
        notes.append(f"the bundle's LoRA dropout is {man.lora.dropout}: the two sides draw different dropout "
                     "masks, so their loss curves cannot match step for step")

    ort_train_s = float(sum(float(m["step_s"]) for m in metrics))
    timing = ("train_s = time inside optimizer steps (ORT: sum of the loop's step_s; PyTorch: reference_train's "
              "loop with batches prebuilt); tokens/s = real (attention-mask) tokens / train_s; runner_peak_rss_mb "
              "is the device runner's own summary figure (ru_maxrss, which on Linux a subprocess inherits from "
              "its parent at fork, so it can overstate)")
    rss = {side: json.loads((out / f"{side}_rss.json").read_text())["peak_rss_mb"] for side in ("ort", "torch")}
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
        "ort": {"train_s": ort_train_s, "loop_wall_s": summary.get("wall_s"), "process_wall_s": ort_wall,
                "tokens": summary.get("tokens_this_session"),
                "tokens_per_s": summary["tokens_this_session"] / ort_train_s if ort_train_s > 0 else None,
                "peak_rss_mb": rss["ort"], "runner_peak_rss_mb": summary.get("peak_rss_mb"),
                "threads": cfg.threads or "ORT default"},
        "torch": {"train_s": tres["train_s"], "setup_s": tres["setup_s"], "process_wall_s": torch_wall,
                  "tokens": tres["tokens"],
                  "tokens_per_s": tres["tokens"] / tres["train_s"] if tres["train_s"] > 0 else None,
                  "peak_rss_mb": rss["torch"], "threads": tres["threads"]},
        "eval_seconds": ev["eval_seconds"],
    }
    report = {
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
        "loss": {"steps": [int(m["step"]) for m in metrics], "ort": ort_losses, "torch": torch_losses,
                 "rel_diff": [float(x) for x in rel], "max_rel_diff": float(rel.max()),
                 "mean_rel_diff": float(rel.mean()),
                 "lr_ort": [float(m["lr"]) for m in metrics], "lr_torch": tres["lrs"],
                 "grad_norm_ort": [float(m["grad_norm"]) for m in metrics], "grad_norm_torch": tres["grad_norms"],
                 "label_tokens": tres["label_tokens"]},
        "weights": {"ort_step": ort_step, **wd},
        "perplexity": ppl_block,
        "mmlu": mm,
        "perf": perf,
        "data_report": summary.get("data_report"),
        "versions": _versions(),
        "notes": notes,
    }
    from .report import write_report

    log("[4/4] report")
    paths = write_report(report, out)
    log(f"      {paths['md']}")
    return report


# --------------------------------------------------------------------------------------------
# Worker entry point: python -m eval.parity --worker ort|torch CONFIG.json
# --------------------------------------------------------------------------------------------
def _worker_main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m eval.parity")
    ap.add_argument("--worker", choices=["ort", "torch"], required=True)
    ap.add_argument("config")
    args = ap.parse_args(argv)
    cfg = ParityConfig(**json.loads(Path(args.config).read_text()))

    def log(msg):
        print(msg, flush=True)

    if args.worker == "ort":
        ort_side(cfg, log)
    else:
        torch_side(cfg, log)
    _write_rss(cfg, args.worker)
    return 0


if __name__ == "__main__":
    sys.exit(_worker_main())
