"""The device's side of a federated run, independent of Flower (apps.py wraps it in a ClientApp).

DIR/devices/device-NNN/
    data/            the device's private data (federated.data), written by the device itself
    gate.json        the gate's state at each round (kept across rounds: PAUSED/COOLING have hysteresis)
    round-RRR/       one round's local training: a run of the device loop (checkpoints, metrics, summary)
    local-only/      the baseline: the device alone, as many steps as all rounds together, from the bundle's init
    personalized/    the global adapter fine-tuned on the device's data after the last round
    device.log

A round's local training is `android_runner.loop.train` (the battery gate and the kill-safe checkpoints of
any device run), started from the global LoRA tensors; run again after a kill, it resumes from its checkpoint.
"""
from __future__ import annotations

import csv
import hashlib
import json
import os
import shutil
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from android_runner.gate import Decision, GateConfig, GateState, GateTracker
from android_runner.loop import METRICS, RunConfig, train
from android_runner.probes import ReplayProbe, make_probe
from ort_trainer import checkpoint
from ort_trainer import manifest as mf
from ort_trainer.adapter import load_lora
from ort_trainer.bundle import Bundle, open_bundle
from ort_trainer.memory import trim_heap

from . import data as fdata
from .aggregate import a_names, b_names
from .config import FederateConfig

GATE = "gate.json"
START = "start.sha256"
LOCAL_ONLY = "local-only"
PERSONALIZED = "personalized"


def device_dir(out: str | Path, device: int) -> Path:
    return Path(out) / "devices" / f"device-{device:03d}"


def _logger(ddir: Path):
    ddir.mkdir(parents=True, exist_ok=True)

    def log(msg: str) -> None:
        with open(ddir / "device.log", "a") as f:
            f.write(f"{time.strftime('%H:%M:%S')} {msg}\n")
    return log


def _write_json(path: Path, obj) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=1))
    tmp.replace(path)


def ensure_data(cfg: FederateConfig, out: str | Path, device: int) -> Path:
    d = device_dir(out, device) / "data"
    if not (d / fdata.TRAIN).is_file():
        fdata.write_device_data(d, device, cfg.qa_repeats, cfg.private_facts)
    return d


