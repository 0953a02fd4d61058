"""Federated personalization with Flower's simulation engine: 10 virtual devices, 3 rounds, a tiny bundle.

(a) every round's global adapter equals an independent numpy computation of the rule from the tensors the devices
    returned (and those are what each device's own loop checkpointed); (b) devices whose battery gate says pause or
    cool decline, and the aggregate is the rule over the others; (c) the server killed (SIGKILL) after round 1 was
    persisted resumes, and ends exactly where an uninterrupted run ends. Plus FFA-LoRA's frozen A, in process.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Array

from federated import state as fstate
from federated.aggregate import a_names, b_names, ffa, product_gap
from federated.config import FederateConfig
from ort_trainer import checkpoint
from ort_trainer import manifest as mf
from ort_trainer.adapter import load_lora, to_peft
from ort_trainer.bundle import open_bundle
from tests.conftest import REPO

DEVICES, ROUNDS, LOCAL_STEPS = 10, 3, 2
PAUSED, HOT = 3, 7          # device 3: battery at 10% all along; device 7: too hot in round 2 only


@pytest.fixture(scope="module")
def setup(tmp_path_factory, federation):
    root = tmp_path_factory.mktemp("federated")
    bundle, low = federation
    hot = root / "hot.csv"
    hot.write_text("t_s,percent,charging,temp_c\n0,80,0,30\n3600,80,0,50\n7200,80,0,35\n")
    return root, bundle, low, hot


def _argv(bundle, out, low, hot) -> list[str]:
    return [sys.executable, "-m", "pocketlora_cli", "federate", "--bundle", str(bundle), "--devices", str(DEVICES),
            "--rounds", str(ROUNDS), "--out", str(out), "--local-steps", str(LOCAL_STEPS), "--micro-batch", "2",
            "--lr", "5e-3", "--round-s", "3600", "--device-battery", f"{PAUSED}=replay:{low}",
            "--device-battery", f"{HOT}=replay:{hot}", "--keep-updates"]


def _run(argv, log: Path, timeout=600) -> None:
    with log.open("a") as f:
        proc = subprocess.run(argv, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, timeout=timeout)
    assert proc.returncode == 0, log.read_text()[-3000:]


@pytest.fixture(scope="module")
def straight(setup):
    root, bundle, low, hot = setup
    out = root / "straight"
    _run(_argv(bundle, out, low, hot), root / "straight.log")
    return out


def _npz(path: Path) -> dict[str, np.ndarray]:
    with np.load(path) as z:
        return {k.replace("|", "/"): z[k] for k in z.files}


def _rounds(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]


def test_aggregate_is_fedavg_of_returned_tensors(setup, straight):
    _, bundle, _, _ = setup
    man = open_bundle(bundle, verify="none").manifest
    rounds = _rounds(straight)
    assert [r["round"] for r in rounds] == [1, 2, 3]
    for r in rounds:
        d = straight / "updates" / f"round-{r['round']:03d}"
        updates, weights = [], []
        for dev in r["participants"]:
            u = _npz(d / f"device-{dev:03d}.npz")
            assert sorted(u) == sorted(man.trainable_names)     # FedAvg: devices send A and B, nothing else
            meta = json.loads((d / f"device-{dev:03d}.json").read_text())
            run = straight / "devices" / f"device-{dev:03d}" / f"round-{r['round']:03d}"
            if run.exists():        # devices keep their last two rounds: the update is their loop's last checkpoint
                path, _ = checkpoint.latest(run)
                saved = load_lora(path / checkpoint.ORT_FILE, man)
                assert all(np.array_equal(u[n], saved[n]) for n in u)
                steps = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
                assert len(steps) == LOCAL_STEPS and meta["tokens"] == sum(s["label_tokens"] for s in steps)
            updates.append(u)
            weights.append(meta["tokens"])
        assert weights == r["weights"] and len(set(weights)) > 1      # weighted by label tokens, not uniform
        w = np.asarray(weights, dtype=np.float64)
        expected = {n: (sum(wi * u[n].astype(np.float64) for wi, u in zip(w, updates)) / w.sum()) for n in updates[0]}
        got = _npz(d / "global.npz")
        for n, v in expected.items():
            np.testing.assert_allclose(got[n], v, rtol=1e-6, atol=1e-8, err_msg=n)
        assert r["product_gap"] > 0          # FedAvg's avg(B)·avg(A) is not avg(B·A)
        assert r["bytes_up"] == sum(sum(len(Array(v).data) + len(k) for k, v in u.items()) for u in updates)
    final = fstate.load(straight)
    assert final.round == ROUNDS
    assert all(np.array_equal(final.lora[n], got[n]) for n in final.lora)
    from safetensors.numpy import load_file

    peft = load_file(str(straight / "global" / "adapter_model.safetensors"))
    assert all(np.array_equal(peft[k], v) for k, v in to_peft(man, final.lora).items())


def test_declined_devices_change_nothing(straight):
    rounds = _rounds(straight)
    declined = [sorted(int(k) for k in r["declined"]) for r in rounds]
    assert declined == [[PAUSED], [PAUSED, HOT], [PAUSED]]
    for r in rounds:
        assert sorted(r["participants"] + [int(k) for k in r["declined"]]) == list(range(DEVICES))
        assert not r["failed"]
        assert "battery 10% < pause-below" in r["declined"][str(PAUSED)]
        files = sorted(p.name for p in (straight / "updates" / f"round-{r['round']:03d}").glob("device-*.npz"))
        assert files == [f"device-{d:03d}.npz" for d in r["participants"]]   # the rule ran over exactly these
    assert "temperature 50°C > max-temp" in rounds[1]["declined"][str(HOT)]
    assert not list((straight / "devices" / f"device-{PAUSED:03d}").glob("round-*"))   # it never trained
    final = json.loads((straight / "personalization.json").read_text())
    assert [int(d["device"]) for d in final["devices"]] == [d for d in range(DEVICES) if d != PAUSED]
    assert list(final["declined"]) == [str(PAUSED)]
    for d in final["devices"]:          # global-only, local-only and federated+personalized side by side
        for key in ("base", "global", "local-only", "personalized"):
            assert np.isfinite(d[f"{key}/private/loss"]) and np.isfinite(d[f"{key}/shared/loss"])
        assert d["personalized/private/loss"] < d["base/private/loss"]
    report = (straight / "report.md").read_text()
    assert "federated + personalized" in report and "local only" in report and "global only" in report


def test_server_resumes_after_kill(setup, straight):
    root, bundle, low, hot = setup
    out = root / "killed"
    log = root / "killed.log"
    with log.open("w") as f:
        proc = subprocess.Popen(_argv(bundle, out, low, hot), cwd=REPO, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        deadline = time.time() + 300
        st = None
        while time.time() < deadline and proc.poll() is None:
            if (out / fstate.STATE).exists() and (st := fstate.load(out)) is not None and st.round >= 1:
                break
            time.sleep(0.02)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)      # the server and its engine, as a kill of the host would
        proc.wait()
    assert st is not None and 1 <= st.round < ROUNDS, log.read_text()[-2000:]
    _run(_argv(bundle, out, low, hot), log)
    assert f"resuming after round {st.round}/{ROUNDS}" in log.read_text()
    a, b = fstate.load(out), fstate.load(straight)
    assert a.round == b.round == ROUNDS
    # Round 1 (persisted before the kill) is bitwise the same. Later rounds agree to float32 rounding: ORT's CPU
    # kernels give ULP-level differences depending on what ran before in the process (the rerun's devices start in
    # fresh processes), which training carries on (the device loop's own resume test allows 1e-6 over 24 steps).
    first = _npz(out / "updates" / "round-001" / "global.npz")
    assert all(np.array_equal(v, _npz(straight / "updates" / "round-001" / "global.npz")[n]) for n, v in first.items())
    for n in b.lora:
        np.testing.assert_allclose(a.lora[n], b.lora[n], rtol=1e-4, atol=1e-6, err_msg=n)
    for ra, rb in zip(_rounds(out), _rounds(straight)):
        assert (ra["participants"], ra["declined"], ra["weights"]) == (rb["participants"], rb["declined"], rb["weights"])
        assert ra["loss"] == pytest.approx(rb["loss"], rel=1e-5)


def test_ffa_freezes_a_and_averages_b_exactly(setup, tmp_path):
    """FFA-LoRA on the device side, in process: A stays bitwise at the bundle's init through local training, the
    device sends only B, and avg(B)·A equals the average of the devices' B·A."""
    from federated.device import train_round

    _, bundle, _, _ = setup
    b = open_bundle(bundle, verify="none")
    man = b.manifest
    init = load_lora(b.file(mf.CHECKPOINT), man)
    cfg = FederateConfig(bundle=str(bundle), devices=2, rounds=1, local_steps=3, strategy="ffa", micro_batch=2,
                         lr=5e-3).validate()
    start = {n: init[n] for n in b_names(man)}
    sent, weights = [], []
    for device in range(2):
        update, stats = train_round(cfg, tmp_path, device, 1, start)
        assert sorted(update) == sorted(b_names(man))
        run = tmp_path / "devices" / f"device-{device:03d}" / "round-001"
        path, _ = checkpoint.latest(run)
        trained = load_lora(path / checkpoint.ORT_FILE, man)
        assert all(np.array_equal(trained[n], init[n]) for n in a_names(man))       # frozen, bitwise
        assert not all(np.array_equal(trained[n], init[n]) for n in b_names(man))   # B did train
        sent.append(update)
        weights.append(stats["tokens"])
    frozen_a = {n: init[n] for n in a_names(man)}
    merged = ffa(sent, weights, frozen_a, b_names(man))
    assert product_gap(man, [{**frozen_a, **u} for u in sent], weights, merged) < 1e-6
    w = np.asarray(weights, dtype=np.float64)
    for n in b_names(man):
        np.testing.assert_allclose(merged[n], sum(wi * u[n].astype(np.float64) for wi, u in zip(w, sent)) / w.sum(),
                                   rtol=1e-6, atol=1e-8)
    from federated.apps import aggregate       # the server's path: the same rule, A from the global state

    server = aggregate(cfg, man, init, sent, weights)
    assert all(np.array_equal(server[n], merged[n]) for n in man.trainable_names)


