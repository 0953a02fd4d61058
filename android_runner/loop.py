"""The on-device run: resume, gate, step, log, checkpoint, signals. Read it top to bottom.

Running the same command again on an existing RUN resumes from its last good checkpoint with
the same data order; the settings that define the training (data, seed, batch, schedule, ...)
are fixed by the first start and a different value on the command line is refused.
"""
from __future__ import annotations

import json
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from ort_trainer import checkpoint
from ort_trainer.bundle import blame_damage, open_bundle
from ort_trainer.faults import write_atomic
from ort_trainer.tokenizer import TextTokenizer
from ort_trainer.records import load_examples
from ort_trainer.batching import data_order, step_batches
from ort_trainer.memory import trim_heap
from ort_trainer.optimizer_graph import AdamWSpec
from ort_trainer.schedule import lr_at
from ort_trainer.session import RuntimeOptions, TrainSession
from ort_trainer.settings import NAMES as SETTINGS, SettingsError, TrainSettings
from ort_trainer.step import train_step

from .gate import GateConfig, GateState, GateTracker
from .memory_fit import MemoryBudgetError, fit_session, parse_budget
from .metrics import EnergyMeter, MetricsLog, peak_rss_mb, rss_mb, torch_in_process
from .probes import SafeProbe, make_probe

RUN_CONFIG = "run.json"
METRICS = "metrics.jsonl"
SUMMARY = "summary.json"


class RunError(ValueError):
    pass


@dataclass(kw_only=True)
class RunConfig(TrainSettings):
    """A device run: the training settings, what to train on, and how this device runs it."""
    bundle: str
    data: str
    epochs: int | None = None
    max_steps: int | None = None
    save_every: int = 50
    # Not part of the training's definition: may change between resumes.
    battery: str = "auto"
    gate: dict = field(default_factory=lambda: asdict(GateConfig()))
    threads: int = 0
    memory: str = "normal"
    memory_budget: str | None = None   # MiB or "auto": split the effective batch by measuring (memory_fit.py)

    FIXED = ("bundle", "data", "epochs", "max_steps", *SETTINGS)

    def validate(self) -> None:
        if (self.epochs is None) == (self.max_steps is None):
            raise RunError("give exactly one of --epochs N or --max-steps N")
        try:
            super().validate()
        except SettingsError as e:
            raise RunError(str(e)) from None
        if self.save_every < 1:
            raise RunError("--save-every must be >= 1")
        if self.memory_budget is not None:
            parse_budget(self.memory_budget)
        GateConfig(**self.gate).validate()


def _settle_config(run_dir: Path, cfg: RunConfig) -> tuple[RunConfig, bool]:
    """A resumed run's recorded training settings win; conflicts are errors. (True if resuming.)"""
    path = run_dir / RUN_CONFIG
    if not path.exists():
        return cfg, False
    saved = read_run_config(run_dir)
    if saved.get("runner", "python") != "python":
        raise RunError(f"{run_dir} is a run of the {saved['runner']} runner; continue it with that runner "
                       "(android_runner/web/cli.mjs), or train into a new --out")
    if cfg.memory_budget is not None and saved["micro_batch"] * saved["accum"] == cfg.micro_batch * cfg.accum:
        cfg.micro_batch, cfg.accum = saved["micro_batch"], saved["accum"]   # the split measured at the first start
    for name in RunConfig.FIXED:   # a setting added later is absent from older runs: its default applies
        if getattr(cfg, name) != saved.get(name, getattr(RunConfig, name, None)):
            raise RunError(
                f"{run_dir} was started with {name}={saved.get(name)!r}, not {getattr(cfg, name)!r}. "
                f"To resume, repeat the original settings; to change them, train into a new --out."
            )
    return cfg, True