def fingerprint(tensors: dict[str, np.ndarray]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(np.ascontiguousarray(tensors[name], dtype=np.float32).tobytes())
    return h.hexdigest()


# -- the battery gate, per round ------------------------------------------------------------------

class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def reading_at(spec: str, t_s: float):
    """The battery now (a real probe), or a replayed trace at trace time `t_s`."""
    if spec.startswith("replay:"):
        path = spec[len("replay:"):].rpartition("@")[0] or spec[len("replay:"):]
        clock = _Clock()
        probe = ReplayProbe(path, clock=clock)
        probe.read()                  # starts the replay at trace time 0
        clock.t = t_s
        return probe.read()
    return make_probe(spec, log=lambda *_: None).read()


def gate_for_round(cfg: FederateConfig, out: str | Path, device: int, rnd: int) -> Decision:
    """The gate's decision at the start of round `rnd` (1-based; rounds + 1 is the final phase), from the state it
    was in at the previous round. PAUSED or COOLING: the device declines the round."""
    ddir = device_dir(out, device)
    ddir.mkdir(parents=True, exist_ok=True)
    path = ddir / GATE
    states = json.loads(path.read_text()) if path.exists() else {}
    earlier = [int(k) for k in states if int(k) < rnd]
    prev = GateState(states[str(max(earlier))]["state"]) if earlier else GateState.FULL
    reading = reading_at(cfg.battery_of(device), (rnd - 1) * cfg.round_s)
    decision = GateTracker(GateConfig(**cfg.gate), initial=prev).update(reading, 0.0, now=0.0)
    states[str(rnd)] = {"state": decision.state.value, "reason": decision.reason, "percent": reading.percent,
                        "charging": reading.charging, "temp_c": reading.temp_c}
    _write_json(path, states)
    return decision


def _round_battery(spec: str, t0: float, run_dir: Path, speed: float) -> str:
    """The loop's probe for a run starting at trace time t0: a replay is cut at t0 into the run's own trace."""
    if not spec.startswith("replay:"):
        return spec
    src = Path(spec[len("replay:"):].rpartition("@")[0] or spec[len("replay:"):])
    with src.open(newline="") as f:
        rows = list(csv.DictReader(f))
    fields = list(rows[0].keys())
    times = [float(r["t_s"]) for r in rows]
    first = max([i for i, t in enumerate(times) if t <= t0] or [0])
    dst = run_dir / "battery.csv"
    with dst.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for i in range(first, len(rows)):
            w.writerow({**rows[i], "t_s": f"{max(0.0, times[i] - t0):g}"})
    return f"replay:{dst}@{speed:g}"


# -- local training -------------------------------------------------------------------------------

def freeze(session, names: list[str]) -> None:
    """Freeze these LoRA tensors in an ORT TrainSession: their gradients are zeroed after every forward/backward
    (the `grad` arrays are views of ORT's buffers), so the grad norm, clipping and AdamW see none; with zero
    moments and no weight decay AdamW leaves them exactly as they are."""
    forward_backward = session.forward_backward

    def frozen_forward_backward(batch, loss_scale):
        loss = forward_backward(batch, loss_scale)
        params = session.state.parameters
        for n in names:
            g = params[n].grad
            if g is not None:
                g[...] = 0.0
        return loss
    session.forward_backward = frozen_forward_backward


def local_run(cfg: FederateConfig, bundle: Bundle, run_dir: Path, data: Path, steps: int, seed: int,
              start: dict[str, np.ndarray] | None, frozen: list[str], device: int, t0: float,
              log) -> tuple[dict, dict]:
    """Train `steps` steps with the device loop from `start` (None: the bundle's init) into run_dir, the battery
    replayed from trace time t0; (the LoRA tensors, the run's numbers). Rerun after a kill, it resumes; a run_dir
    left by another start is replaced."""
    mark = fingerprint(start) if start is not None else "bundle-init"
    if (run_dir / START).exists() and (run_dir / START).read_text() != mark:
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / START).write_text(mark)
    battery = _round_battery(cfg.battery_of(device), t0, run_dir, cfg.trace_speed)
    run_cfg = RunConfig(**{**asdict(cfg.train_settings()), "seed": seed}, bundle=str(cfg.bundle),
                        data=str(data / fdata.TRAIN), max_steps=steps, save_every=cfg.save_every, battery=battery,
                        gate=dict(cfg.gate), threads=cfg.threads)
    initial = {}

    def on_session(session, from_checkpoint: bool) -> None:
        initial.update(session.lora())
        if start is not None and not from_checkpoint:
            session.set_lora({**initial, **start})
            initial.update(start)
        if frozen:
            freeze(session, frozen)

    summary = train(run_cfg, run_dir, log=log, progress=False, on_session=on_session)
    if not summary["finished"]:
        raise RuntimeError(f"{run_dir}: the local run stopped at step {summary['step']}/{steps} "
                           f"({summary['stopped_by']}); rerun to resume it")
    path, _ = checkpoint.latest(run_dir)
    lora = load_lora(path / checkpoint.ORT_FILE, bundle.manifest)
    steps_log = [json.loads(line) for line in (run_dir / METRICS).read_text().splitlines() if line.strip()]
    stats = {
        "loss": float(np.mean([s["loss"] for s in steps_log])) if steps_log else float("nan"),
        "tokens": int(sum(s["label_tokens"] for s in steps_log)),
        "examples": int(summary["data_report"]["examples"]),
        "steps": len(steps_log),
        "wall_s": summary["wall_s"],
    }
    return lora, stats


def train_round(cfg: FederateConfig, out: str | Path, device: int, rnd: int,
                start: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], dict]:
    """One round on this device: local_steps of the device loop from the global tensors in `start` (for FFA only
    B: A is the bundle's init, shared by all). Returns what it sends (FFA: B only) and its numbers."""
    ddir = device_dir(out, device)
    log = _logger(ddir)
    data = ensure_data(cfg, out, device)
    bundle = open_bundle(cfg.bundle, verify="none")
    man = bundle.manifest
    frozen = a_names(man) if cfg.strategy == "ffa" else []
    lora, stats = local_run(cfg, bundle, ddir / f"round-{rnd:03d}", data, cfg.local_steps,
                            cfg.seed + 1000 * rnd + device, start, frozen, device, (rnd - 1) * cfg.round_s, log)
    if frozen:
        init = load_lora(bundle.file(mf.CHECKPOINT), man)
        moved = [n for n in frozen if not np.array_equal(lora[n], init[n])]
        if moved:
            raise RuntimeError(f"FFA-LoRA: {len(moved)} frozen A tensors changed in local training ({moved[0]})")
    for old in sorted(ddir.glob("round-*"))[:-2]:     # keep this round and the one before
        shutil.rmtree(old, ignore_errors=True)
    send = b_names(man) if cfg.strategy == "ffa" else man.trainable_names
    log(f"round {rnd}: {stats['steps']} steps, loss {stats['loss']:.4f}, {stats['tokens']} label tokens")
    return {n: lora[n] for n in send}, stats


