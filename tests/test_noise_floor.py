"""eval.noise_floor: the divergence of two ORT runs of the same training, beside ORT vs PyTorch."""
from __future__ import annotations

import json

import numpy as np
import pytest

from eval.noise_floor import noise_floor, plot

CFG = {"data": "train.txt", "max_steps": 4, "lr": 2e-4, "warmup": 1, "schedule": "cosine", "clip": 1.0,
       "weight_decay": 0.0, "seed": 0}


def _run(d, losses, micro, accum, **over):
    d.mkdir(parents=True)
    (d / "run.json").write_text(json.dumps({**CFG, "micro_batch": micro, "accum": accum, **over}))
    (d / "metrics.jsonl").write_text("".join(json.dumps({"step": i + 1, "loss": x}) + "\n" for i, x in enumerate(losses)))


def test_noise_floor_against_hand_computation(tmp_path):
    ort, torch, ort2 = [4.0, 3.0, 2.5, 2.0], [4.0, 3.003, 2.5, 1.9], [4.0, 3.0006, 2.49]
    rep = tmp_path / "report"
    _run(rep / "ort_run", ort, 4, 2)
    (rep / "torch_run").mkdir()
    (rep / "torch_run" / "result.json").write_text(json.dumps({"losses": torch}))
    _run(tmp_path / "second", ort2, 8, 1)            # stopped early: the common 3 steps are compared
    r = noise_floor(rep, tmp_path / "second")
    assert r["steps"] == 3 and (r["first"], r["second"]) == ("4x2", "8x1")
    assert np.allclose(r["ort_vs_torch"], [0.0, 0.003 / 3.003, 0.0])
    assert np.allclose(r["ort_vs_ort"], [0.0, 0.0006 / 3.0, 0.01 / 2.5])
    assert r["max_ort_vs_ort"] == pytest.approx(0.004)
    assert plot(r, tmp_path / "nf.png").stat().st_size > 0
    _run(tmp_path / "other", ort2, 8, 1, lr=1e-3)
    with pytest.raises(ValueError, match="not the same training.*lr"):
        noise_floor(rep, tmp_path / "other")
    _run(tmp_path / "smaller", ort2, 4, 1)
    with pytest.raises(ValueError, match="same examples per step"):
        noise_floor(rep, tmp_path / "smaller")
