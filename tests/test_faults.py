"""Faults of the inputs and the environment (issue #31): one line and exit 2 or 3, never a traceback, nothing
good lost; after a full disk, freeing space and rerunning ends equal to an uninterrupted run. The catalogue is
tests/fault_cases.py (also the table of docs/FAULTS.md)."""
from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch  # noqa: F401  (before any train case: _as_on_device must not hide torch from the gen cases)

from pocketlora_cli import main
from tests.conftest import REPO
from tests.fault_cases import CASES, STEPS, FullDisk, latest_step, make_world, run_case, train_argv


@pytest.fixture(scope="module")
def world(tmp_path_factory, shared_data):
    return make_world(tmp_path_factory.mktemp("world"))


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if not c.slow])
def test_fault(name, world, tmp_path, monkeypatch):
    run_case(name, world, tmp_path, monkeypatch)


def _final(run: Path, bundle: Path) -> tuple[list, dict]:
    from ort_trainer import checkpoint
    from ort_trainer.adapter import load_lora
    from ort_trainer.bundle import open_bundle

    path, state = checkpoint.latest(run)
    lora = load_lora(path / checkpoint.ORT_FILE, open_bundle(bundle, verify="none").manifest)
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [(m["step"], m["loss"]) for m in metrics], lora


def _assert_same_run(run: Path, world) -> None:
    got_losses, got = _final(run, world.bundle)
    want_losses, want = _final(world.run, world.bundle)
    assert [s for s, _ in got_losses] == list(range(1, STEPS + 1))     # every step logged once
    assert np.allclose([v for _, v in got_losses], [v for _, v in want_losses], rtol=0, atol=1e-6)
    for k in want:
        assert np.abs(got[k] - want[k]).max() <= 1e-6, k
    assert json.loads((run / "summary.json").read_text())["finished"]


def _train(argv: list[str]) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(argv)
    return code, err.getvalue()


def test_full_disk_at_every_kind_of_write_then_rerun_equals_uninterrupted(world, tmp_path, monkeypatch):
    """One run, the disk full again and again: each attempt gets `n` writes, then the disk is full. The n's are
    chosen so that the failing write walks through every kind a run makes (run.json, a metrics line, the ORT
    checkpoint, its state.json, the metrics rewrite on resume, summary.json); between attempts space is freed.
    Every attempt exits 3 with one line; every saved checkpoint stays good; the last run equals an uninterrupted one."""
    run = tmp_path / "run"
    plan = [(0, "run.json", None), (1, "metrics.jsonl", None), (2, "metrics.jsonl", None),
            (3, "ort_checkpoint", None), (4, "state.json", None), (5, "metrics.jsonl", 2),
            (0, "metrics.jsonl", 2),                                       # the rewrite of the log on resume
            (3, "ort_checkpoint", 2), (4, "state.json", 2), (5, "summary.json", STEPS)]
    for writes, file, saved in plan:
        disk = FullDisk(tmp_path, writes).install(monkeypatch)
        code, err = _train(train_argv(world.bundle, world.data, run))
        monkeypatch.undo()
        failed = [name for name, bad in disk.log if bad]
        assert code == 3 and failed[:1] == [file], (writes, file, disk.log, err)
        assert "Traceback" not in err and err.strip().splitlines()[-1].startswith(
            "pocketlora train: error: no space left on the device writing ")
        assert latest_step(run) == saved                     # the last good checkpoint survives every fault
        assert not list(run.rglob(".tmp-*")) and not list(run.glob(".*.tmp-*"))    # nothing half-written is kept
    assert _train(train_argv(world.bundle, world.data, run))[0] == 0
    _assert_same_run(run, world)


@contextlib.contextmanager
def _tmpfs(path: Path, kib: int):
    path.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={kib}k", "tmpfs", str(path)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root); the injected full disks above still ran")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.mark.parametrize("free_kib", [0, 4, 12, 52])
def test_real_full_tmpfs_then_free_space_and_rerun(world, tmp_path, free_kib):
    """The same on a real 256 KiB tmpfs, filled up to `free_kib` (0: run.json fails; 4: a metrics line; 12: the first
    ORT checkpoint, ORT's own errno:28; 52: the second)."""
    with _tmpfs(tmp_path / "fs", 256) as fs:
        ballast = fs / "ballast"
        with open(ballast, "wb") as f:
            with contextlib.suppress(OSError):
                f.write(b"\0" * ((256 - free_kib) * 1024))
        code, err = _train(train_argv(world.bundle, world.data, fs / "run"))
        assert code == 3 and "Traceback" not in err, err
        assert err.strip().splitlines()[-1].startswith("pocketlora train: error: no space left on the device writing ")
        ballast.unlink()
        assert _train(train_argv(world.bundle, world.data, fs / "run"))[0] == 0
        _assert_same_run(fs / "run", world)


