"""The battery/thermal gate: pure decisions, hysteresis, and whole recorded evenings replayed."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from android_runner import gate
from android_runner.gate import Decision, GateConfig, GateState, GateTracker, decide
from android_runner.probes import BatteryReading, ReplayProbe

DATA = Path(__file__).parent / "data"
TRACES = Path(gate.__file__).parent / "traces"          # the packaged traces (android_runner/traces)
FULL, SLOW, PAUSED, COOLING = GateState.FULL, GateState.SLOW, GateState.PAUSED, GateState.COOLING
CFG = GateConfig()


def r(percent, charging=False, temp=30.0) -> BatteryReading:
    return BatteryReading(percent=percent, charging=charging, temp_c=temp, source="test")


class FakeClock:
    def __init__(self, t: float = 0.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def simulate(trace: str | Path, cfg: GateConfig = CFG, step_s: float = 10.0):
    """Replay a trace through the gate like the runner would, on a fake clock: a step takes
    ``step_s``, then the runner sleeps ``sleep_s``; while waiting it only sleeps."""
    clock = FakeClock()
    probe = ReplayProbe(DATA / trace, clock=clock)       # an absolute path replaces DATA
    tracker = GateTracker(cfg, clock=clock)
    decisions: list[tuple[float, BatteryReading, Decision]] = []
    while clock.t <= probe.duration_s:
        reading = probe.read()
        d = tracker.update(reading, last_step_s=step_s)
        decisions.append((clock.t, reading, d))
        clock.t += (step_s if d.run_step else 0.0) + d.sleep_s
    tracker.finish()
    return tracker, decisions


def moves(tracker: GateTracker) -> list[tuple[float, GateState, GateState]]:
    return [(t, a, b) for t, a, b, _ in tracker.transitions]


# ----------------------------------------------------------------- traces

def test_drain_trace_full_slow_paused_then_charging():
    tracker, decisions = simulate("battery_drain.csv")
    # 59% at minute 22, 14% at minute 112, plugged in at minute 121 (still 10%).
    assert moves(tracker) == [(1320.0, FULL, SLOW), (6720.0, SLOW, PAUSED), (7260.0, PAUSED, FULL)]
    assert tracker.transitions[1][3] == "battery 14% < pause-below 15% and not charging"
    assert tracker.transitions[2][3] == "charging (battery 10%)"
    assert tracker.seconds_in[SLOW] == pytest.approx(5400.0)
    assert tracker.seconds_in[PAUSED] == pytest.approx(540.0)
    assert tracker.seconds_in[COOLING] == 0.0
    assert tracker.seconds_in[FULL] == pytest.approx(decisions[-1][0] + 10.0 - 5940.0)
    # While slow: sleep = last_step_s * (1/0.5 - 1), i.e. training half the time.
    slow = [d for _, _, d in decisions if d.state is SLOW]
    assert slow and all(d.sleep_s == pytest.approx(10.0) and d.run_step for d in slow)
    # While paused: no training, poll every poll_s; it stays paused at 10-14% (no charger).
    paused = [(rd, d) for _, rd, d in decisions if d.state is PAUSED]
    assert all(not d.run_step and d.sleep_s == CFG.poll_s for _, d in paused)
    assert {rd.percent for rd, _ in paused} == {10.0, 11.0, 12.0, 13.0, 14.0}


def test_drain_trace_slow_factor_sets_the_duty_cycle():
    tracker, decisions = simulate("battery_drain.csv", GateConfig(slow_factor=0.25), step_s=8.0)
    slow = [d for _, _, d in decisions if d.state is SLOW]
    assert slow and all(d.sleep_s == pytest.approx(24.0) for d in slow)   # 8 * (1/0.25 - 1)
    assert 8.0 / (8.0 + slow[0].sleep_s) == pytest.approx(0.25)
    assert [b for _, _, b in moves(tracker)] == [SLOW, PAUSED, FULL]


def test_evening_trace_slow_charging_cooling_full():
    tracker, decisions = simulate(TRACES / "evening_charger.csv")
    assert moves(tracker) == [(0.0, FULL, SLOW), (300.0, SLOW, FULL),
                              (1920.0, FULL, COOLING), (2220.0, COOLING, FULL)]
    assert tracker.transitions[2][3] == "temperature 43.5°C > max-temp 42°C"
    assert tracker.transitions[3][3].startswith("cooled to 38.6°C <= 39°C; charging")
    assert tracker.seconds_in[COOLING] == pytest.approx(300.0)
    assert tracker.seconds_in[SLOW] == pytest.approx(300.0)
    assert tracker.seconds_in[PAUSED] == 0.0
    # Hysteresis: at 42.0 and 40.6°C (not above max_temp) it is still cooling.
    during = {rd.temp_c: d.state for t, rd, d in decisions if 1920 <= t < 2220}
    assert during == {43.5: COOLING, 43.0: COOLING, 42.0: COOLING, 40.6: COOLING, 39.4: COOLING}
    assert tracker.state is FULL


def test_evening_trace_without_cooling_hysteresis_resumes_at_max_temp():
    tracker, _ = simulate(TRACES / "evening_charger.csv", GateConfig(cool_hysteresis=0.0))
    assert moves(tracker)[2:] == [(1920.0, FULL, COOLING), (2040.0, COOLING, FULL)]


def test_summary_is_json():
    tracker, _ = simulate("battery_drain.csv")
    s = json.loads(json.dumps(tracker.summary()))
    assert s["final_state"] == "full"
    assert [(x["from"], x["to"]) for x in s["transitions"]] == [
        ("full", "slow"), ("slow", "paused"), ("paused", "full")]
    assert s["seconds_in"]["paused"] == 540.0


# ----------------------------------------------------------------- decide

def test_full_slow_and_step_sleep():
    d = decide(r(80), CFG, FULL, 12.0)
    assert d == Decision(FULL, 0.0, True, "battery 80% >= slow-below 60%", False)
    d = decide(r(59.5), CFG, FULL, 12.0)
    assert (d.state, d.sleep_s, d.run_step, d.changed) == (SLOW, pytest.approx(12.0), True, True)
    assert d.reason == "battery 59.5% < slow-below 60% and not charging: training 50% of the time"
    assert decide(r(40), GateConfig(slow_factor=0.2), SLOW, 3.0).sleep_s == pytest.approx(12.0)
    assert decide(r(40), GateConfig(slow_factor=1.0), SLOW, 3.0).sleep_s == 0.0
    assert decide(r(40), CFG, SLOW, -1.0).sleep_s == 0.0     # nonsense step time: no sleep
    assert decide(r(40), CFG, SLOW, math.nan).sleep_s == 0.0


def test_pause_hysteresis():
    d = decide(r(14), CFG, SLOW, 10.0)
    assert d == Decision(PAUSED, 30.0, False, "battery 14% < pause-below 15% and not charging", True)
    # Rising again without a charger: stays paused up to and including resume_above ...
    for pct in (15, 20, 30):
        d = decide(r(pct), CFG, PAUSED, 10.0)
        assert (d.state, d.changed, d.run_step) == (PAUSED, False, False), pct
    assert "resume-above 30%" in d.reason
    # ... and leaves above it.
    assert decide(r(30.5), CFG, PAUSED, 10.0).state is SLOW
    assert decide(r(65), CFG, PAUSED, 10.0).state is FULL
    # Without having been paused, 20% is merely slow.
    assert decide(r(20), CFG, SLOW, 10.0).state is SLOW


def test_charging_always_resumes():
    d = decide(r(5, charging=True), CFG, PAUSED, 10.0)
    assert (d.state, d.run_step, d.sleep_s, d.changed) == (FULL, True, 0.0, True)
    assert d.reason == "charging (battery 5%)"
    assert decide(r(40, charging=True), CFG, SLOW, 10.0).state is FULL


def test_cooling_priority_and_hysteresis():
    hot = decide(r(90, charging=True, temp=43.5), CFG, FULL, 10.0)
    assert (hot.state, hot.run_step, hot.sleep_s, hot.changed) == (COOLING, False, 30.0, True)
    assert decide(r(10, temp=42.1), CFG, PAUSED, 10.0).state is COOLING      # beats PAUSED
    assert decide(r(90, temp=42.0), CFG, FULL, 10.0).state is FULL           # not above max
    for temp in (42.0, 40.0, 39.1):                                          # not cool enough yet
        d = decide(r(90, temp=temp), CFG, COOLING, 10.0)
        assert (d.state, d.changed) == (COOLING, False), temp
    assert d.reason == "cooling: 39.1°C, waiting for <= 39°C"
    d = decide(r(10, temp=39.0), CFG, COOLING, 10.0)                         # cool: underlying state
    assert (d.state, d.changed) == (PAUSED, True)
    assert d.reason == "cooled to 39°C <= 39°C; battery 10% < pause-below 15% and not charging"


def test_unknown_readings():
    none = BatteryReading(None, None, None, source="none")
    d = decide(none, CFG, PAUSED, 10.0)
    assert (d.state, d.reason, d.run_step, d.sleep_s) == (FULL, "no battery reading", True, 0.0)
    # Temperature unknown: no thermal gating, even if we were cooling.
    d = decide(r(50, temp=None), CFG, COOLING, 10.0)
    assert d.state is SLOW and d.reason.startswith("temperature unknown; ")
    # Percent unknown but hot: still cools.
    assert decide(BatteryReading(None, None, 45.0), CFG, FULL, 10.0).state is COOLING
    # Charging state unknown: a low battery is still protected.
    d = decide(r(10, charging=None), CFG, FULL, 10.0)
    assert d.state is PAUSED and d.reason.endswith("and charging state unknown")


def test_tracker_accumulates_time_per_state():
    clock = FakeClock(100.0)
    t = GateTracker(clock=clock)
    t.update(r(80), 10.0)                    # FULL from 100
    clock.t = 110.0
    t.update(r(50), 10.0)                    # SLOW from 110
    clock.t = 130.0
    t.update(r(10), 10.0, now=130.0)         # PAUSED from 130
    t.finish(now=190.0)
    assert t.seconds_in == {FULL: 10.0, SLOW: 20.0, PAUSED: 60.0, COOLING: 0.0}
    assert [(tt, a, b) for tt, a, b, _ in t.transitions] == [(10.0, FULL, SLOW), (30.0, SLOW, PAUSED)]
    assert t.last is not None and t.last.state is PAUSED


def test_tracker_initial_state_and_finish_before_start():
    t = GateTracker(GateConfig(), initial=PAUSED, clock=FakeClock())
    t.finish()                               # nothing happened yet: nothing to credit
    assert sum(t.seconds_in.values()) == 0.0
    d = t.update(r(20))                      # still paused thanks to the hysteresis
    assert d.state is PAUSED and not d.changed and t.transitions == []


# ----------------------------------------------------------------- config

def test_default_config_is_valid():
    assert CFG.validate() is CFG


@pytest.mark.parametrize("kw,match", [
    (dict(pause_below=30.0, resume_above=30.0), r"pause_below \(30\) must be < resume_above \(30\): lower"),
    (dict(pause_below=40.0), "pause_below .* must be < resume_above"),
    (dict(slow_factor=0.0), r"slow_factor must be in \(0, 1\]"),
    (dict(slow_factor=1.5), "slow_factor"),
    (dict(cool_hysteresis=-1.0), "cool_hysteresis must be >= 0"),
    (dict(poll_s=0.0), "poll_s must be > 0"),
    (dict(slow_below=120.0), "slow_below is a battery percent"),
    (dict(resume_above=-5.0), "resume_above is a battery percent"),
    (dict(max_temp=math.nan), "max_temp must be a finite number"),
    (dict(poll_s="30"), "poll_s must be a finite number"),
])
def test_config_validation(kw, match):
    with pytest.raises(ValueError, match=match):
        GateConfig(**kw).validate()
    with pytest.raises(ValueError, match=match):
        GateTracker(GateConfig(**kw))


def test_only_standard_library_imports():
    src = Path(gate.__file__).read_text()
    for banned in ("torch", "transformers", "numpy"):
        assert f"import {banned}" not in src
