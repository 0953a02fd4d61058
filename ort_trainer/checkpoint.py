"""Crash-safe checkpoints of a run: write, fsync, rename; verify on load; fall back to the last good one.

RUN/checkpoints/step-00000042/
    ort_checkpoint   ORT CheckpointState: LoRA weights + AdamW moments and step
    state.json       trainer state (step, data position, seed, ...) + sha256 of ort_checkpoint

(The web runner writes the same layout with `web_state.safetensors` in place of ort_checkpoint, named by
state.json's `weights_file`: `weights_file()` finds either, so export and eval read both kinds of run.)

A directory only ever appears under its final name complete and synced, so a kill at any
moment leaves either the previous checkpoints or the new one, never half of one. A checkpoint
damaged afterwards (truncated copy, bad sector) fails its checksum and the previous is used.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from .bundle import sha256_file
from .faults import native_writes

CHECKPOINTS = "checkpoints"
ORT_FILE = "ort_checkpoint"
STATE_FILE = "state.json"
PREFIX = "step-"


class CheckpointError(RuntimeError):
    pass


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(run_dir: Path, session, state: dict, keep: int = 2) -> Path:
    """Atomically write checkpoint `state["step"]`; keep the newest `keep` checkpoints."""
    root = Path(run_dir) / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{PREFIX}{state['step']:08d}"
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        with native_writes(tmp / ORT_FILE):      # ORT reports a full disk as RuntimeError text "errno:28"
            session.save(tmp / ORT_FILE)
        _fsync_path(tmp / ORT_FILE)
        record = dict(state, ort_checkpoint_sha256=sha256_file(tmp / ORT_FILE),
                      ort_checkpoint_bytes=(tmp / ORT_FILE).stat().st_size)
        with open(tmp / STATE_FILE, "w") as f:
            json.dump(record, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        _fsync_path(tmp)
        if final.exists():          # the same step saved again (e.g. after a signal): replace it
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException as exc:    # e.g. a full disk: the half-written copy goes (it holds the space a
        shutil.rmtree(tmp, ignore_errors=True)   # rerun needs); the previous checkpoints are untouched
        if isinstance(exc, OSError) and exc.errno is not None:
            raise OSError(exc.errno, exc.strerror, str(final)) from exc   # the checkpoint, not its temp name
        raise
    _fsync_path(root)
    _prune(root, keep)
    return final


def _prune(root: Path, keep: int) -> None:
    for stale in root.glob(".tmp-*"):
        if not stale.name.endswith(f"-{os.getpid()}"):
            shutil.rmtree(stale, ignore_errors=True)
    for old in sorted(root.glob(PREFIX + "*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def verify(path: Path) -> dict:
    """The state of a checkpoint directory, or CheckpointError saying what is wrong with it."""
    try:
        state = json.loads((path / STATE_FILE).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path / STATE_FILE}: unreadable ({exc})") from exc
    if not isinstance(state, dict):
        raise CheckpointError(f"{path / STATE_FILE}: not a JSON object (damaged)")
    weights = weights_file(path, state)
    size, digest = (state.get("weights_bytes", state.get("ort_checkpoint_bytes")),
                    state.get("weights_sha256", state.get("ort_checkpoint_sha256")))
    if not weights.is_file():
        raise CheckpointError(f"{weights}: missing")
    if weights.stat().st_size != size:
        raise CheckpointError(f"{weights}: {weights.stat().st_size} bytes, expected {size} (truncated)")
    if sha256_file(weights) != digest:
        raise CheckpointError(f"{weights}: checksum mismatch (damaged)")
    return state


def weights_file(path: Path, state: dict) -> Path:
    """The file of a checkpoint that holds the LoRA tensors: this runner's ORT checkpoint, or the one the web
    runner (android_runner/web) names in its state (a safetensors file of the LoRA and AdamW's moments)."""
    return Path(path) / state.get("weights_file", ORT_FILE)


def latest(run_dir: Path, warn=print) -> tuple[Path, dict] | None:
    """The newest checkpoint that verifies; damaged ones are reported and skipped."""
    root = Path(run_dir) / CHECKPOINTS
    for path in sorted(root.glob(PREFIX + "*"), reverse=True):
        try:
            return path, verify(path)
        except CheckpointError as exc:
            warn(f"warning: skipping damaged checkpoint {path.name}: {exc}; falling back to the previous one")
    return None