def test_gen_killed_leaves_no_bundle_train_would_accept_and_rerun_cleans_up(world, tmp_path):
    out = tmp_path / "b"
    cmd = [sys.executable, "-m", "pocketlora_cli", "gen", "--model", str(world.ckpt), "--out", str(out),
           "--seq-len", "32"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and not list(tmp_path.glob(".b.partial-*/weights-*")):   # mid-build: shards
        assert proc.poll() is None, "gen finished before it could be killed"
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    partial = list(tmp_path.glob(".b.partial-*"))
    assert not out.exists() and len(partial) == 1
    for bundle, says in ((out, "no such bundle directory"), (partial[0], "manifest.json: no manifest")):
        code, err = _train(train_argv(bundle, world.data, tmp_path / "run"))
        assert code == 2 and says in err and "Traceback" not in err
    logs = []
    from artifacts_gen.build import build_bundle

    build_bundle(world.ckpt, out, seq_len=32, log=logs.append)
    assert any("left by an interrupted build" in line for line in logs)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".b.")] == []
    from ort_trainer.bundle import open_bundle

    open_bundle(out)


def test_identical_frozen_tensors_stay_distinct_and_grads_match(world, tmp_path):
    """Issue #31, 3: a freshly initialised GPT-2 (every LayerNorm weight all ones, every bias zero) failed in ORT's
    gradient builder ('Duplicate definition of name (...ln_2.weight_grad)'): the exporter had merged the equal
    tensors (b = Identity(a)). Now each is its own initializer under its own name, and the LoRA gradients
    equal autograd's through an independent PEFT model."""
    import onnx
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from artifacts_gen.build import build_bundle
    from artifacts_gen.export import LoraSettings
    from ort_trainer import manifest as mf
    from ort_trainer.bundle import open_bundle
    from tests.bundle_helpers import SEQ_LEN
    from tests.test_artifacts_gen import assert_lora_grads_match_autograd
    from tests.tiny_models import tiny_config

    ckpt = tmp_path / "fresh"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("gpt2"))
    model.save_pretrained(ckpt)
    AutoTokenizer.from_pretrained(world.ckpt).save_pretrained(ckpt)
    norms = {n for n, p in model.named_parameters() if ".ln_" in n and n.endswith("weight")}
    assert len(norms) == 5 and all(bool((p == 1).all()) for n, p in model.named_parameters() if n in norms)

    build_bundle(ckpt, tmp_path / "b", lora=LoraSettings(r=4, alpha=8.0), seq_len=SEQ_LEN, log=lambda *_: None)
    bundle = open_bundle(tmp_path / "b")
    graph = onnx.load(str(bundle.file(mf.EVAL_MODEL)), load_external_data=False).graph
    inits = {i.name for i in graph.initializer}
    assert norms <= inits                                          # one initializer each, by its own name
    assert not [n for n in graph.node if n.op_type == "Identity" and n.input[0] in inits]
    assert_lora_grads_match_autograd(ckpt, bundle)


def test_oserror_that_is_not_the_environment_keeps_its_traceback(monkeypatch):
    """Only the environment's errnos become one line: another OSError (a bug's) is raised as it is."""
    import android_runner.loop as loop

    def boom(*args, **kwargs):
        raise OSError(22, "Invalid argument (a bug)")
    monkeypatch.setattr(loop, "train", boom)
    with pytest.raises(OSError, match="a bug"):
        main(["train", "--bundle", "b", "--data", "d", "--out", "o", "--max-steps", "1"])


def test_native_errno_is_recognised():
    import errno

    from ort_trainer.faults import environment_fault, native_writes
    from tests.fault_cases import ENOSPC_ORT

    with pytest.raises(OSError) as info:
        with native_writes("/run/checkpoints/step-00000004"):
            raise RuntimeError(ENOSPC_ORT.format(path="/run/checkpoints/.tmp-x/ort_checkpoint"))
    assert info.value.errno == errno.ENOSPC
    assert environment_fault(info.value) == "no space left on the device writing /run/checkpoints/step-00000004"
    with pytest.raises(RuntimeError, match="shape mismatch"):           # not a write failure: untouched
        with native_writes("/x"):
            raise RuntimeError("shape mismatch")
    assert environment_fault(OSError(errno.EINVAL, "bad")) is None and os.strerror(errno.ENOSPC)


def test_demo_training_child_that_fails_ends_the_demo_with_its_code(world, tmp_path, capfd):
    """The demo trains in its own `pocketlora train` process: that child's one-line error and exit code pass
    through (StageFailed: main prints one more line and returns the same code), no traceback."""
    from eval.demo import Recipe, _train_on_device
    from ort_trainer.faults import StageFailed

    with pytest.raises(StageFailed) as info:
        _train_on_device(world.bundle, tmp_path / "missing.jsonl", tmp_path / "run", Recipe(steps=2), lambda *_: None)
    assert info.value.exit_code == 2
    err = capfd.readouterr().err
    assert "pocketlora train: error: " in err and "missing.jsonl: file not found" in err and "Traceback" not in err
