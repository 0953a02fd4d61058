"""The device run loop: resume, signals, SIGKILL at random moments, damaged checkpoints, the gate."""
from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest

from android_runner.gate import GateConfig
from android_runner.loop import RunConfig, RunError, train
from ort_trainer.settings import to_argv
from ort_trainer import checkpoint
from ort_trainer.adapter import load_lora
from tests.bundle_helpers import build_tiny_bundle
from tests.conftest import REPO

TOTAL = 24


@pytest.fixture(scope="module")
def setup(tmp_path_factory, shared_data):
    root = tmp_path_factory.mktemp("loop")
    ckpt, bundle = build_tiny_bundle("gpt2", root)
    text = (shared_data / "wikitext2" / "valid.txt").read_text().splitlines()[:120]
    data = root / "train.txt"
    data.write_text("\n".join(text))
    return bundle, data, root


def _cfg(bundle, data, **kw) -> RunConfig:
    base = dict(bundle=str(bundle), data=str(data), max_steps=TOTAL, micro_batch=2, accum=2, lr=5e-3, warmup=3,
                save_every=4, battery="none", threads=1)
    base.update(kw)
    return RunConfig(**base)


def _cli_args(cfg: RunConfig, out: Path) -> list[str]:
    return [sys.executable, "-m", "pocketlora_cli", "train", "--bundle", cfg.bundle, "--data", cfg.data,
            "--out", str(out), "--max-steps", str(cfg.max_steps), *to_argv(cfg.train_settings()),
            "--save-every", str(cfg.save_every), "--battery", cfg.battery, "--threads", str(cfg.threads)]


def _final_lora(run: Path, bundle: Path):
    from ort_trainer.bundle import open_bundle

    path, state = checkpoint.latest(run)
    return state["step"], load_lora(path / checkpoint.ORT_FILE, open_bundle(bundle, verify="none").manifest)


def _steps_logged(run: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def straight(setup):
    """The uninterrupted run every interrupted one must reproduce."""
    bundle, data, root = setup
    run = root / "straight"
    summary = train(_cfg(bundle, data), run, log=lambda *_: None)
    assert summary["finished"] and summary["step"] == TOTAL
    return run


def test_straight_run_reports_and_resumes_as_done(setup, straight):
    bundle, data, _ = setup
    assert _steps_logged(straight) == list(range(1, TOTAL + 1))
    rec = json.loads((straight / "metrics.jsonl").read_text().splitlines()[-1])
    for key in ("loss", "lr", "grad_norm", "tokens", "step_s", "tokens_per_s", "rss_mb", "battery_percent",
                "charging", "temp_c", "gate"):
        assert key in rec
    losses = [json.loads(line)["loss"] for line in (straight / "metrics.jsonl").read_text().splitlines()]
    assert np.mean(losses[-4:]) < np.mean(losses[:4])      # it learns
    summary = json.loads((straight / "summary.json").read_text())
    assert summary["energy_estimate_j"] > 0 and "estimate" in summary["energy_estimate_basis"]
    again = train(_cfg(bundle, data), straight, log=lambda *_: None)
    assert again["step"] == TOTAL and _steps_logged(straight) == list(range(1, TOTAL + 1))


def test_changed_settings_on_resume_are_refused(setup, straight):
    bundle, data, _ = setup
    with pytest.raises(RunError, match="lr=0.005"):
        train(_cfg(bundle, data, lr=1e-3), straight, log=lambda *_: None)


def test_sigterm_checkpoints_and_exits_zero_then_resume_matches(setup, straight, tmp_path):
    bundle, data, _ = setup
    run = tmp_path / "run"
    cfg = _cfg(bundle, data, save_every=100)
    proc = subprocess.Popen(_cli_args(cfg, run), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.time() + 60
    while time.time() < deadline and not ((run / "metrics.jsonl").exists() and len(_steps_logged(run)) >= 5):
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=60)[0].decode()
    assert proc.returncode == 0, out
    summary = json.loads((run / "summary.json").read_text())
    assert summary["stopped_by"] == "SIGTERM" and not summary["finished"]
    step, _ = _final_lora(run, bundle)
    assert step == summary["step"] == _steps_logged(run)[-1]    # nothing trained past the checkpoint is lost
    train(cfg, run, log=lambda *_: None)
    _, got = _final_lora(run, bundle)
    _, want = _final_lora(straight, bundle)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k])      # bitwise: the optimizer graph is order-independent


