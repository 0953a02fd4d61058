"""The web runner's loop (android_runner/web) against the Python runner's (android_runner/loop.py): the battery
gate in the loop, and what the Python side does with a web run (export, eval, PEFT).

The gate tests run both loops on a replay trace whose clock advances a fixed amount per read instead of with wall
time (android_runner/web/test/loop_driver.mjs runs the Node CLI's main with it; the Python loop gets the same
clock through make_probe): every loop iteration then sees the same reading in both runners however long their
steps take, and the gate states logged per step and the checkpoints made on pause must be equal. A wall-clock run
of both command lines on the same trace checks the flags, metrics and summary fields.
"""
from __future__ import annotations

import functools
import json
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest

from tests.bundle_helpers import build_tiny_bundle
from tests.conftest import REPO, WEB
from tests.test_web_parity import finish, instruction_records, metrics

DRIVER = WEB / "test" / "loop_driver.mjs"
DRAIN = REPO / "tests" / "data" / "battery_drain.csv"
EVENING = REPO / "android_runner" / "traces" / "evening_charger.csv"
SETTINGS = dict(micro_batch=1, accum=1, lr=5e-3, warmup=3, seed=3)
SLOW_FACTOR, POLL_S = 0.9, 0.02      # short sleeps; the states do not depend on them


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("webloop")
    ckpt, bundle = build_tiny_bundle("gpt2", root)
    data = root / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in instruction_records(48, seed=1)))
    return root, ckpt, bundle, data


class CallClock:
    """A clock that advances `tick` per call. The replay probe calls it twice on its first read and once on each
    read after, in both runners: read k sees trace time k * tick * speed."""

    def __init__(self, tick: float = 1.0):
        self.calls, self.tick = 0, tick

    def __call__(self) -> float:
        t = self.calls * self.tick
        self.calls += 1
        return t


def _settings_argv(s: dict) -> list[str]:
    return ["--micro-batch", str(s["micro_batch"]), "--accum", str(s["accum"]), "--lr", repr(s["lr"]),
            "--warmup", str(s["warmup"]), "--seed", str(s["seed"])]