def test_cli_flags_and_a_changed_setting_is_refused(tmp_path):
    from federated.cli import config_from_args
    from federated.config import FederateError, settle
    from ort_trainer.settings import NAMES
    from pocketlora_cli import build_parser

    args = build_parser().parse_args(["federate", "--bundle", "b", "--devices", "4", "--rounds", "2", "--out", "o",
                                      "--strategy", "ffa", "--device-battery", "2=replay:t.csv", "--clip", "0"])
    cfg = config_from_args(args).validate()
    assert (cfg.strategy, cfg.weight, cfg.local_steps, cfg.micro_batch, cfg.schedule, cfg.clip) == \
           ("ffa", "tokens", 4, 4, "constant", None)
    assert cfg.battery_of(2) == "replay:t.csv" and cfg.battery_of(1) == "none"
    assert set(FederateConfig.FIXED) >= set(NAMES)
    with pytest.raises(FederateError, match="devices are 0..3"):
        config_from_args(build_parser().parse_args(["federate", "--bundle", "b", "--devices", "4", "--rounds", "2",
                                                    "--out", "o", "--device-battery", "4=none"])).validate()
    (tmp_path / "federate.json").write_text(cfg.to_json())
    settle(tmp_path, FederateConfig.from_json(cfg.to_json()))
    with pytest.raises(FederateError, match="started with strategy='ffa'"):
        settle(tmp_path, FederateConfig.from_json(cfg.to_json().replace('"ffa"', '"fedavg"')))