def test_sigkill_twenty_times_then_resume_gives_the_same_adapter(setup, straight, tmp_path):
    bundle, data, _ = setup
    run = tmp_path / "run"
    cfg = _cfg(bundle, data, save_every=1, max_steps=TOTAL)
    rng = random.Random(1234)
    last_ckpt_step, kills, kills_after_a_save = 0, 0, 0

    def newest_saved() -> int:               # by name: a checkpoint directory appears only complete
        return max((int(p.name[len(checkpoint.PREFIX):]) for p in (run / checkpoint.CHECKPOINTS).glob("step-*")),
                   default=0)
    while kills < 20:
        proc = subprocess.Popen(_cli_args(cfg, run), cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        # The kill lands at a random moment after this start's first save (however slow the host is to start
        # it): mid-step, mid-save or between, and never before the run has anything to lose.
        deadline = time.time() + 120
        while proc.poll() is None and newest_saved() <= last_ckpt_step and time.time() < deadline:
            time.sleep(0.01)
        time.sleep(rng.uniform(0.0, 0.4))
        if proc.poll() is not None:          # finished before the kill: start over to keep killing
            shutil.rmtree(run)
            last_ckpt_step = 0
            continue
        saved_before_kill = newest_saved()
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        kills += 1
        kills_after_a_save += saved_before_kill > last_ckpt_step
        found = checkpoint.latest(run, warn=lambda *_: None)
        step = found[1]["step"] if found else 0
        assert step >= saved_before_kill > 0   # a kill never takes away a completed checkpoint
        last_ckpt_step = step
    assert kills_after_a_save == kills == 20   # every kill came after a checkpoint of its own start
    result = subprocess.run(_cli_args(cfg, run), cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert _steps_logged(run) == list(range(1, TOTAL + 1))   # every step once, none lost or doubled
    _, got = _final_lora(run, bundle)
    _, want = _final_lora(straight, bundle)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_damaged_newest_checkpoint_falls_back(setup, straight, tmp_path):
    bundle, data, _ = setup
    run = tmp_path / "run"
    shutil.copytree(straight, run)
    newest = sorted((run / "checkpoints").glob("step-*"))[-1]
    ort_file = newest / checkpoint.ORT_FILE
    ort_file.write_bytes(ort_file.read_bytes()[:-100])               # truncated
    (run / "checkpoints" / ".tmp-step-00000099-1").mkdir()           # a write cut short by a kill
    (run / "checkpoints" / ".tmp-step-00000099-1" / "ort_checkpoint").write_bytes(b"partial")
    warnings = []
    path, state = checkpoint.latest(run, warn=warnings.append)
    assert state["step"] < TOTAL and "damaged" in warnings[0]
    train(_cfg(bundle, data), run, log=lambda *_: None)                # resumes from the good one, finishes
    _, got = _final_lora(run, bundle)
    _, want = _final_lora(straight, bundle)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k])


class ScriptedProbe:
    """One reading per read(), in order; the last one repeats. `reads` counts them."""
    name = "scripted"

    def __init__(self, script):
        self.script, self.reads = script, 0

    def read(self):
        reading = self.script[min(self.reads, len(self.script) - 1)]
        self.reads += 1
        return reading