# -- evaluation and personalization ---------------------------------------------------------------

def _held_out(path: Path) -> list[tuple[str, str]]:
    """(question, answer) of each record of a held-out chat .jsonl file."""
    return [(r["messages"][0]["content"], r["messages"][1]["content"])
            for r in map(json.loads, path.read_text().splitlines()) if r]


def evaluate_adapters(bundle: Bundle, adapters: dict[str, dict[str, np.ndarray]], files: dict[str, Path],
                      threads: int = 1, batch: int = 16, max_new_tokens: int = 16) -> dict[str, float]:
    """Every adapter on every held-out chat file: mean NLL per answer token and next-token accuracy (teacher-forced,
    the eval graph), then exact match of the greedy answer (the bundle's KV-cache decoder, as the demo scores).
    The two sessions run one after the other, the first released before the second is built: each holds its own
    prepacked copy of the weights. -> {"<adapter>/<split>/loss|acc|em": value}."""
    from eval.answers import answers, exact
    from ort_trainer.batching import collate
    from ort_trainer.decoder import Decoder
    from ort_trainer.records import load_examples
    from ort_trainer.session import EvalSession, RuntimeOptions
    from ort_trainer.tokenizer import TextTokenizer

    tok = TextTokenizer.from_dir(bundle.tokenizer_dir)
    adapters = {name: {n: np.ascontiguousarray(v, dtype=np.float32) for n, v in lora.items()}
                for name, lora in adapters.items()}
    out: dict[str, float] = {}
    session = EvalSession(bundle, {}, RuntimeOptions(threads))
    for split, path in files.items():
        examples = load_examples(path, tok, bundle.manifest.seq_len)[0]
        for name, lora in adapters.items():
            session.lora = lora
            nll, right, n = 0.0, 0, 0
            for i in range(0, len(examples), batch):
                b = collate(examples[i:i + batch], tok.pad_id)
                loss, logits = session.run(b, 1.0)
                shifted = b["labels"][:, 1:]
                targets = shifted[shifted != -100]
                if len(targets) != len(logits):
                    raise RuntimeError(f"eval: {len(logits)} logits rows for {len(targets)} label tokens")
                nll += loss
                right += int(np.sum(np.argmax(logits, axis=-1) == targets))
                n += len(targets)
            out[f"{name}/{split}/loss"], out[f"{name}/{split}/acc"] = nll / max(n, 1), right / max(n, 1)
    del session
    trim_heap()
    decoder = Decoder(bundle, RuntimeOptions(threads))
    for split, path in files.items():
        qa = _held_out(path)
        for name, lora in adapters.items():
            decoder.use_adapter(lora)
            said = answers(decoder, tok, [q for q, _ in qa], max_new_tokens, batch)
            out[f"{name}/{split}/em"] = sum(exact(a, want) for a, (_, want) in zip(said, qa)) / max(len(qa), 1)
    return out


def final_phase(cfg: FederateConfig, out: str | Path, device: int, global_lora: dict[str, np.ndarray]) -> dict:
    """After the last round: the device's held-out questions (shared app facts, private facts) under the base
    model, the global adapter, a local-only adapter (this device alone, rounds x local_steps steps from the
    bundle's init) and the global adapter fine-tuned here for personalize_steps (federated + personalized)."""
    ddir = device_dir(out, device)
    log = _logger(ddir)
    data = ensure_data(cfg, out, device)
    bundle = open_bundle(cfg.bundle, verify="none")
    man = bundle.manifest
    init = load_lora(bundle.file(mf.CHECKPOINT), man)
    full_global = {**init, **global_lora}
    t_final = cfg.rounds * cfg.round_s
    adapters = {"base": init, "global": full_global}      # the bundle's init: B = 0, the base model
    steps = {}
    for name, start, n_steps, seed in ((LOCAL_ONLY, None, cfg.rounds * cfg.local_steps, cfg.seed + device),
                                       (PERSONALIZED, full_global, cfg.personalize, cfg.seed + 7919 + device)):
        if n_steps == 0:
            continue
        adapters[name], stats = local_run(cfg, bundle, ddir / name, data, n_steps, seed, start, [], device, t_final,
                                          log)
        steps[name] = stats["steps"]
    result = {"device": device, "person_seed": fdata.person_seed(device), "steps": steps}
    trim_heap()          # the local runs' sessions are gone; give their pages back before evaluating
    result.update(evaluate_adapters(bundle, adapters, {"shared": data / fdata.HELDOUT_SHARED,
                                                       "private": data / fdata.HELDOUT_PRIVATE}, cfg.threads))
    log(f"final phase: {json.dumps(result)}")
    return result