def node_virtual(bundle: Path, data: Path, run: Path, battery: str, steps: int, save_every: int,
                 extra: list[str] = ()) -> tuple[list[tuple[int, str]], list[str]]:
    """The Node CLI (cli.mjs main) on the per-read replay clock: (every checkpoint made (step, reason), log lines)."""
    job = run.parent / f"{run.name}-job.json"
    saves = run.parent / f"{run.name}-saves.json"
    argv = ["--bundle", str(bundle), "--data", str(data), "--out", str(run), "--max-steps", str(steps),
            *_settings_argv(SETTINGS), "--save-every", str(save_every), "--threads", "1", "--battery", battery,
            "--slow-factor", str(SLOW_FACTOR), *extra]
    job.write_text(json.dumps({"argv": argv, "tick": 1.0, "poll_s": POLL_S, "saves": str(saves)}))
    err = finish(subprocess.Popen(["node", str(DRIVER), str(job)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True))
    return [(s["step"], s["reason"]) for s in json.loads(saves.read_text())], err.splitlines()


def python_virtual(monkeypatch, bundle: Path, data: Path, run: Path, battery: str, steps: int,
                   save_every: int) -> tuple[list[tuple[int, str]], dict, list[str]]:
    """android_runner/loop.py's train on the same clock: (checkpoints made, summary, log lines)."""
    from android_runner import loop, probes
    from android_runner.gate import GateConfig
    from ort_trainer import checkpoint

    saves, logs = [], []
    save = checkpoint.save

    def recording_save(run_dir, session, state):
        saves.append((state["step"], state["reason"]))
        return save(run_dir, session, state)

    monkeypatch.setattr(checkpoint, "save", recording_save)
    monkeypatch.setattr(loop, "make_probe", functools.partial(probes.make_probe, clock=CallClock()))
    cfg = loop.RunConfig(bundle=str(bundle), data=str(data), max_steps=steps, save_every=save_every, threads=1,
                         battery=battery, gate=asdict(GateConfig(slow_factor=SLOW_FACTOR, poll_s=POLL_S)), **SETTINGS)
    summary = loop.train(cfg, run, log=logs.append, progress=False)
    return saves, summary, logs


def _per_step(run: Path) -> list[tuple]:
    return [(m["step"], m["gate"], m["battery_percent"], m["charging"], m["temp_c"]) for m in metrics(run)]


# Drain: slow below 60%, paused below 15% for 9 reads (a checkpoint at step 111, then none while it waits), full
# on the charger. Evening: slow, full on the charger, cooling for 5 reads right after the periodic checkpoint at
# step 31 (nothing new to save: no checkpoint), full.
@pytest.mark.parametrize("trace,steps,save_every,waits", [(DRAIN, 125, 20, "paused"), (EVENING, 45, 31, "cooling")],
                         ids=["drain", "evening"])
def test_gate_states_and_pause_checkpoints_match_python(trace, steps, save_every, waits, tiny, node_web, monkeypatch):
    root, _, bundle, data = tiny
    battery = f"replay:{trace}@60"
    py_run, web_run = root / f"gate-py-{trace.stem}", root / f"gate-web-{trace.stem}"
    py_saves, py_summary, py_logs = python_virtual(monkeypatch, bundle, data, py_run, battery, steps, save_every)
    web_saves, web_logs = node_virtual(bundle, data, web_run, battery, steps, save_every)

    py, web = _per_step(py_run), _per_step(web_run)
    assert web == py
    assert [s for _, s, *_ in py].count(waits) == 0 and len(py) == steps
    assert web_saves == py_saves
    web_summary = json.loads((web_run / "summary.json").read_text())
    transitions = lambda s: [(t["from"], t["to"], t["reason"]) for t in s["gate"]["transitions"]]  # noqa: E731
    assert transitions(web_summary) == transitions(py_summary)
    assert waits in [to for _, to, _ in transitions(py_summary)]
    assert web_summary["gate"]["seconds_in"][waits] > 0
    gate_lines = lambda lines: [x for x in lines if x.startswith("gate: ")]  # noqa: E731
    assert gate_lines(web_logs) == gate_lines(py_logs) and len(gate_lines(py_logs)) >= 3
    print(f"{trace.name}: {len(py)} steps, states {''.join(s[0] for _, s, *_ in py)}; checkpoints {py_saves}")
    assert (py, py_saves) == _expected_loop(trace, steps, save_every, slow_factor=SLOW_FACTOR)
    if waits == "paused":
        assert (111, "gate paused") in py_saves
    else:
        assert not any(r.startswith("gate") for _, r in py_saves) and (31, "periodic") in py_saves


def _expected_loop(trace: Path, steps: int, save_every: int, **gate) -> tuple[list[tuple], list[tuple[int, str]]]:
    """android_runner/loop.py's gate semantics over the per-read clock, without training: per step (step, state,
    percent, charging, temp), and the checkpoints (step, reason). Built on gate.py and probes.py only."""
    from android_runner.gate import GateConfig, GateTracker
    from android_runner.probes import ReplayProbe

    probe = ReplayProbe(trace, clock=CallClock(), speed=60)
    tracker = GateTracker(GateConfig(**gate))
    step, saved_at, per_step, saves = 0, 0, [], []
    while step < steps:
        r = probe.read()
        d = tracker.update(r, 0.01)
        if not d.run_step:
            if saved_at != step:
                saves.append((step, f"gate {d.state.value}"))
                saved_at = step
            continue
        step += 1
        per_step.append((step, d.state.value, r.percent, r.charging, r.temp_c))
        if step % save_every == 0 or step == steps:
            saves.append((step, "periodic" if step < steps else "final"))
            saved_at = step
    return per_step, saves


def test_web_loop_never_steps_while_paused_or_cooling(tiny, node_web, tmp_path):
    """A trace that pauses and cools several times, twice back to back: the Node loop's steps and checkpoints are
    exactly the ones gate.py's decisions allow (no step on a paused/cooling reading, one checkpoint per wait with
    progress since the last save)."""
    _, _, bundle, data = tiny
    rows = ([(80, 0, 30)] * 3 + [(50, 0, 30)] * 4 + [(12, 0, 30)] * 5 + [(40, 1, 45)] * 4 + [(40, 1, 38)] * 3
            + [(50, 0, 44)] * 3 + [(50, 0, 38)] * 2 + [(10, 0, 30)] * 2 + [(20, 0, 30)] * 3 + [(35, 0, 30)] * 2
            + [(35, 0, 43)] * 2 + [(9, 0, 38)] * 3 + [(90, 1, 30)] * 3)
    trace = tmp_path / "pauses.csv"
    trace.write_text("t_s,percent,charging,temp_c\n" + "".join(f"{60 * i},{p},{c},{t}\n" for i, (p, c, t) in enumerate(rows)))
    steps, save_every = 22, 5
    want_steps, want_saves = _expected_loop(trace, steps, save_every, slow_factor=SLOW_FACTOR)
    reads = len(rows) - 1                          # read k shows row k (the first row is never read)
    assert len(want_steps) == steps and reads - steps >= 15, "the trace must wait (pause/cool) many times"
    run = tmp_path / "web"
    web_saves, _ = node_virtual(bundle, data, run, f"replay:{trace}@60", steps, save_every)
    got = _per_step(run)
    assert not [g for g in got if g[1] in ("paused", "cooling")], "the web loop trained while the gate said wait"
    assert got == want_steps
    assert web_saves == want_saves
    assert sum(r.startswith("gate paused") for _, r in want_saves) >= 2
    assert sum(r.startswith("gate cooling") for _, r in want_saves) >= 2


def test_both_command_lines_on_a_wall_clock_replay(tiny, node_web, tmp_path):
    """`pocketlora train` and `node cli.mjs train` with the same flags and a replay on wall time: slow on battery,
    then (after 50 ms, before the 60th step of either runner) full on the charger; the same metrics fields per
    step, the summary's fields (gate, energy) and run.json's gate settings."""
    _, _, bundle, data = tiny
    trace = tmp_path / "plug_in.csv"
    trace.write_text("t_s,percent,charging,temp_c,current_a,voltage_v\n0,35,0,30,-0.4,3.9\n3,36,1,31,2.0,4.0\n")
    flags = ["--bundle", str(bundle), "--data", str(data), "--max-steps", "60", *_settings_argv(SETTINGS),
             "--save-every", "100", "--threads", "1", "--battery", f"replay:{trace}@60", "--max-temp", "60",
             "--pause-below", "10", "--resume-above", "20", "--slow-below", "50", "--slow-factor", "0.8"]
    py_run, web_run = tmp_path / "py", tmp_path / "web"
    py = subprocess.run([sys.executable, "-m", "pocketlora_cli", "train", *flags, "--out", str(py_run)], cwd=REPO,
                        capture_output=True, text=True, timeout=600)
    assert py.returncode == 0, py.stderr
    web = subprocess.Popen(["node", str(WEB / "cli.mjs"), "train", *flags, "--out", str(web_run)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    err = finish(web)
    for line in ("battery probe: requested with", "gate: slow (battery 35% < slow-below 50%", "gate: full (charging"):
        assert line in err and line in py.stdout, line
    pm, wm = metrics(py_run), metrics(web_run)
    assert [set(m) for m in wm] == [set(m) for m in pm]
    for m in (pm, wm):
        states = [x["gate"] for x in m]
        assert states[0] == "slow" and states[-1] == "full" and states == sorted(states, key=("slow", "full").index)
        assert m[0]["battery_percent"] == 35 and m[0]["charging"] is False
    ps, ws = (json.loads((r / "summary.json").read_text()) for r in (py_run, web_run))
    measured = {"energy_measured_j", "energy_measured_over_s", "energy_measured_basis"}   # only with >= 2 readings
    assert set(ps) - measured <= set(ws) and ws["runner"] == "web"         # on battery: timing (EnergyMeter test)
    for s in (ps, ws):
        assert [(t["from"], t["to"]) for t in s["gate"]["transitions"]] == [("full", "slow"), ("slow", "full")]
        assert s["battery_percent_start"] == 35 and s["cpu_seconds"] > 0 and s["energy_estimate_j"] > 0
        assert s["peak_rss_mb"] > 0 and s["finished"]
    assert ws["energy_estimate_basis"] == ps["energy_estimate_basis"]
    assert ws["data_report"] == json.loads(json.dumps(ps["data_report"]))
    pr, wr = (json.loads((r / "run.json").read_text()) for r in (py_run, web_run))
    assert wr["gate"] == pr["gate"] and wr["battery"] == pr["battery"]


def test_energy_meter_matches_python():
    """src/energy.mjs against android_runner/metrics.EnergyMeter on the same readings and times: measured from
    current x voltage and from energy_now while discharging, nothing while charging, percents start/end."""
    from android_runner.metrics import EnergyMeter
    from android_runner.probes import BatteryReading

    readings = [(0.0, dict(percent=50, charging=False, temp_c=30, current_a=-0.5, voltage_v=3.9)),
                (10.0, dict(percent=49.5, charging=False, temp_c=30, current_a=-0.7, voltage_v=3.8)),
                (25.0, dict(percent=49, charging=None, temp_c=30, current_a=-0.7, voltage_v=3.8)),
                (30.0, dict(percent=49, charging=False, temp_c=31, energy_wh=10.0)),
                (42.5, dict(percent=48, charging=False, temp_c=31, energy_wh=9.97)),
                (50.0, dict(percent=48, charging=True, temp_c=31, current_a=1.0, voltage_v=4.1, energy_wh=9.99)),
                (61.0, dict(percent=None, charging=None, temp_c=None))]
    meter = EnergyMeter()
    for t, r in readings:
        meter.add(BatteryReading(**r), t)
    want = meter.summary(61.0)
    script = ("import { EnergyMeter } from './src/energy.mjs';"
              "const m = new EnergyMeter({ cpuSeconds: () => 0 });"
              f"for (const [t, r] of {json.dumps(readings)}) m.add(r, t);"
              "console.log(JSON.stringify(m.summary(61)));")
    got = json.loads(subprocess.run(["node", "--input-type=module", "-e", script], cwd=WEB, capture_output=True,
                                    text=True, check=True).stdout)
    cpu = {"cpu_seconds", "energy_estimate_j"}
    assert {k: v for k, v in got.items() if k not in cpu} == {k: v for k, v in want.items() if k not in cpu}
    assert want["energy_measured_j"] > 0 and set(got) == set(want)


def test_node_cli_gate_flag_errors(tiny, node_web, tmp_path):
    _, _, bundle, data = tiny
    base = ["node", str(WEB / "cli.mjs"), "train", "--bundle", str(bundle), "--data", str(data), "--out",
            str(tmp_path / "r"), "--max-steps", "2"]
    for extra, text in ((["--battery", "browser"], "--battery browser: the Battery Status API is the page's"),
                        (["--battery", "dumpsys"], "the Python runner's only"),
                        (["--battery", "replay:/nonexistent.csv"], "cannot read replay trace"),
                        (["--pause-below", "40", "--resume-above", "30"], "pause_below (40) must be < resume_above (30)"),
                        (["--slow-factor", "x"], "--slow-factor: invalid float value")):
        r = subprocess.run(base + extra, capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and text in r.stderr and r.stderr.count("\n") <= 3, (extra, r.stderr)


def test_export_and_eval_of_a_web_run(tiny, node_web, tmp_path):
    """`pocketlora export --run WEBRUN --peft P` writes an adapter PEFT loads, whose LoRA weights are the web
    checkpoint's tensors (read here with safetensors.numpy, not through the export code); `pocketlora eval ppl
    --run WEBRUN` scores with them (equal to scoring the exported adapter, unlike the base model)."""
    import torch
    from peft import PeftModel
    from safetensors.numpy import load_file
    from transformers import AutoModelForCausalLM

    from ort_trainer.manifest import Manifest

    root, ckpt, bundle, data = tiny
    run = tmp_path / "web"
    finish(subprocess.Popen(["node", str(WEB / "cli.mjs"), "train", "--bundle", str(bundle), "--data", str(data),
                             "--out", str(run), "--max-steps", "6", "--save-every", "4", *_settings_argv(SETTINGS),
                             "--threads", "1", "--battery", "none"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    newest = sorted((run / "checkpoints").glob("step-*"))[-1]
    assert newest.name == "step-00000006"
    web = load_file(str(newest / json.loads((newest / "state.json").read_text())["weights_file"]))

    peft_dir = tmp_path / "adapter"
    cli = lambda *a: subprocess.run([sys.executable, "-m", "pocketlora_cli", *a], cwd=REPO,  # noqa: E731
                                    capture_output=True, text=True, timeout=600)
    r = cli("export", "--run", str(run), "--peft", str(peft_dir))
    assert r.returncode == 0, r.stderr
    assert "(step 6)" in r.stdout

    base = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, peft_dir).eval()
    params = {n.replace(".default", ""): p.detach().numpy() for n, p in model.named_parameters() if "lora_" in n}
    man = Manifest.load(bundle)
    assert len(params) == len(man.trainable) > 0
    for t in man.trainable:
        got, want = params[t.peft_key], web[t.onnx_name]
        want = want if want.shape == got.shape else want.T    # the ONNX graph may hold a LoRA matrix transposed
        assert got.shape == want.shape and np.array_equal(got, want), t.peft_key
    assert any(np.abs(web[t.onnx_name]).max() > 0 for t in man.trainable if "lora_B" in t.peft_key)

    text = tmp_path / "text.txt"
    text.write_text(" ".join(r["instruction"] + " " + r["output"] for r in instruction_records(30, seed=7)))
    ppl = {}
    for name, weights in (("run", ["--run", str(run)]), ("peft", ["--peft", str(peft_dir)]), ("base", [])):
        out = tmp_path / f"ppl-{name}.json"
        r = cli("eval", "ppl", "--bundle", str(bundle), "--data", str(text), *weights, "--threads", "1",
                "--out", str(out))
        assert r.returncode == 0, r.stderr
        ppl[name] = json.loads(out.read_text())["ppl"]
    print(f"ppl of the web run {ppl['run']:.4f}, its exported adapter {ppl['peft']:.4f}, base {ppl['base']:.4f}")
    assert ppl["run"] == pytest.approx(ppl["peft"], rel=1e-6) and ppl["run"] != ppl["base"]