def test_loop_obeys_the_gate_step_by_step(setup, tmp_path, monkeypatch):
    """Against the readings themselves, not the log: the loop steps only on readings where the gate allows it, saves
    a checkpoint as it stops for a pause or a cool-down, waits poll_s while stopped, and in slow mode sleeps
    last_step_s * (1/slow_factor - 1) after each step. Fails for a loop that skips the gate's decision, one that
    pauses without a checkpoint, or a slow mode that does not slow."""
    import android_runner.loop as loop
    from android_runner.probes import BatteryReading

    def r(percent, charging=False, temp=30.0):
        return BatteryReading(percent=percent, charging=charging, temp_c=temp, source="script")

    script = [r(80), r(80),                 # 0-1 full: steps 1, 2
              r(50), r(50),                 # 2-3 slow: steps 3, 4, each followed by a sleep
              r(10), r(20),                 # 4-5 paused (20 <= resume-above 30): checkpoint at 4, then wait
              r(10, charging=True), r(90),  # 6-7 full (charging, then charged): steps 5, 6
              r(45, temp=50), r(45, temp=40),   # 8-9 cooling (40 > 42 - 3): checkpoint at 6, then wait
              r(90), r(90)]                 # 10-11 full: steps 7, 8 (the last, saved as final)
    probe = ScriptedProbe(script)
    monkeypatch.setattr(loop, "make_probe", lambda *a, **k: probe)
    steps, saves, sleeps = [], [], []
    real_step, real_save = loop.train_step, checkpoint.save

    def train_step(*args, **kwargs):
        result = real_step(*args, **kwargs)
        steps.append((probe.reads - 1, result.seconds))
        return result

    def save(run_dir, session, state, **kw):
        saves.append((probe.reads - 1, state["step"], state["reason"]))
        return real_save(run_dir, session, state, **kw)

    monkeypatch.setattr(loop, "train_step", train_step)
    monkeypatch.setattr(checkpoint, "save", save)
    monkeypatch.setattr(loop.StopFlag, "sleep", lambda self, s: sleeps.append((probe.reads - 1, s)))
    bundle, data, _ = setup
    gate = asdict(GateConfig(slow_factor=0.25, poll_s=7.0))
    summary = train(_cfg(bundle, data, battery="scripted", gate=gate, max_steps=8, save_every=100), tmp_path / "run",
                    log=lambda *_: None)
    assert summary["finished"]
    assert [i for i, _ in steps] == [0, 1, 2, 3, 6, 7, 10, 11]          # never on a paused or cooling reading
    assert saves == [(4, 4, "gate paused"), (8, 6, "gate cooling"), (11, 8, "final")]
    step_s = dict(steps)
    assert [i for i, _ in sleeps] == [2, 3, 4, 5, 8, 9]
    slow = [s for i, s in sleeps if i in (2, 3)]                        # after steps 3 and 4: 3x the step before
    assert slow == pytest.approx([3 * step_s[1], 3 * step_s[2]]) and min(slow) > 0
    assert [s for i, s in sleeps if i not in (2, 3)] == [7.0] * 4       # paused and cooling: poll, no step
    gates = [json.loads(line)["gate"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert gates == ["full", "full", "slow", "slow", "full", "full", "full", "full"]


def test_battery_gate_in_the_loop(setup, tmp_path):
    bundle, data, _ = setup
    trace = tmp_path / "trace.csv"
    trace.write_text("t_s,percent,charging,temp_c\n0,50,0,30\n0.8,12,0,31\n1.6,13,1,30\n")
    logs = []
    gate = asdict(GateConfig(poll_s=0.1))
    summary = train(_cfg(bundle, data, battery=f"replay:{trace}", gate=gate, max_steps=40, save_every=100),
                    tmp_path / "run", log=logs.append)
    text = "\n".join(map(str, logs))
    assert "gate: slow" in text and "gate: paused" in text and "gate: full" in text
    assert summary["finished"]
    states = [json.loads(line)["gate"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert states[0] == "slow" and states[-1] == "full"
    assert summary["gate"]["seconds_in"]["paused"] > 0
