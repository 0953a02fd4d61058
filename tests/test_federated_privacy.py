"""Central differential privacy in a federated run (federated/privacy.py, Flower's DP wrapper and accountant).

Checked against independent computations: every round's global adapter minus numpy's mean of the devices'
clipped updates (from the tensors they returned) is Gaussian noise of the standard deviation the noise multiplier
and clipping norm call for (no noise, no clipping or a wrong scale fail); epsilon equals Google's dp-accounting
composing the same Gaussian mechanism directly; a declined device is not in the mean; the accountant's state
survives a restart of the server.
"""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from federated import state as fstate
from ort_trainer import manifest as mf
from ort_trainer.adapter import load_lora
from ort_trainer.bundle import open_bundle
from tests.conftest import REPO

DEVICES, ROUNDS, PAUSED = 4, 2, 2
NOISE, CLIP, DELTA = 0.5, 0.02, 1e-5


@pytest.fixture(scope="module")
def run(tmp_path_factory, federation):
    bundle, low = federation
    out = tmp_path_factory.mktemp("federated-dp") / "out"
    argv = [sys.executable, "-m", "pocketlora_cli", "federate", "--bundle", str(bundle), "--devices", str(DEVICES),
            "--rounds", str(ROUNDS), "--out", str(out), "--local-steps", "1", "--micro-batch", "2", "--lr", "5e-3",
            "--personalize-steps", "0", "--device-battery", f"{PAUSED}=replay:{low}", "--keep-updates",
            "--dp-noise", str(NOISE), "--dp-clip", str(CLIP), "--dp-delta", str(DELTA)]
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    return bundle, out


def _npz(path):
    with np.load(path) as z:
        return {k.replace("|", "/"): z[k] for k in z.files}


def test_global_is_clipped_mean_plus_calibrated_noise(run):
    bundle, out = run
    rounds = [json.loads(x) for x in (out / "rounds.jsonl").read_text().splitlines()]
    b = open_bundle(bundle, verify="none")
    names = b.manifest.trainable_names
    before = load_lora(b.file(mf.CHECKPOINT), b.manifest)      # round 1 starts from the bundle's init
    for r in rounds:
        d = out / "updates" / f"round-{r['round']:03d}"
        assert r["participants"] == [i for i in range(DEVICES) if i != PAUSED]      # the paused one is not in it
        assert list(r["declined"]) == [str(PAUSED)] and r["dp"]["released"]
        k = len(r["participants"])
        deltas = []
        for dev in r["participants"]:
            u = _npz(d / f"device-{dev:03d}.npz")
            delta = {n: u[n].astype(np.float64) - before[n].astype(np.float64) for n in names}
            norm = np.sqrt(sum(float(np.sum(v ** 2)) for v in delta.values()))
            assert norm > CLIP      # the clipping bites (without it the mean below would be off by far more)
            deltas.append({n: v * min(1.0, CLIP / norm) for n, v in delta.items()})
        expected = {n: before[n].astype(np.float64) + sum(x[n] for x in deltas) / k for n in names}
        got = _npz(d / "global.npz")
        resid = np.concatenate([(got[n].astype(np.float64) - expected[n]).ravel() for n in names])
        std = NOISE * CLIP / k
        assert resid.size > 2000
        assert abs(resid.std() / std - 1) < 0.1, (resid.std(), std)
        assert abs(resid.mean()) < 5 * std / np.sqrt(resid.size)
        before = got


def test_epsilon_matches_dp_accounting(run):
    from dp_accounting import dp_event
    from dp_accounting.rdp import rdp_privacy_accountant as rdp

    _, out = run
    rounds = [json.loads(x) for x in (out / "rounds.jsonl").read_text().splitlines()]
    for r in rounds:
        acc = rdp.RdpAccountant(neighboring_relation=rdp.NeighborRel.ADD_OR_REMOVE_ONE)
        acc.compose(dp_event.GaussianDpEvent(NOISE), r["round"])
        assert r["dp"]["releases"] == r["round"]
        assert r["dp"]["epsilon"] == pytest.approx(acc.get_epsilon(DELTA), rel=1e-3)
    st = fstate.load(out)
    assert sum(c["count"] for c in st.privacy["compositions"]) == ROUNDS     # persisted for a resume
    assert "epsilon" in (out / "report.md").read_text()


def test_accountant_state_survives_restart():
    from flwr.supercore.privacy_accounting import GaussianPrivacyEvent

    from federated.privacy import CentralDP

    dp = CentralDP(NOISE, CLIP, DELTA, DEVICES)
    dp.accountant.compose(GaussianPrivacyEvent(noise_multiplier=NOISE, sample_size=3, population_size=DEVICES), 2)
    again = CentralDP(NOISE, CLIP, DELTA, DEVICES, json.loads(json.dumps(dp.state())))
    assert again.spent() == dp.spent() and again.spent()["releases"] == 2
