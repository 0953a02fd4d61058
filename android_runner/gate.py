"""The battery/thermal policy: a pure function from (reading, config, previous state) to a decision.

States, in order of priority:

* COOLING: temperature above ``max_temp``; stays until it is <= ``max_temp - cool_hysteresis``.
  The runner does not train; it waits ``poll_s`` and asks again. Unknown temperature: no
  thermal gating.
* FULL while charging (or when there is no battery reading at all).
* PAUSED: below ``pause_below`` and not charging; stays until above ``resume_above`` or
  charging. The runner checkpoints and waits ``poll_s`` between reads.
* SLOW: below ``slow_below`` and not charging; the runner sleeps after each step so that it
  trains only ``slow_factor`` of the wall time.
* FULL otherwise.

"Not charging" includes an unknown charging state: a low battery is protected either way.
:class:`GateTracker` applies :func:`decide` step after step and keeps the numbers for the run
summary.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, fields
from enum import Enum
from typing import Callable

from .probes import BatteryReading


class GateState(str, Enum):
    FULL = "full"
    SLOW = "slow"
    PAUSED = "paused"
    COOLING = "cooling"


@dataclass(frozen=True)
class GateConfig:
    slow_below: float = 60.0     # percent; below this and not charging -> SLOW
    slow_factor: float = 0.5     # fraction of the duty cycle used when SLOW
    pause_below: float = 15.0    # below this and not charging -> PAUSED (runner checkpoints and waits)
    resume_above: float = 30.0   # leave PAUSED when percent > resume_above, or when charging
    max_temp: float = 42.0       # above this -> COOLING (wait)
    cool_hysteresis: float = 3.0 # leave COOLING when temp <= max_temp - cool_hysteresis
    poll_s: float = 30.0         # how long to wait between reads while PAUSED/COOLING

    def validate(self) -> "GateConfig":
        """Raise ValueError naming the bad option and how to fix it; return self if fine."""
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"{f.name} must be a finite number, got {v!r}")
        for name in ("slow_below", "pause_below", "resume_above"):
            v = getattr(self, name)
            if not 0 <= v <= 100:
                raise ValueError(f"{name} is a battery percent: must be within 0..100, got {v:g}")
        if not 0 < self.slow_factor <= 1:
            raise ValueError(f"slow_factor must be in (0, 1] (the fraction of time spent training "
                             f"when SLOW; 1 disables slowing), got {self.slow_factor:g}")
        if not self.pause_below < self.resume_above:
            raise ValueError(f"pause_below ({self.pause_below:g}) must be < resume_above "
                             f"({self.resume_above:g}): lower pause_below or raise resume_above")
        if self.cool_hysteresis < 0:
            raise ValueError(f"cool_hysteresis must be >= 0 (degrees below max_temp to resume), "
                             f"got {self.cool_hysteresis:g}")
        if self.poll_s <= 0:
            raise ValueError(f"poll_s must be > 0 (seconds between reads while waiting), got {self.poll_s:g}")
        return self


@dataclass(frozen=True)
class Decision:
    state: GateState
    sleep_s: float        # how long the runner should sleep before the next step (0 for FULL)
    run_step: bool        # False while PAUSED/COOLING: the runner does not train, it waits sleep_s and asks again
    reason: str           # human-readable, e.g. "battery 14% < pause-below 15% and not charging"
    changed: bool         # state differs from the previous state


def _pct(p: float) -> str:
    return f"{p:g}%"


def _deg(t: float) -> str:
    return f"{t:g}°C"


def decide(reading: BatteryReading, cfg: GateConfig, prev: GateState,
           last_step_s: float) -> Decision:
    """The state to be in now, given the latest reading and the previous state.

    ``last_step_s`` is how long the last training step took; SLOW sleeps
    ``last_step_s * (1/slow_factor - 1)`` so that training takes ``slow_factor`` of the time.
    """
    prev = GateState(prev)

    def out(state: GateState, reason: str, sleep_s: float = 0.0) -> Decision:
        waiting = state in (GateState.PAUSED, GateState.COOLING)
        if prev is GateState.COOLING and state is not GateState.COOLING:
            cooled = "temperature unknown" if temp is None else f"cooled to {_deg(temp)} <= {_deg(cool_limit)}"
            reason = f"{cooled}; {reason}"
        return Decision(state=state, sleep_s=cfg.poll_s if waiting else sleep_s,
                        run_step=not waiting, reason=reason, changed=state is not prev)

    temp, pct = reading.temp_c, reading.percent
    cool_limit = cfg.max_temp - cfg.cool_hysteresis
    if temp is not None:
        if temp > cfg.max_temp:
            return out(GateState.COOLING, f"temperature {_deg(temp)} > max-temp {_deg(cfg.max_temp)}")
        if prev is GateState.COOLING and temp > cool_limit:
            return out(GateState.COOLING, f"cooling: {_deg(temp)}, waiting for <= {_deg(cool_limit)}")
    if pct is None:
        return out(GateState.FULL, "no battery reading")
    if reading.charging:
        return out(GateState.FULL, f"charging (battery {_pct(pct)})")
    plug = "not charging" if reading.charging is False else "charging state unknown"
    if pct < cfg.pause_below:
        return out(GateState.PAUSED, f"battery {_pct(pct)} < pause-below {_pct(cfg.pause_below)} and {plug}")
    if prev is GateState.PAUSED and pct <= cfg.resume_above:
        return out(GateState.PAUSED,
                   f"paused: battery {_pct(pct)} <= resume-above {_pct(cfg.resume_above)} and {plug}")
    if pct < cfg.slow_below:
        step = last_step_s if last_step_s is not None and math.isfinite(last_step_s) else 0.0
        sleep_s = max(0.0, step) * (1.0 / cfg.slow_factor - 1.0)
        return out(GateState.SLOW, f"battery {_pct(pct)} < slow-below {_pct(cfg.slow_below)} and {plug}: "
                                   f"training {cfg.slow_factor:.0%} of the time", sleep_s)
    return out(GateState.FULL, f"battery {_pct(pct)} >= slow-below {_pct(cfg.slow_below)}")


class GateTracker:
    """Applies :func:`decide` reading after reading; keeps the time spent in each state and
    the transitions ``(t, from, to, reason)`` (t in seconds since the first update)."""

    def __init__(self, cfg: GateConfig | None = None, initial: GateState = GateState.FULL,
                 clock: Callable[[], float] = time.monotonic):
        self.cfg = (cfg or GateConfig()).validate()
        self.state = GateState(initial)
        self.clock = clock
        self.seconds_in: dict[GateState, float] = {s: 0.0 for s in GateState}
        self.transitions: list[tuple[float, GateState, GateState, str]] = []
        self.last: Decision | None = None
        self._t0: float | None = None
        self._t_last: float | None = None

    def _advance(self, now: float | None) -> float:
        """Credit the time since the last update to the current state; return ``now``."""
        now = self.clock() if now is None else now
        if self._t0 is None:
            self._t0 = now
        else:
            self.seconds_in[self.state] += max(0.0, now - self._t_last)
        self._t_last = now
        return now

    def update(self, reading: BatteryReading, last_step_s: float = 0.0,
               now: float | None = None) -> Decision:
        """Decide for this reading (``now`` defaults to the tracker's clock)."""
        now = self._advance(now)
        d = decide(reading, self.cfg, self.state, last_step_s)
        if d.changed:
            self.transitions.append((now - self._t0, self.state, d.state, d.reason))
        self.state, self.last = d.state, d
        return d

    def finish(self, now: float | None = None) -> None:
        """Credit the time up to ``now`` (end of run) to the current state."""
        if self._t0 is not None:
            self._advance(now)

    def summary(self) -> dict:
        """JSON-friendly numbers for the run summary."""
        return {
            "final_state": self.state.value,
            "seconds_in": {s.value: round(v, 3) for s, v in self.seconds_in.items()},
            "transitions": [{"t_s": round(t, 3), "from": a.value, "to": b.value, "reason": r}
                            for t, a, b, r in self.transitions],
        }
