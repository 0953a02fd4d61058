"""eval.lockstep: ORT and PyTorch + PEFT, each step from the same adapter and optimizer state, per family.

The bars are the product's (issue 31): loss <= 1e-5 relative, gradients and the AdamW update <= 1e-4 relative
norm, at every step. Two deliberate faults must fail them: a learning-rate schedule one step late on the ORT side
(the update bar), and a loss scale 0.1% off (the loss and gradient bars).
"""
from __future__ import annotations

import pytest

import eval.lockstep as lockstep
from eval.parity import ParityConfig
from tests.bundle_helpers import build_tiny_bundle
from tests.test_parity import write_texts
from tests.tiny_models import FAMILIES

STEPS = 20
CLIP = {"gemma3": 0.6}   # the tiny models' gradient norms (gpt2, qwen2 0.2-0.7; gemma3 0.49-0.69): some steps clip,
DEFAULT_CLIP = 0.4       # some do not


@pytest.fixture(scope="module")
def texts(tmp_path_factory, shared_data):
    return write_texts(tmp_path_factory.mktemp("lockstep-data"), shared_data)[0]


@pytest.fixture(scope="module", params=FAMILIES)
def bundle(request, tmp_path_factory):
    return build_tiny_bundle(request.param, tmp_path_factory.mktemp(f"lockstep-{request.param}"))[1]


def clip_for(bundle) -> float:
    return next((c for fam, c in CLIP.items() if fam in str(bundle)), DEFAULT_CLIP)


def run(bundle, data, out, float64_every=0, **kw):
    cfg = ParityConfig(bundle=str(bundle), data=str(data), out=str(out), steps=STEPS, micro_batch=1, accum=3,
                       lr=5e-3, warmup=3, schedule="cosine", clip=clip_for(bundle), weight_decay=0.01, seed=0, **kw)
    return lockstep.run_lockstep(cfg, log=lambda *_: None, float64_every=float64_every)


def verdicts(result) -> dict[str, bool]:
    return {c["name"]: c["pass"] for c in result["checks"]}


def test_every_step_within_the_bars(bundle, texts, tmp_path):
    result = run(bundle, texts, tmp_path, float64_every=10)
    print({c["name"]: f"{c['max']:.2e}" for c in result["checks"]})
    assert verdicts(result) == {"loss": True, "grad": True, "update": True}
    assert result["pass"] and result["steps"] == STEPS and result["max_lr_diff"] == 0.0
    rows = result["rows"]
    assert all(r["grad_norm"] > 0 for r in rows)                     # real gradients, not two zeros compared
    clip = clip_for(bundle)
    assert any(r["grad_norm"] > clip for r in rows) and any(r["grad_norm"] < clip for r in rows)
    assert rows[0]["update_raw"] == 0.0 and rows[0]["lr_ort"] == 0.0   # warmup's first step moves nothing
    assert all(r["lr_ort"] > 0 for r in rows[1:])
    assert rows[-1]["loss_ort"] < rows[0]["loss_ort"]                   # it trained
    assert (tmp_path / "lockstep.md").is_file() and (tmp_path / "lockstep.png").is_file()
    # the float64 reference at steps 1, 10, 20: both float32 sides close to it (measured ~1e-7 to 5e-7)
    f64 = [r for r in rows if "grad_ort_f64" in r]
    assert [r["step"] for r in f64] == [1, 10, 20]
    for r in f64:
        assert max(r["loss_ort_f64"], r["loss_torch_f64"]) < 1e-6 and max(r["grad_ort_f64"], r["grad_torch_f64"]) < 1e-5
    assert "## Each side against float64" in (tmp_path / "lockstep.md").read_text()
    assert result["float64"]["pass"] and result["float64"]["steps"] == 3


# The mutations break the harness, not a family: one family each (gemma3: the float64 reference below).
@pytest.mark.parametrize("bundle", ["gpt2"], indirect=True)
def test_a_schedule_one_step_late_fails_the_update(bundle, texts, tmp_path, monkeypatch):
    real = lockstep.lr_at
    monkeypatch.setattr(lockstep, "lr_at", lambda step, *a: real(max(step - 1, 0), *a))
    result = run(bundle, texts, tmp_path)
    assert verdicts(result) == {"loss": True, "grad": True, "update": False}
    assert not result["pass"]


@pytest.mark.parametrize("bundle", ["gemma3"], indirect=True)
def test_a_loss_scale_off_by_a_thousandth_fails_loss_and_gradients(bundle, texts, tmp_path, monkeypatch):
    from ort_trainer.session import TrainSession

    real = TrainSession.forward_backward
    monkeypatch.setattr(TrainSession, "forward_backward", lambda self, b, scale: real(self, b, scale * 1.001))
    result = run(bundle, texts, tmp_path, float64_every=100)
    assert verdicts(result)["loss"] is False and verdicts(result)["grad"] is False
    # every step is an outlier, so every step gets the float64 reference, and ORT alone fails against it
    assert result["float64"]["steps"] == STEPS and not result["float64"]["pass"]
    assert result["float64"]["loss_torch_max"] < 1e-6 and result["float64"]["loss_ort_max"] > 5e-4


@pytest.mark.parametrize("bundle", ["gpt2"], indirect=True)
def test_lora_dropout_is_refused(bundle, texts, tmp_path, monkeypatch):
    real = lockstep.open_bundle

    def with_dropout(*a, **kw):
        b = real(*a, **kw)
        b.manifest.lora.dropout = 0.1
        return b

    monkeypatch.setattr(lockstep, "open_bundle", with_dropout)
    with pytest.raises(ValueError, match="dropout is 0.1: the two sides would draw different masks"):
        run(bundle, texts, tmp_path)
