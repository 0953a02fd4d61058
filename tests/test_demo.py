"""`pocketlora demo` end to end: on a tiny random model (every phase runs, every artifact exists and verifies),
and, marked slow, on the real Gemma3-270M against the issue's bars."""
from __future__ import annotations

import json

import onnxruntime as ort
import pytest

from eval.demo import Recipe, run_demo
from ort_trainer.bundle import open_bundle
from tests.tiny_models import make_tiny_checkpoint


def test_demo_pipeline_on_a_tiny_model(tmp_path, shared_data):
    ckpt = make_tiny_checkpoint("gpt2", tmp_path / "ckpt")
    logs = []
    recipe = Recipe(steps=4, micro_batch=4, ppl_tokens=300, trace_speed=2000.0, max_new_tokens=3, seq_len=64)
    result = run_demo(tmp_path / "demo", model=str(ckpt), recipe=recipe, log=logs.append)
    text = "\n".join(map(str, logs))
    for k in range(1, 6):
        assert f"[{k}/5]" in text
    assert "gate: " in text                                   # the replayed evening changed the gate's state
    work = tmp_path / "demo"
    for f in ("device/records.jsonl", "device/train.jsonl", "device/heldout.json", "report.md", "result.json",
              "loss.png", "accuracy.png", "export/model.onnx", "run/summary.json"):
        assert (work / f).is_file(), f
    open_bundle(work / "bundle")                               # every sha256 verifies
    rows = (work / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["step"] for r in rows] == [1, 2, 3, 4]
    saved = json.loads((work / "result.json").read_text())
    assert saved["heldout"] == 33 and 0 <= saved["accuracy_after"] <= 1 and saved["ppl_before"]["hf"] > 1
    assert len(saved["samples"]) == 5 and all(isinstance(s["tuned_standalone_onnx"], str) for s in saved["samples"])
    ort.InferenceSession(str(work / "export" / "model.onnx"), providers=["CPUExecutionProvider"])
    assert "Sample answers" in (work / "report.md").read_text()
    # Running again reuses the bundle and the finished run.
    logs.clear()
    run_demo(tmp_path / "demo", model=str(ckpt), recipe=recipe, log=logs.append)
    assert any("reusing" in str(line) for line in logs)


@pytest.mark.slow
def test_demo_on_the_real_model_meets_the_bars(tmp_path):
    """The README's first command on the embedded default (real Gemma3-270M, ~10 min on 2 cores): held-out
    accuracy from near 0 to a majority, WikiText-2 perplexity not up by more than 10%, by any measure."""
    result = run_demo(tmp_path / "demo", log=lambda *_: None)
    assert result["accuracy_before"] <= 0.1 and result["accuracy_after"] > 0.5
    rises = {**result["ppl_rise"], **result["ppl_rise_by_position"]}
    assert set(rises) >= {"hf", "bos"} and len(result["ppl_rise_by_position"]) == 3
    assert all(r <= 0.10 for r in rises.values()), rises
    for f in ("report.md", "loss.png", "accuracy.png", "export/model.onnx", "run/summary.json"):
        assert (tmp_path / "demo" / f).is_file(), f
