"""bench/throughput/profile.summarize_profile: ORT profiles of the training and optimizer sessions, each with its
own clock, summarized from the training session's last runs only; matmul FLOPs and kinds from kernel shapes."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench.throughput.profile import HEAD_PREFIX, summarize_profile


def _kernel(name: str, op: str, ts: int, dur: int, shapes: list[list[int]], out: list[int]) -> dict:
    return {"cat": "Node", "name": f"{name}_kernel_time", "ts": ts, "dur": dur,
            "args": {"op_name": op, "input_type_shape": [{"float": s} for s in shapes],
                     "output_type_shape": [{"float": out}], "output_size": str(4 * math.prod(out))}}


def _write(path: Path, events: list[dict]) -> Path:
    # ORT writes a JSON array with one event per line
    path.write_text("[\n" + ",\n".join(json.dumps(e) for e in events) + "\n]\n")
    return path


def test_summary_reads_the_training_session_only(tmp_path):
    run = lambda ts, dur: {"cat": "Session", "name": "model_run", "ts": ts, "dur": dur, "args": {}}  # noqa: E731
    training = _write(tmp_path / "prof_2026-01-01_00-00-00.json", [
        run(100, 300),                                                      # warm-up step
        _kernel("warm", "MatMul", 120, 200, [[64, 32], [32, 16]], [64, 16]),
        run(1000, 500),                                                     # the measured step
        _kernel("body", "MatMul", 1010, 100, [[1, 64, 32], [32, 16]], [1, 64, 16]),
        _kernel(HEAD_PREFIX + "Gemm_7", "Gemm", 1120, 50, [[64, 32], [100, 32]], [64, 100]),
        _kernel("lora", "FusedMatMul", 1180, 10, [[1, 64, 32], [2, 32]], [1, 64, 2]),
        _kernel("scores", "MatMul", 1200, 20, [[2, 4, 64, 8], [2, 4, 8, 64]], [2, 4, 64, 64]),
        _kernel("act", "Mul", 1300, 40, [[64, 16], [64, 16]], [64, 16]),
    ])
    # the optimizer session's clock starts later, so its run lands inside the training step's window, around one
    # of the training session's matmuls (the summary once took it for the last training run)
    optimizer = _write(tmp_path / "prof_2026-01-01_00-00-01.json", [
        run(1195, 20),
        _kernel("adamw", "AdamWOptimizer", 1197, 5, [[16]], [16]),
    ])
    s = summarize_profile([training, optimizer], step_runs=1, rank=2)
    assert s["model_run_ms"] == 0.5
    assert set(s["by_op_ms"]) == {"MatMul", "Gemm", "FusedMatMul", "Mul"}          # no AdamW, no warm-up kernel
    assert abs(s["matmul_ms"] - 0.18) < 1e-12
    kinds = s["gemm_by_kind"]
    assert set(kinds) == {"body", "head", "lora", "attention"}
    assert kinds["body"]["gflop"] == 2 * 64 * 16 * 32 / 1e9
    assert kinds["head"]["gflop"] == 2 * 64 * 100 * 32 / 1e9                      # transB: K from A's last dims
    assert kinds["lora"]["gflop"] == 2 * 64 * 2 * 32 / 1e9
    assert kinds["attention"]["gflop"] == 2 * (2 * 4 * 64 * 64) * 8 / 1e9
    assert abs(kinds["body"]["gflops"] - 2 * 64 * 16 * 32 / 100e3) < 1e-9        # FLOPs per microsecond / 1e3


def test_summary_refuses_profiles_without_one_training_session(tmp_path):
    optimizer = _write(tmp_path / "prof_a.json", [
        {"cat": "Session", "name": "model_run", "ts": 0, "dur": 5, "args": {}},
        _kernel("adamw", "AdamWOptimizer", 1, 2, [[16]], [16]),
    ])
    with pytest.raises(ValueError, match="training-session"):
        summarize_profile([optimizer], step_runs=1)


def test_head_prefix_is_the_one_head_loss_names_its_nodes_with():
    from artifacts_gen import head_loss

    assert HEAD_PREFIX == head_loss.PREFIX