def read_run_config(run_dir: Path) -> dict:
    """RUN/run.json, the settings the run was started with, checked; RunError naming it if it is damaged."""
    path = Path(run_dir) / RUN_CONFIG
    try:
        saved = json.loads(path.read_bytes())
        if not isinstance(saved, dict):
            raise TypeError(f"a JSON {type(saved).__name__}, not an object")
        known = {f.name for f in fields(RunConfig)}
        RunConfig(**{k: v for k, v in saved.items() if k in known}).validate()
    except (UnicodeDecodeError, json.JSONDecodeError, TypeError, ValueError) as exc:
        raise RunError(f"{path}: damaged ({exc}). It records the settings the run was started with: restore it "
                       "from a copy, or train into a new --out.") from exc
    return saved


def _record_config(run_dir: Path, cfg: RunConfig) -> None:
    write_atomic(run_dir / RUN_CONFIG, json.dumps(asdict(cfg), indent=1))


class StopFlag:
    """Set by SIGTERM/SIGINT; the loop finishes its micro-batch, checkpoints and exits 0."""

    def __init__(self):
        self.event = threading.Event()
        self.signal_name = None

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.signal_name = signal.Signals(signum).name
        self.event.set()

    def __call__(self) -> bool:
        return self.event.is_set()

    def sleep(self, seconds: float) -> None:
        self.event.wait(seconds)


