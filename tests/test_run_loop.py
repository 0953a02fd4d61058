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
        assert np.abs(got[k] - want[k]).max() <= 1e-6


def test_sigkill_twenty_times_then_resume_gives_the_same_adapter(setup, straight, tmp_path):
    bundle, data, _ = setup
    run = tmp_path / "run"
    cfg = _cfg(bundle, data, save_every=1, max_steps=TOTAL)
    rng = random.Random(1234)
    last_ckpt_step, kills = 0, 0
    while kills < 20:
        proc = subprocess.Popen(_cli_args(cfg, run), cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(rng.uniform(0.5, 3.0))
        if proc.poll() is not None:          # finished before the kill: start over to keep killing
            shutil.rmtree(run)
            last_ckpt_step = 0
            continue
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        kills += 1
        found = checkpoint.latest(run, warn=lambda *_: None)
        step = found[1]["step"] if found else 0
        assert step >= last_ckpt_step          # a kill never takes away a completed checkpoint
        last_ckpt_step = step
    result = subprocess.run(_cli_args(cfg, run), cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert _steps_logged(run) == list(range(1, TOTAL + 1))   # every step once, none lost or doubled
    _, got = _final_lora(run, bundle)
    _, want = _final_lora(straight, bundle)
    for k in want:
        assert np.abs(got[k] - want[k]).max() <= 1e-6, k


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
        assert np.abs(got[k] - want[k]).max() <= 1e-6


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
