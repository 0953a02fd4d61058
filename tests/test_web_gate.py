"""The web runner's battery gate (android_runner/web/src/gate) against the Python one (android_runner/gate.py,
probes.py): the same trace on the same fake clock must give the same readings, the same sequence of gate states,
sleeps and reasons, and the same run summary; termux JSON, config errors and trace-file errors must come out the
same. The JS side runs through android_runner/web/test/gate_sim.mjs; its JS-only tests (browser probe, auto,
SafeProbe, the termux command, loading without Node built-ins) are android_runner/web/test/gate.test.mjs.
The gate modules need no npm package: these tests need `node`, not node_modules.
"""
from __future__ import annotations

import json
import math
import random
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO, WEB

from android_runner.gate import GateConfig, GateState, GateTracker
from android_runner.probes import ProbeError, TermuxProbe, make_probe

TRACES = {"evening": REPO / "android_runner" / "traces" / "evening_charger.csv",
          "drain": REPO / "tests" / "data" / "battery_drain.csv"}
READING = ("percent", "charging", "temp_c", "current_a", "voltage_v", "energy_wh", "charge_ah", "source")

# Configs: the defaults, and ones under which every state shows up on each trace.
CONFIGS = {
    "defaults": {},
    "slow_quarter": dict(slow_factor=0.25),
    "no_hysteresis": dict(cool_hysteresis=0.0),
    # drain: SLOW from the start, COOLING at 32.1°C, PAUSED below 40%, still COOLING on the charger;
    # evening: PAUSED at 35%, FULL charging, COOLING from 32.3°C
    "everything": dict(slow_below=80.0, slow_factor=0.3, pause_below=40.0, resume_above=45.0, max_temp=32.0,
                       cool_hysteresis=0.3, poll_s=45.0),
    # odd numbers for the texts: "12%" (0.125 -> 12.5 rounds half to even), 57.5%, 33.05°C, 32.9°C ...
    "odd": dict(slow_below=57.5, slow_factor=0.125, pause_below=12.25, resume_above=33.333, max_temp=33.05,
                cool_hysteresis=0.15, poll_s=17.5),
    "evening_all": dict(slow_below=37.0, slow_factor=0.625, pause_below=34.5, resume_above=34.9, max_temp=36.95,
                        cool_hysteresis=1.0, poll_s=20.0),
}
# (suffix for the spec, start of the fake clock, initial state, step durations cycled by the runner)
RUNS = {
    "1x": ("", 0.0, "full", [10.0]),
    "40x": ("@40", 1000.5, "full", [0.25, 0.3, 0.1875]),            # 10 / 12 / 7.5 trace seconds per step
    "odd_steps": ("@1.5", 3.7, "paused", [7.3, 12.1, 0.0, -1.0, math.nan, math.inf, 9.99]),
}


