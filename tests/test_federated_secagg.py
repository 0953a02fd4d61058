"""Secure aggregation in a federated run (federated/secure.py: Flower's SecAgg+ mod and workflow).

One module fixture runs the same federation twice on the simulation engine (4 devices on the tiny GPT-2, 2 rounds,
1 local step, micro-batch 2, device 2 declined by a low battery): with --secagg and without. Checked against
independent computations:

- every round's secure global adapter equals numpy's token-weighted mean of what the devices trained (read from
  the devices' own checkpoints, which the server never saw; they started from the secure global of the round
  before, checked by their start fingerprint) within SecAgg+'s quantization error, and so does the loss;
- round 1 against the run without SecAgg: the same device tensors (training is bitwise reproducible), and the
  plain global within the same bound (round 2 starts from globals that differ by the quantization, and Adam's
  first step, ~lr x sign(grad), does not keep such differences small, so round 2 is checked against its own
  devices only);
- the declined device took part in every protocol stage with weight 0 and changed nothing (with weight 1 the mean
  would move far outside the bound);
- the server kept no device's tensors (updates/ holds the global only) and records no device's loss.

The bound. A device with weight w sends SR((x * w/M + C) * T/(2C)) (secaggplus_mod._collect_masked_vectors,
quantization.quantize), SR stochastic rounding (error < 1 step) after float32 arithmetic (< 0.4 step near 2^21);
the server divides the dequantized sum by sum(w)/M. So per value

    |secure - fedavg| <= 2 * (2C/T) * k * M / sum(w)

with C = clipping_range (--secagg-clip, 1), T = quantization_range (2^22), M = max_weight (the smallest power of
two >= local_steps x micro_batch x accum x seq_len = 128, so w/M is exact), k the devices that trained; plus
float32 rounding of the result. Here about 1.5e-5, against values up to ~0.13.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from federated.device import fingerprint
from ort_trainer import checkpoint
from ort_trainer import manifest as mf
from ort_trainer.adapter import load_lora
from ort_trainer.bundle import open_bundle
from tests.bundle_helpers import SEQ_LEN
from tests.conftest import REPO

DEVICES, ROUNDS, PAUSED, MICRO_BATCH = 4, 2, 2, 2
C, T = 1.0, 2 ** 22
M = 128                 # the smallest power of 2 >= 1 step x micro-batch 2 x accum 1 x seq_len 64
LOSS_RANGE = 64.0       # secure.py: the loss rides in the masked vector as loss * C / 64
assert M >= 1 * MICRO_BATCH * 1 * SEQ_LEN > M // 2


def _argv(bundle, out, low, *extra) -> list[str]:
    return [sys.executable, "-m", "pocketlora_cli", "federate", "--bundle", str(bundle), "--devices", str(DEVICES),
            "--rounds", str(ROUNDS), "--out", str(out), "--local-steps", "1", "--micro-batch", str(MICRO_BATCH),
            "--lr", "5e-3", "--personalize-steps", "0", "--device-battery", f"{PAUSED}=replay:{low}",
            "--keep-updates", *extra]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, federation):
    root = tmp_path_factory.mktemp("federated-secagg")
    bundle, low = federation
    wall = {}
    for name, extra in (("secure", ["--secagg"]), ("plain", [])):
        t0 = time.time()
        proc = subprocess.run(_argv(bundle, root / name, low, *extra), cwd=REPO, capture_output=True, text=True,
                              timeout=600)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
        wall[name] = time.time() - t0
        (root / f"{name}.log").write_text(proc.stdout + proc.stderr)
    return bundle, root / "secure", root / "plain", wall


def _npz(path: Path) -> dict[str, np.ndarray]:
    with np.load(path) as z:
        return {k.replace("|", "/"): z[k] for k in z.files}


def _rounds(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]


def _bound(weights) -> float:
    return 2 * (2 * C / T) * len(weights) * M / sum(weights)


def _device_round(bundle, out: Path, device: int, rnd: int) -> tuple[dict[str, np.ndarray], int, float, str]:
    """What the device itself holds of a round: its trained LoRA (last checkpoint), label tokens, mean loss and
    the fingerprint of the tensors it started from."""
    man = open_bundle(bundle, verify="none").manifest
    run = out / "devices" / f"device-{device:03d}" / f"round-{rnd:03d}"
    path, _ = checkpoint.latest(run)
    steps = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return (load_lora(path / checkpoint.ORT_FILE, man), sum(s["label_tokens"] for s in steps),
            float(np.mean([s["loss"] for s in steps])), (run / "start.sha256").read_text())


def _within(got: dict, want: dict, bound: float, names) -> float:
    """max |got - want| over all values, asserting it is within bound (+ float32 rounding of the result)."""
    worst = 0.0
    for n in names:
        err = np.abs(got[n].astype(np.float64) - want[n])
        assert np.all(err <= bound + 2.0 ** -23 * np.abs(want[n])), (n, float(err.max()), bound)
        worst = max(worst, float(err.max()))
    return worst


def test_secure_global_is_weighted_mean_within_quantization(runs):
    bundle, secure, plain, _ = runs
    b = open_bundle(bundle, verify="none")
    names = b.manifest.trainable_names
    before = load_lora(b.file(mf.CHECKPOINT), b.manifest)       # round 1 starts from the bundle's init
    for r, rp in zip(_rounds(secure), _rounds(plain)):
        assert r["secagg"] is True and "secagg" not in rp
        assert r["participants"] == [d for d in range(DEVICES) if d != PAUSED]
        held = {d: _device_round(bundle, secure, d, r["round"]) for d in r["participants"]}
        for d, (_, _, _, start) in held.items():       # each device trained from the previous secure global
            assert start == fingerprint(before), (r["round"], d)
        weights = [held[d][1] for d in r["participants"]]
        assert r["weights"] == weights and len(set(weights)) > 1       # token-weighted, not uniform
        w = np.asarray(weights, dtype=np.float64)
        expected = {n: sum(wi * held[d][0][n].astype(np.float64) for wi, d in zip(w, r["participants"])) / w.sum()
                    for n in names}
        bound = _bound(weights)
        assert r["secagg_detail"]["error_bound"] == pytest.approx(bound, rel=1e-12)
        got = _npz(secure / "updates" / f"round-{r['round']:03d}" / "global.npz")
        worst = _within(got, expected, bound, names)
        assert 0 < worst, "bitwise the plain mean: SecAgg+'s quantization did not happen"
        loss = sum(wi * held[d][2] for wi, d in zip(w, r["participants"])) / w.sum()
        assert abs(r["loss"] - loss) <= bound * LOSS_RANGE / C + 1e-6
        if r["round"] == 1:     # the same start as the plain run: the same device tensors, the same FedAvg
            for d in r["participants"]:
                u = _npz(plain / "updates" / "round-001" / f"device-{d:03d}.npz")
                assert all(np.array_equal(u[n], held[d][0][n]) for n in names)
            assert rp["weights"] == weights
            g_plain = _npz(plain / "updates" / "round-001" / "global.npz")
            _within(got, {n: g_plain[n].astype(np.float64) for n in names}, bound + 1e-7, names)
            assert abs(r["loss"] - rp["loss"]) <= bound * LOSS_RANGE / C + 1e-6
        before = got


def test_declined_device_takes_part_with_weight_zero(runs):
    bundle, secure, _, _ = runs
    names = open_bundle(bundle, verify="none").manifest.trainable_names
    for r in _rounds(secure):
        assert list(r["declined"]) == [str(PAUSED)] and "battery 10% < pause-below" in r["declined"][str(PAUSED)]
        assert not r["failed"] and r["missing"] == 0 and r["secagg_detail"]["released"]
        stages = r["secagg_detail"]["stages"]
        assert list(stages) == ["setup", "share_keys", "collect_masked_vectors", "unmask"]
        assert all(s["answered"] == DEVICES for s in stages.values())     # the declined one in every stage
    assert not list((secure / "devices" / f"device-{PAUSED:03d}").glob("round-*"))     # it never trained
    # The check above is sensitive to it: the declined device's zero vector with weight 1 instead of 0 would
    # move the mean by mean / (sum(w) + 1), far outside the bound.
    r = _rounds(secure)[0]
    held = {d: _device_round(bundle, secure, d, 1)[0] for d in r["participants"]}
    w = np.asarray(r["weights"], dtype=np.float64)
    mean = {n: sum(wi * held[d][n].astype(np.float64) for wi, d in zip(w, r["participants"])) / w.sum()
            for n in names}
    shift = max(float(np.max(np.abs(mean[n] * (1 - w.sum() / (w.sum() + 1))))) for n in names)
    assert shift > 50 * _bound(r["weights"])


def test_server_never_held_a_device_tensor(runs):
    _, secure, plain, wall = runs
    for r in _rounds(secure):
        d = secure / "updates" / f"round-{r['round']:03d}"
        assert sorted(p.name for p in d.iterdir()) == ["global.npz"]          # --keep-updates: the global only
        assert r["device_loss"] is None and r["product_gap"] is None
        # What went up in the masked stage: one int64 vector per device, the declined one too (a quantized,
        # masked value per tensor value, plus the loss and the weight factor), not float32 tensors.
        values = sum(v.size for v in _npz(d / "global.npz").values())
        up = r["secagg_detail"]["stages"]["collect_masked_vectors"]["up"]
        assert DEVICES * (values + 2) * 8 <= up < DEVICES * (values + 2) * 8 * 1.1
    assert sorted(p.name for p in (plain / "updates" / "round-001").glob("device-*.npz")) == \
        [f"device-{d:03d}.npz" for d in range(DEVICES) if d != PAUSED]
    report = (secure / "report.md").read_text()
    assert "Secure aggregation (Flower's SecAgg+" in report
    secs = {name: [r["seconds"] for r in _rounds(out)] for name, out in (("secure", secure), ("plain", plain))}
    print(f"\nseconds per round: {secs}; whole runs: {wall}")


def test_cli_flags_and_refused_combinations(tmp_path):
    from federated.cli import config_from_args
    from federated.config import FederateConfig, FederateError, settle
    from pocketlora_cli import build_parser

    base = ["federate", "--bundle", "b", "--devices", "5", "--rounds", "2", "--out", "o"]
    cfg = config_from_args(build_parser().parse_args(base + ["--secagg", "--secagg-shares", "3",
                                                             "--secagg-clip", "0.5"])).validate()
    assert (cfg.secagg, cfg.secagg_shares, cfg.secagg_threshold, cfg.secagg_clip) == (True, 3, 0, 0.5)
    from federated import secure

    assert (secure.shares(cfg), secure.threshold(cfg)) == (3, 2)
    assert {"secagg", "secagg_shares", "secagg_threshold", "secagg_clip"} <= set(cfg.FIXED)
    for extra, message in (
            (["--secagg", "--dp-noise", "1", "--dp-clip", "1"], "--secagg with --dp-noise"),
            (["--secagg", "--weight", "examples"], "use --weight tokens"),
            (["--secagg", "--secagg-shares", "4"], "--secagg-shares 4"),
            (["--secagg", "--secagg-threshold", "5"], "--secagg-threshold 5"),
            (["--secagg", "--secagg-clip", "3"], "power of 2"),
            (["--secagg-clip", "2"], "need --secagg")):
        with pytest.raises(FederateError, match=message):
            config_from_args(build_parser().parse_args(base + extra)).validate()
    # A run started before these settings existed (no secagg keys in its federate.json) still resumes without.
    old = json.loads(FederateConfig(bundle="b", devices=4, rounds=2).to_json())
    for k in FederateConfig.LATER:
        del old[k]
    (tmp_path / "federate.json").write_text(json.dumps(old))
    settle(tmp_path, FederateConfig(bundle="b", devices=4, rounds=2))
    with pytest.raises(FederateError, match="started with secagg=False"):
        settle(tmp_path, FederateConfig(bundle="b", devices=4, rounds=2, secagg=True))
    with pytest.raises(FederateError, match="at least 3 devices"):
        config_from_args(build_parser().parse_args(
            ["federate", "--bundle", "b", "--devices", "2", "--rounds", "1", "--out", "o", "--secagg"])).validate()


def test_mod_passes_other_messages_through():
    """secure.secagg_mod hands Flower's secaggplus_mod only SecAgg+ messages: a plain train message (the
    non-secure rounds) goes to the app untouched, where secaggplus_mod alone would raise."""
    from flwr.app import ConfigRecord, Context, Message, MessageType, Metadata, RecordDict
    from flwr.client.mod import secaggplus_mod

    from federated.secure import secagg_mod

    meta = Metadata(run_id=1, message_id="m", src_node_id=0, dst_node_id=1, reply_to_message_id="", group_id="1",
                    created_at=time.time(), ttl=60.0, message_type=MessageType.TRAIN)
    msg = Message(content=RecordDict({"config": ConfigRecord({"round": 1})}), metadata=meta)
    ctx = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})
    called = []
    assert secagg_mod(msg, ctx, lambda m, c: called.append(m) or m) is msg and called == [msg]
    with pytest.raises(KeyError):
        secaggplus_mod(msg, ctx, lambda m, c: m)
