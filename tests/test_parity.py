"""eval.parity: the device runner (ORT) and the independent PyTorch + PEFT trainer agree, per family.

30 optimizer steps of 2 micro-batches of 1 block (seq_len 64, the bundle's) on WikiText-2 lines;
the thresholds are the product's: loss-curve max rel diff <= 1e-3, final held-out perplexity rel
diff <= 0.5 %. The report files must exist and report.json must carry pass/fail per check.
"""
from __future__ import annotations

import json
import time

import numpy as np
import pytest

from eval.parity import ParityConfig, run_parity
from eval.parity_checks import THRESHOLDS
from ort_trainer.bundle import open_bundle
from tests.bundle_helpers import SEQ_LEN, build_tiny_bundle
from tests.tiny_models import FAMILIES

STEPS = 30


def write_texts(root, shared_data):
    lines = (shared_data / "wikitext2" / "valid.txt").read_text().splitlines(keepends=True)
    train, heldout = root / "train.txt", root / "heldout.txt"
    train.write_text("".join(lines[:60]))
    heldout.write_text("".join(lines[300:330]))
    return train, heldout


def parity_config(bundle, train, heldout, out, **kw) -> ParityConfig:
    base = dict(bundle=str(bundle), data=str(train), out=str(out), steps=STEPS, micro_batch=1, accum=2, lr=5e-3,
                warmup=3, schedule="cosine", clip=1.0, seed=0, heldout=str(heldout), heldout_max_tokens=400)
    base.update(kw)
    return ParityConfig(**base)


# qwen2's free-running run is the slowest of the three (~25 s); its step-by-step parity (test_lockstep) and its
# graph parity (test_artifacts_gen, test_train_semantics) run always.
@pytest.fixture(scope="module", params=[pytest.param(f, marks=pytest.mark.slow) if f == "qwen2" else f
                                        for f in FAMILIES])
def parity(request, tmp_path_factory, shared_data):
    root = tmp_path_factory.mktemp(f"parity-{request.param}")
    _, bundle = build_tiny_bundle(request.param, root)
    train, heldout = write_texts(root, shared_data)
    t0 = time.perf_counter()
    # gpt2 runs each side in its own subprocess (the default, as the CLI does); the others train in this
    # process to save two interpreter start-ups and torch/ORT imports per family.
    isolate = request.param == "gpt2"
    report = run_parity(parity_config(bundle, train, heldout, root / "report", isolate=isolate), log=lambda *_: None)
    seconds = time.perf_counter() - t0
    loss, ppl = report["loss"], report["perplexity"]
    print(f"\n[parity {request.param}] loss max rel {loss['max_rel_diff']:.3g} (mean {loss['mean_rel_diff']:.3g}), "
          f"final ppl rel {ppl['final_rel_diff']:.3g} (training {ppl['training_rel_diff']:.3g}, inference "
          f"{ppl['inference_rel_diff']:.3g}), weights max abs {report['weights']['max_abs']:.3g}; {seconds:.1f} s")
    return request.param, root, open_bundle(bundle, verify="none"), report


def test_parity_passes_thresholds(parity):
    family, root, bundle, report = parity
    checks = {c["name"]: c for c in report["checks"]}
    assert set(checks) == {"loss_curve_max_rel_diff", "final_ppl_rel_diff"}
    loss = report["loss"]
    assert len(loss["ort"]) == len(loss["torch"]) == STEPS
    assert loss["max_rel_diff"] <= THRESHOLDS["loss_max_rel"] == 1e-3
    assert report["perplexity"]["final_rel_diff"] <= THRESHOLDS["ppl_rel"] == 0.005
    assert all(c["pass"] and c["status"] == "PASS" for c in checks.values()) and report["pass"]
    # the same learning-rate schedule was applied step by step on both sides
    assert np.allclose(loss["lr_ort"], loss["lr_torch"], rtol=1e-6, atol=0)
    # both sides really trained: the loss falls and the weights left the initial point (B = 0)
    assert np.mean(loss["torch"][-5:]) < np.mean(loss["torch"][:5])
    m = report["perplexity"]["matrix"]
    assert m["ort_trained"]["ort"]["ppl"] < m["base"]["ort"]["ppl"]
    assert m["torch_trained"]["torch"]["ppl"] < m["base"]["torch"]["ppl"]
    assert report["perplexity"]["seq_len"] == SEQ_LEN == bundle.manifest.seq_len


def test_parity_report_files(parity):
    family, root, bundle, report = parity
    out = root / "report"
    for name in ("report.md", "report.json", "loss_curves.png", "loss_rel_diff.png", "ort_run/summary.json",
                 "ort_run/metrics.jsonl", "torch_run/adapter/adapter_model.safetensors"):
        assert (out / name).is_file(), name
    assert not (out / "mmlu_per_subject.png").exists()            # MMLU was not asked for
    data = json.loads((out / "report.json").read_text())          # strict JSON (no NaN)
    md = (out / "report.md").read_text()
    assert isinstance(data["pass"], bool)
    for c in data["checks"]:
        assert {"name", "value", "threshold", "pass", "status"} <= set(c)
        assert c["status"] == ("PASS" if c["pass"] else "FAIL")
    assert set(data["definitions"]) >= {"perplexity", "mmlu", "loss"}
    for side in ("ort", "torch"):
        assert data["perf"][side]["peak_rss_mb"] > 0 and data["perf"][side]["tokens_per_s"] > 0
    assert data["perf"]["isolated"] == (family == "gpt2")
    assert ("in-process mode (isolate=False)" in md) == (family != "gpt2")
    assert data["perf"]["ort"]["tokens"] == data["perf"]["torch"]["tokens"] == STEPS * 2 * SEQ_LEN
    assert "PASS" in md and "loss_curves.png" in md and "Metric definitions" in md