def encode(o):
    if isinstance(o, float) and not math.isfinite(o):
        return {"$float": "nan" if math.isnan(o) else ("inf" if o > 0 else "-inf")}
    if isinstance(o, dict):
        return {k: encode(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [encode(v) for v in o]
    return o


def decode(o):
    if isinstance(o, dict):
        if set(o) == {"$float"}:
            return float(o["$float"])
        return {k: decode(v) for k, v in o.items()}
    if isinstance(o, list):
        return [decode(v) for v in o]
    return o


def run_js(job: dict, tmp_path: Path) -> dict:
    node = shutil.which("node")
    if node is None:
        pytest.fail("node (>= 20) is required for the web gate tests")
    job_file, out_file = tmp_path / "gate_job.json", tmp_path / "gate_out.json"
    job_file.write_text(json.dumps(encode(job), allow_nan=False))
    proc = subprocess.run([node, "test/gate_sim.mjs", str(job_file), str(out_file)], cwd=WEB,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return decode(json.loads(out_file.read_text()))


def fields(reading) -> dict:
    return {k: getattr(reading, k) for k in READING}


class FakeClock:
    def __init__(self, t: float):
        self.t = t

    def __call__(self) -> float:
        return self.t


def simulate_py(spec: str, config: dict, initial: str, t_start: float, steps: list[float]) -> dict:
    """gate_sim.mjs's loop in Python: a step takes steps[i % n] seconds (its finite positive part moves the
    clock), then the runner sleeps sleep_s; while paused/cooling it only sleeps."""
    clock = FakeClock(t_start)
    probe = make_probe(spec, clock=clock, log=lambda m: None)
    tracker = GateTracker(GateConfig(**config), initial=GateState(initial), clock=clock)
    decisions, i = [], 0
    while probe.elapsed() <= probe.duration_s:
        reading = probe.read()
        step = steps[i % len(steps)]
        i += 1
        d = tracker.update(reading, step)
        decisions.append([clock.t, fields(reading), d.state.value, d.sleep_s, d.run_step, d.reason, d.changed])
        taken = step if math.isfinite(step) and step > 0 else 0.0
        clock.t += (taken if d.run_step else 0.0) + d.sleep_s
    tracker.finish()
    return {"decisions": decisions, "summary": json.loads(json.dumps(tracker.summary())),
            "seconds_in": {s.value: v for s, v in tracker.seconds_in.items()}, "state": tracker.state.value}


def same_number(a, b) -> bool:
    return (a is None and b is None) or (isinstance(a, (int, float)) and isinstance(b, (int, float)) and (
        (math.isnan(a) and math.isnan(b)) or a == b))


def same_reading(a: dict, b: dict) -> bool:
    return all(a[k] == b[k] if k in ("charging", "source") else same_number(a[k], b[k]) for k in READING)


def synthetic_trace(path: Path, seed: int) -> Path:
    """A messy trace: unknown charging/temperature/percent cells, text booleans, quoted cells, repeated and
    irregular times, decimals near the thresholds, blank lines, CRLF."""
    rng = random.Random(seed)
    lines, t, pct, temp = ["t_s,percent,charging,temp_c,current_a,voltage_v"], 0.0, 64.0, 33.0
    for i in range(400):
        t += rng.choice([0.0, 7.0, 30.0, 60.0, 61.5, 0.25])
        drift = -0.6 if i < 250 else 0.5                # down to empty, then back up
        pct = min(100.0, max(0.0, pct + drift + rng.choice([-1.0, -0.5, -0.25, 0.0, 0.5, 1.0, -2.0, 3.0, -0.125])))
        temp = min(48.0, max(25.0, temp + rng.choice([-0.7, -0.3, 0.0, 0.4, 0.9, -1.1, 1.6])))
        charging = rng.choice(["1", "0", "true", "false", "yes", "no", "", "TRUE", " 0 ", "No"])
        cells = [f"{t:g}", "" if rng.random() < 0.05 else f"{pct:g}", charging,
                 "" if rng.random() < 0.08 else f"{temp:.2f}", rng.choice(["", "-0.42", "1.5e-1", " 2 "]),
                 rng.choice(["", "4.1"])]
        if rng.random() < 0.1:
            cells[1] = f'"{cells[1]}"'
        if rng.random() < 0.15:
            cells = cells[:4]                       # a short row: the optional columns are missing
        lines.append(",".join(cells))
        if rng.random() < 0.03:
            lines.append("")
    path.write_text("\r\n".join(lines) + "\r\n", newline="")
    return path


@pytest.fixture(scope="module")
def traces(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("gate_traces")
    return {**TRACES, "synthetic": synthetic_trace(tmp / "synthetic.csv", 7)}


def test_same_trace_same_gate_states(traces, tmp_path):
    sims = []
    for trace, path in traces.items():
        for cfg_name, config in CONFIGS.items():
            for run_name, (suffix, t_start, initial, steps) in RUNS.items():
                sims.append({"id": f"{trace}/{cfg_name}/{run_name}", "spec": f"replay:{path}{suffix}", "config": config,
                             "initial": initial, "t_start": t_start, "steps": steps})
    js = run_js({"sims": sims}, tmp_path)["sims"]

    seen: dict[str, set[str]] = {t: set() for t in traces}
    counts = {}
    for sim in sims:
        py = simulate_py(sim["spec"], sim["config"], sim["initial"], sim["t_start"], sim["steps"])
        got = js[sim["id"]]
        for k, (a, b) in enumerate(zip(py["decisions"], got["decisions"])):   # the first difference, if any
            where = f"{sim['id']} decision {k} at t={a[0]}"
            assert a[0] == b[0], where                                  # the fake clocks agree exactly
            assert same_reading(a[1], b[1]), f"{where}: reading {a[1]} != {b[1]}"
            assert (a[2], round(a[3], 9), a[4], a[5], a[6]) == (b[2], round(b[3], 9), b[4], b[5], b[6]), where
        assert len(got["decisions"]) == len(py["decisions"]), sim["id"]
        assert got["summary"] == py["summary"], sim["id"]
        assert got["state"] == py["state"]
        for s, v in py["seconds_in"].items():
            assert round(got["seconds_in"][s], 9) == round(v, 9), (sim["id"], s)
        seen[sim["id"].split("/")[0]].update(d[2] for d in py["decisions"])
        counts[sim["id"]] = len(py["decisions"])
    # The configs do exercise every state on every trace; some compressed runs wait out most of a trace in a
    # few polls (poll_s is real time), the rest are long.
    for trace, states in seen.items():
        assert states == {s.value for s in GateState}, (trace, states)
    assert min(counts.values()) >= 5 and sum(counts.values()) >= 15000, counts


def test_known_transitions_on_the_evening_trace(tmp_path):
    """An anchor independent of the Python side: test_gate.py's expectations, from the JS gate."""
    sim = {"id": "e", "spec": f"replay:{TRACES['evening']}", "config": {}, "initial": "full", "t_start": 0.0,
           "steps": [10.0]}
    summary = run_js({"sims": [sim]}, tmp_path)["sims"]["e"]["summary"]
    assert [(x["t_s"], x["from"], x["to"]) for x in summary["transitions"]] == [
        (0.0, "full", "slow"), (300.0, "slow", "full"), (1920.0, "full", "cooling"), (2220.0, "cooling", "full")]
    assert summary["transitions"][2]["reason"] == "temperature 43.5°C > max-temp 42°C"
    assert summary["transitions"][3]["reason"].startswith("cooled to 38.6°C <= 39°C; charging")
    assert summary["seconds_in"]["cooling"] == 300.0 and summary["seconds_in"]["slow"] == 300.0


TERMUX_SAMPLES = {
    "charging": '{"health":"GOOD","percentage":57,"plugged":"PLUGGED_USB","status":"CHARGING",'
                '"temperature":30.1,"current":-250000}',
    "full_fields": '{"health":"GOOD","percentage":88,"plugged":"PLUGGED_AC","status":"FULL","temperature":35.5,'
                   '"current":1234567,"voltage":4321,"charge_counter":3500000}',
    "discharging": '{"percentage":14,"plugged":"UNPLUGGED","status":"DISCHARGING","temperature":29.75}',
    "not_charging": '{"percentage":80,"plugged":"PLUGGED_AC","status":"NOT_CHARGING"}',
    "unknown_plugged": '{"percentage":40,"plugged":"PLUGGED_WIRELESS","status":"UNKNOWN"}',
    "unknown_unplugged": '{"percentage":40,"plugged":"UNPLUGGED","status":"UNKNOWN"}',
    "lowercase": '{"percentage":40,"status":"charging"}',
    "only_percentage": '{"percentage":33}',
    "percentage_null": '{"percentage":null,"status":"CHARGING","temperature":31}',
    "percentage_text": '{"percentage":" 57.5 ","temperature":"30.2","current":"abc","voltage":true}',
    "percentage_out_of_range": '{"percentage":120,"charge_counter":0,"voltage":-1}',
    "percentage_negative": '{"percentage":-3,"charge_counter":-5}',
    "nan_and_inf": '{"percentage":NaN,"temperature":Infinity,"current":-Infinity}',
    "status_number": '{"percentage":50,"status":2,"plugged":0}',
    "status_empty_plugged_list": '{"percentage":50,"status":"","plugged":["X"]}',
    "nested_values": '{"percentage":{"v":1},"temperature":[30]}',
    "whitespace": '\n  {"percentage": 61, "status": "DISCHARGING"}\n',
    "not_json": "termux-api not installed",
    "not_json_long": "error: " + "x" * 300 + "  ",
    "empty": "",
    "truncated": '{"percentage": 57, "status": "CHARG',
    "no_percentage": '{"status":"CHARGING"}',
    "empty_object": "{}",
    "array": '[{"percentage":50}]',
    "null": "null",
    "number": "57",
    "nan_key": '{"percentage":50, NaN: 1}',
    "trailing_garbage": '{"percentage":50} x',
    "quote_in_text": "it's \"broken\"",
}


def test_termux_json_parsed_as_python(tmp_path):
    js = run_js({"termux": [{"id": k, "text": v} for k, v in TERMUX_SAMPLES.items()]}, tmp_path)["termux"]
    errors = 0
    for key, text in TERMUX_SAMPLES.items():
        try:
            want = {"reading": fields(TermuxProbe.parse(text))}
        except ProbeError as e:
            want = {"error": str(e), "type": "ProbeError"}
            errors += 1
        got = js[key]
        if "reading" in want:
            assert "reading" in got and same_reading(want["reading"], got["reading"]), (key, want, got)
        else:
            assert got == want, key
    assert errors >= 10


CONFIG_CASES = [
    {}, dict(pause_below=30.0, resume_above=30.0), dict(pause_below=40.0), dict(slow_factor=0.0),
    dict(slow_factor=1.5), dict(slow_factor=1.0000001), dict(cool_hysteresis=-1.0), dict(cool_hysteresis=-1e-20),
    dict(poll_s=0.0), dict(poll_s=-3.5), dict(slow_below=120.0), dict(slow_below=100.5), dict(slow_below=-0.0001),
    dict(resume_above=-5.0), dict(max_temp=math.nan), dict(poll_s=math.inf), dict(max_temp=-math.inf),
    dict(poll_s="30"), dict(slow_below=True), dict(pause_below=None), dict(slow_factor=[0.5]),
    dict(slow_factor=1.0, poll_s=0.001, max_temp=-10.0, cool_hysteresis=0.0), dict(pause_below=12.345678, resume_above=12.3456),
    dict(pause_below=0.0, resume_above=100.0, slow_below=0.0), dict(resume_above=1234567.0),
]


def test_config_errors_read_the_same(tmp_path):
    js = run_js({"configs": [{"id": str(i), "options": c} for i, c in enumerate(CONFIG_CASES)]}, tmp_path)["configs"]
    for i, options in enumerate(CONFIG_CASES):
        try:
            GateConfig(**options).validate()
            want = None
        except ValueError as e:
            want = str(e)
        assert js[str(i)] == want, options


def test_trace_files_load_the_same(traces, tmp_path):
    bad = tmp_path / "d"
    bad.mkdir()
    files = {
        "missing_column": "t_s,percent,temp_c\n0,50,30\n",
        "bad_charging": "t_s,percent,charging,temp_c\n0,50,1,30\n60,50,maybe,30\n",
        "backwards": "t_s,percent,charging,temp_c\n60,50,1,30\n0.5,50,1,30\n",
        "bad_float": "t_s,percent,charging,temp_c\n0,5o,1,30\n",
        "quoted_float": 't_s,percent,charging,temp_c\n0,"1,5",1,30\n',
        "empty_t": "t_s,percent,charging,temp_c\n,50,1,30\n",
        "no_rows": "t_s,percent,charging,temp_c\n\n\n",
        "empty_file": "",
        "blank_header": "\nt_s,percent,charging,temp_c\n0,1,1,1\n",
        "spaced_header": "t_s, percent,charging,temp_c\n0,1,1,1\n",
        "blank_cells": "t_s,percent,charging,temp_c\n0,,,\n",
        "short_rows": "t_s,percent,charging,temp_c,current_a\n0,50\n1,51,1\n2,52,0,30,-1,99\n",
        "odd_numbers": "t_s,percent,charging,temp_c\n 1_0 ,+5e1,Yes,-.5\n20,inf,NO,nan\n30,1e400,1,-0\n",
        "duplicate_columns": "t_s,percent,charging,temp_c,percent\n0,50,1,30,60\n1,50,1,30\n",
        "quoted_newline": 't_s,percent,charging,temp_c\n0,"5\n0",1,30\n"1""",50,1,30\n',
        "bom": "\ufefft_s,percent,charging,temp_c\n0,1,1,1\n",
        "cr_only": "t_s,percent,charging,temp_c\r0,50,1,30\r60,49,0,31\r",
        "unterminated_quote": 't_s,percent,charging,temp_c\n0,50,1,"30',
    }
    specs = {}
    for name, text in files.items():
        (bad / f"{name}.csv").write_text(text, newline="")
        specs[name] = f"replay:{tmp_path}//d/./{name}.csv"       # shown as pathlib shows it
    specs |= {f"trace_{k}": f"replay:{v}@2.5" for k, v in traces.items()}
    specs |= {"speed_zero": f"replay:{TRACES['drain']}@0", "speed_negative": f"replay:{TRACES['drain']}@-1.5",
              "speed_text": f"replay:{TRACES['drain']}@fast", "speed_empty": f"replay:{TRACES['drain']}@",
              "speed_spaced": f"replay:{TRACES['drain']}@ 1_000 ", "no_path": "replay:@40"}
    js = run_js({"loads": [{"id": k, "spec": v} for k, v in specs.items()]}, tmp_path)["loads"]
    errors = 0
    for name, spec in specs.items():
        try:
            p = make_probe(spec, clock=lambda: 0.0, log=lambda m: None)
        except ValueError as e:
            assert js[name] == {"error": str(e)}, name
            errors += 1
            continue
        got = js[name]
        assert "error" not in got, (name, got)
        assert got["speed"] == p.speed, name
        assert len(got["times"]) == len(p.times) and all(map(same_number, got["times"], p.times)), name
        assert len(got["rows"]) == len(p.rows), name
        for a, b in zip(p.rows, got["rows"]):
            assert same_reading(fields(a), b), (name, fields(a), b)
    assert errors >= 14


def test_node_side_tests_pass():
    """The JS-only tests (browser probe, auto, SafeProbe, termux command, loading without Node built-ins)."""
    node = shutil.which("node")
    if node is None:
        pytest.fail("node (>= 20) is required for the web gate tests")
    proc = subprocess.run([node, "--test", "test/gate.test.mjs"], cwd=WEB, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


def test_gate_modules_import_nothing():
    """Pure JS: no npm package and no static Node import (node:* only lazily, inside Node-only paths)."""
    import re

    for f in sorted((WEB / "src" / "gate").glob("*.mjs")):
        text = f.read_text()
        static = re.findall(r"^\s*(?:import|export)\b[^;]*?\bfrom\s+'([^']+)'", text, flags=re.M | re.S)
        bare = re.findall(r"^\s*import\s+'([^']+)'", text, flags=re.M)
        assert all(s.startswith("./") for s in static + bare), (f.name, static + bare)
        dynamic = re.findall(r"import\((?:/\*.*?\*/\s*)?'([^']+)'\)", text)
        assert all(s.startswith("node:") for s in dynamic), (f.name, dynamic)