def train(cfg: RunConfig, run_dir: str | Path, log=print, progress: bool | None = None,
          on_session=None) -> dict:
    """`on_session(session, from_checkpoint)`, if given, is called once the session exists, and again for the new
    session if the memory fit starts one (federated/: start from the global LoRA unless resumed from a checkpoint,
    freeze LoRA A)."""
    run_dir = Path(run_dir)
    cfg.validate()
    if run_dir.exists() and not run_dir.is_dir():
        raise RunError(f"--out {run_dir}: exists and is not a directory. Choose another --out.")
    cfg, resuming = _settle_config(run_dir, cfg)
    run_dir.mkdir(parents=True, exist_ok=True)

    # -- bundle, data, session ---------------------------------------------------------------
    bundle = open_bundle(cfg.bundle, verify="sizes" if resuming else "hashes")
    man = bundle.manifest
    with blame_damage(bundle):
        tok = TextTokenizer.from_dir(bundle.tokenizer_dir)
    examples, report = load_examples(cfg.data, tok, man.seq_len)
    pad_id = tok.pad_id
    del tok          # only the data needed it: its memory goes back before the session allocates
    trim_heap()
    log(report.summary())
    found = checkpoint.latest(run_dir, warn=log) if resuming else None
    adamw = AdamWSpec(**{**man.optimizer, "clip": cfg.clip, "weight_decay": cfg.weight_decay})

    def start_session() -> TrainSession:
        s = TrainSession(bundle, found[0] / checkpoint.ORT_FILE if found else None, adamw,
                         RuntimeOptions(cfg.threads, cfg.memory), work_dir=run_dir)
        if on_session is not None:
            on_session(s, found is not None)
        return s

    session = start_session()
    fit = None
    if cfg.memory_budget is not None and not resuming:
        try:
            fit = fit_session(session, man.seq_len, cfg.micro_batch * cfg.accum, parse_budget(cfg.memory_budget),
                              log, anonymous=cfg.memory == "low")
        except MemoryBudgetError as e:
            raise RunError(str(e)) from None
        cfg.micro_batch, cfg.accum = fit.micro_batch, fit.accum
        if fit.needs_new_session:           # ORT's arena keeps what the largest measured pass needed
            log(f"starting a new session for micro-batch {fit.micro_batch}: the measured one holds "
                f"{max(fit.measured_mb)} sequences' memory")
            del session
            trim_heap()                      # (collects first: federated's freeze puts the session in a cycle)
            session = start_session()
    elif cfg.memory_budget is not None:
        log(f"--memory-budget: keeping the split measured at the first start, {cfg.micro_batch} x {cfg.accum}")
    if not resuming:
        _record_config(run_dir, cfg)

    order = data_order(examples, cfg.seed, cfg.micro_batch, cfg.group_by_length)
    steps_per_epoch = max(1, order.steps_per_epoch() // cfg.accum)
    total = cfg.max_steps or cfg.epochs * steps_per_epoch
    step = 0
    if found:
        path, state = found
        step = state["step"]
        order.load_state_dict(state["data"])
        log(f"resuming {run_dir} at step {step}/{total} from {path.name}")
    metrics = MetricsLog(run_dir / METRICS, keep_through_step=step)

    # -- gate and signals ----------------------------------------------------------------------
    probe = SafeProbe(make_probe(cfg.battery, log=log), warn=log)
    log(f"battery probe: {getattr(probe.inner, 'chosen_because', probe.inner.name)}")
    tracker = GateTracker(GateConfig(**cfg.gate))
    energy = EnergyMeter()
    stop = StopFlag()
    stop.install()

    def save(reason: str) -> None:
        checkpoint.save(run_dir, session, {"step": step, "total_steps": total, "data": order.state_dict(),
                                           "seed": cfg.seed, "reason": reason})

    bar = None
    if progress if progress is not None else sys.stderr.isatty():
        from tqdm import tqdm

        bar = tqdm(total=total, initial=step, unit="step", desc="training")
    t_start, last_step_s, saved_at, tokens_total = time.time(), 0.0, step, 0
    while step < total and not stop():
        reading = probe.read()
        energy.add(reading, time.time())
        decision = tracker.update(reading, last_step_s)
        if decision.changed:
            log(f"gate: {decision.state.value} ({decision.reason})")
        if not decision.run_step:                    # paused or cooling: keep the work safe, then wait
            if saved_at != step:
                save(f"gate {decision.state.value}")
                saved_at = step
            stop.sleep(decision.sleep_s)
            continue

        position = order.state_dict()
        micro = step_batches(examples, order, cfg.accum, pad_id)
        lr = lr_at(step, cfg.lr, cfg.warmup, total, cfg.schedule)
        result = train_step(session, micro, lr, should_stop=stop)
        if result is None:                           # signal mid-step: that step runs again on resume
            order.load_state_dict(position)
            break
        step += 1
        last_step_s, tokens_total = result.seconds, tokens_total + result.tokens
        metrics.write({
            "step": step, "loss": result.loss, "lr": lr, "grad_norm": result.grad_norm,
            "tokens": result.tokens, "label_tokens": result.label_tokens,
            "step_s": round(result.seconds, 4), "tokens_per_s": round(result.tokens / result.seconds, 1),
            "rss_mb": round(rss_mb(), 1), "battery_percent": reading.percent, "charging": reading.charging,
            "temp_c": reading.temp_c, "gate": decision.state.value, "time": round(time.time(), 3),
        })
        if bar:
            bar.set_postfix(loss=f"{result.loss:.4f}", gate=decision.state.value)
            bar.update(1)
        if step % cfg.save_every == 0 or step == total:
            save("periodic" if step < total else "final")
            saved_at = step
        if decision.state is GateState.SLOW and decision.sleep_s > 0:
            stop.sleep(decision.sleep_s)

    if saved_at != step:
        save(f"signal {stop.signal_name}" if stop() else "final")
    if bar:
        bar.close()
    metrics.close()
    tracker.finish()
    wall = time.time() - t_start
    summary = {
        "run": str(run_dir), "bundle": cfg.bundle, "data": cfg.data, "finished": step >= total,
        "stopped_by": stop.signal_name, "step": step, "total_steps": total,
        "wall_s": round(wall, 2), "tokens_this_session": tokens_total,
        "tokens_per_s": round(tokens_total / wall, 1) if wall > 0 else None,
        "peak_rss_mb": round(peak_rss_mb(), 1),
        "torch_in_process": torch_in_process(),
        "memory_fit": fit.to_dict() if fit else None, "gate": tracker.summary(), **energy.summary(wall),
        "data_report": asdict(report),
    }
    write_atomic(run_dir / SUMMARY, json.dumps(summary, indent=1, default=str))
    log(f"{'finished' if summary['finished'] else 'stopped'} at step {step}/{total} in {wall:.1f} s; "
        f"summary in {run_dir / SUMMARY}")
    return summary