@pytest.mark.parametrize("parity", ["gpt2"], indirect=True)     # report rendering is family-independent
def test_a_failed_check_is_reported_as_fail(parity, tmp_path):
    """Honesty: with a threshold that cannot be met the report shows FAIL with the numbers."""
    from eval.parity_checks import threshold_check
    from eval.report import write_report

    family, root, bundle, report = parity
    bad = json.loads(json.dumps(report))
    c = bad["checks"][0]
    bad["checks"][0] = threshold_check(c["name"], c["value"], 1e-12, c["detail"])
    assert bad["checks"][0]["status"] == "FAIL"
    bad["pass"] = all(c["pass"] for c in bad["checks"])
    paths = write_report(bad, tmp_path)
    md = paths["md"].read_text()
    assert "**Overall: FAIL**" in md and "**FAIL**" in md
    assert json.loads(paths["json"].read_text())["pass"] is False


@pytest.mark.parametrize("parity", ["gpt2"], indirect=True)     # CLI wiring is family-independent
def test_cli_ppl_of_the_trained_run(parity):
    """`pocketlora eval ppl --run` scores the run's final adapter: the report's ORT number for it."""
    from pocketlora_cli import main

    family, root, bundle, report = parity
    out = root / "ppl-run.json"
    assert main(["eval", "ppl", "--bundle", str(bundle.path), "--run", str(root / "report" / "ort_run"),
                 "--data", str(root / "heldout.txt"), "--max-tokens", "400", "--out", str(out)]) == 0
    got = json.loads(out.read_text())
    want = report["perplexity"]["matrix"]["ort_trained"]["ort"]
    assert got["tokens"] == want["tokens"] and got["seq_len"] == SEQ_LEN
    assert abs(got["ppl"] - want["ppl"]) / want["ppl"] <= 1e-9


FLOOR_STEPS = 20        # within the first epoch of the 60 lines, where 1x2 and 2x1 take the same sequences


@pytest.fixture(scope="module")
def floor_setup(tmp_path_factory, shared_data):
    root = tmp_path_factory.mktemp("parity-floor")
    _, bundle = build_tiny_bundle("qwen2", root)
    return (bundle, *write_texts(root, shared_data))


def test_the_loss_curves_against_their_noise_floor(floor_setup, tmp_path):
    bundle, train, heldout = floor_setup
    report = run_parity(parity_config(bundle, train, heldout, tmp_path, steps=FLOOR_STEPS, isolate=False,
                                      floor=True), log=lambda *_: None)
    checks = {c["name"]: c for c in report["checks"]}
    assert "loss_curve_max_rel_diff" not in checks and checks["loss_curve_vs_noise_floor"]["pass"]
    floor = report["loss"]["floor"]
    assert floor["split"] == "2x1" and len(floor["rel_diff"]) == FLOOR_STEPS
    assert 0 < max(floor["rel_diff"]) < 1e-5          # another split: other rounding, the same math
    assert (tmp_path / "ort_floor_run" / "metrics.jsonl").is_file()
    assert "noise floor" in (tmp_path / "report.md").read_text()


def test_a_schedule_one_step_late_fails_against_the_floor(floor_setup, tmp_path, monkeypatch):
    """Both ORT runs share the bug, so the floor stays at rounding while ORT vs PyTorch does not."""
    import android_runner.loop as loop

    real = loop.lr_at
    monkeypatch.setattr(loop, "lr_at", lambda step, *a: real(max(step - 1, 0), *a))
    bundle, train, heldout = floor_setup
    report = run_parity(parity_config(bundle, train, heldout, tmp_path, steps=FLOOR_STEPS, isolate=False,
                                      floor=True), log=lambda *_: None)
    check = next(c for c in report["checks"] if c["name"] == "loss_curve_vs_noise_floor")
    assert not check["pass"] and max(report["loss"]["floor"]["rel_diff"]) < 1e-5


def test_the_floor_refuses_splits_that_take_other_sequences(floor_setup, tmp_path):
    bundle, train, heldout = floor_setup
    # 50 sequences: 4x1 drops 2 at the end of each epoch (step 13), 2x2 drops none
    with pytest.raises(ValueError, match=r"from step 13 the 4x1 and 2x2 splits take different sequences"):
        run_parity(parity_config(bundle, train, heldout, tmp_path, steps=30, micro_batch=4, accum=1, isolate=False,
                                 floor=True), log=lambda *_: None)
    assert not (tmp_path / "ort_run").exists()          # refused before anything trained
