"""Battery and thermal probes: one small class per way of asking a device about its battery.

One concern over 400 lines: six probes (Android sysfs, dumpsys, Termux, Linux, replay, none), `auto` and the
SafeProbe wrapper, each small, kept together so that `make_probe` is the one place a spec is read.

Every probe has a ``name`` and a ``read()`` that returns a :class:`BatteryReading` (fields it
cannot see are None) or raises :class:`ProbeError`. ``make_probe("auto")`` picks the first
probe that works on this device; :class:`SafeProbe` makes sure a probe that breaks mid-run
never takes the training run down with it.

Standard library only: this runs on the phone.
"""
from __future__ import annotations

import bisect
import csv
import json
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol, runtime_checkable

SYSFS_ROOT = "/sys/class/power_supply"
THERMAL_ROOT = "/sys/class/thermal"
COMMAND_TIMEOUT_S = 5.0
SPECS = ("auto", "android-sysfs", "dumpsys", "termux", "linux", "replay:PATH[@SPEED]", "none")


class ProbeError(RuntimeError):
    """The probe cannot read the battery here; the message says why."""


@dataclass(frozen=True)
class BatteryReading:
    percent: float | None        # 0..100
    charging: bool | None
    temp_c: float | None         # battery temperature in Celsius
    current_a: float | None = None   # instantaneous current (A), sign as the device reports it
    voltage_v: float | None = None
    energy_wh: float | None = None   # remaining energy (energy_now) if exposed
    charge_ah: float | None = None   # remaining charge (charge_now) if exposed
    source: str = ""             # which probe produced it


@runtime_checkable
class Probe(Protocol):
    name: str

    def read(self) -> BatteryReading: ...   # raises ProbeError if it cannot read


def _clamp_percent(p: float | None) -> float | None:
    return None if p is None else min(100.0, max(0.0, p))


def _scaled(value: object, scale: float) -> float | None:
    """``float(value) * scale``, or None when the value is missing or not a number."""
    if value is None or isinstance(value, bool):
        return None
    try:
        return float(value) * scale
    except (TypeError, ValueError):
        return None


def _run(argv: list[str]) -> str:
    """Run a command with a timeout and return its stdout; any failure is a ProbeError."""
    try:
        out = subprocess.run(argv, capture_output=True, text=True,
                             timeout=COMMAND_TIMEOUT_S, check=True)
    except FileNotFoundError:
        raise ProbeError(f"{argv[0]}: command not found") from None
    except subprocess.TimeoutExpired:
        raise ProbeError(f"{argv[0]}: no answer within {COMMAND_TIMEOUT_S:g} s") from None
    except subprocess.CalledProcessError as e:
        raise ProbeError(f"{argv[0]}: exit code {e.returncode}: {(e.stderr or '').strip()}") from None
    except OSError as e:
        raise ProbeError(f"{argv[0]}: {e}") from None
    return out.stdout


def _call_runner(runner: Callable[[], str], what: str) -> str:
    try:
        return runner()
    except ProbeError:
        raise
    except Exception as e:  # an injected runner may fail any way it likes
        raise ProbeError(f"{what}: {e}") from e


# --------------------------------------------------------------------------- sysfs

class _SysfsProbe:
    """The Linux power_supply class (``/sys/class/power_supply/<supply>/...``).

    Android and Linux laptops share the layout and units: ``capacity`` (%), ``status``,
    ``temp`` (tenths of °C), ``current_now`` (µA), ``voltage_now`` (µV), ``power_now`` (µW),
    ``energy_now``/``energy_full`` (µWh), ``charge_now``/``charge_full`` (µAh). Subclasses only
    choose which battery supply to use (:meth:`_accepts`) and where else a temperature may come
    from (:meth:`_fallback_temp`).
    """

    name = "sysfs"

    def __init__(self, root: str | Path = SYSFS_ROOT):
        self.root = Path(root)

    # hooks ------------------------------------------------------------------
    def _accepts(self, supply: str) -> bool:
        """Whether a supply of type Battery (and system scope) is the one to read."""
        return True

    def _fallback_temp(self) -> float | None:
        """A temperature to use when the battery has no ``temp`` file."""
        return None

    # shared reading code ----------------------------------------------------
    @staticmethod
    def _text(path: Path) -> str | None:
        try:
            text = path.read_text().strip()
        except OSError:   # missing, or denied (SELinux on recent Android)
            return None
        return text or None

    def _num(self, path: Path, scale: float = 1.0) -> float | None:
        return _scaled(self._text(path), scale)

    def _supplies(self) -> list[Path]:
        try:
            dirs = [p for p in self.root.iterdir() if p.is_dir()]
        except OSError as e:
            raise ProbeError(f"cannot list {self.root}: {e.strerror or e}") from None
        return sorted(dirs, key=lambda p: (not p.name.startswith("BAT"), p.name))  # BAT0 first

    def _battery(self, supplies: list[Path]) -> Path:
        for sup in supplies:
            if (self._text(sup / "type") == "Battery"
                    and self._text(sup / "scope") != "Device"   # e.g. a wireless mouse
                    and self._accepts(sup.name)):
                return sup
        names = ", ".join(s.name for s in supplies) or "nothing"
        raise ProbeError(f"no {self.name} battery under {self.root} (found: {names})")

    def _charging(self, bat: Path, supplies: list[Path]) -> bool | None:
        status = (self._text(bat / "status") or "").lower()
        if status in ("charging", "full"):
            return True
        if status in ("discharging", "not charging"):
            return False
        # Status missing or "Unknown": is any external supply (AC/USB/wireless) online?
        online = [self._text(s / "online") for s in supplies
                  if self._text(s / "type") not in (None, "Battery")]
        online = [o for o in online if o is not None]
        if any(o == "1" for o in online):
            return True
        return False if online else None

    def read(self) -> BatteryReading:
        supplies = self._supplies()
        bat = self._battery(supplies)
        percent = self._num(bat / "capacity")
        for now, full in (("energy_now", "energy_full"), ("charge_now", "charge_full")):
            if percent is None:
                n, f = self._num(bat / now), self._num(bat / full)
                percent = 100.0 * n / f if n is not None and f else None
        temp = self._num(bat / "temp", 0.1)
        if temp is None:
            temp = self._fallback_temp()
        voltage = self._num(bat / "voltage_now", 1e-6)
        current = self._num(bat / "current_now", 1e-6)
        power = self._num(bat / "power_now", 1e-6)
        if current is None and power is not None and voltage:
            current = power / voltage
        charging = self._charging(bat, supplies)
        if percent is None and charging is None and temp is None:
            raise ProbeError(f"{bat}: nothing readable (permission denied?)")
        return BatteryReading(
            percent=_clamp_percent(percent), charging=charging, temp_c=temp,
            current_a=current, voltage_v=voltage,
            energy_wh=self._num(bat / "energy_now", 1e-6),
            charge_ah=self._num(bat / "charge_now", 1e-6),
            source=f"{self.name}:{bat.name}")


class AndroidSysfsProbe(_SysfsProbe):
    """Android's ``/sys/class/power_supply/battery``: any system Battery supply except the
    laptop-style ``BAT*`` ones (those are left to :class:`LinuxPowerSupplyProbe`)."""

    name = "android-sysfs"

    def _accepts(self, supply: str) -> bool:
        return not supply.startswith("BAT")


class LinuxPowerSupplyProbe(_SysfsProbe):
    """A Linux laptop (``BAT*`` is tried first): with no battery ``temp`` file the hottest
    ``thermal_zone*/temp`` (milli-°C) stands in as the device temperature."""

    name = "linux"

    def __init__(self, root: str | Path = SYSFS_ROOT, thermal_root: str | Path = THERMAL_ROOT):
        super().__init__(root)
        self.thermal_root = Path(thermal_root)

    def _fallback_temp(self) -> float | None:
        temps = [self._num(z / "temp", 1e-3) for z in sorted(self.thermal_root.glob("thermal_zone*"))]
        temps = [t for t in temps if t is not None and -40.0 < t < 150.0]  # drop bogus sensors
        return max(temps) if temps else None


# --------------------------------------------------------------------------- commands

class DumpsysProbe:
    """``dumpsys battery`` (adb shell, or an app with the DUMP permission).

    ``runner`` returns the command's text; inject one in tests.
    """

    name = "dumpsys"
    _STATUS = {2: True, 5: True, 3: False, 4: False}  # charging, full, discharging, not charging

    def __init__(self, runner: Callable[[], str] | None = None):
        self.runner = runner or (lambda: _run(["dumpsys", "battery"]))

    @staticmethod
    def parse(text: str) -> BatteryReading:
        fields: dict[str, str] = {}
        for line in text.splitlines():
            key, sep, value = line.strip().partition(":")
            if sep and value.strip():
                fields.setdefault(key.strip().lower(), value.strip())
        if "level" not in fields:
            raise ProbeError(f"dumpsys battery: no 'level' in output: {text.strip()[:120]!r}")
        level, scale = _scaled(fields.get("level"), 1), _scaled(fields.get("scale"), 1)
        percent = level * 100.0 / scale if level is not None and scale else level
        status = _scaled(fields.get("status"), 1)
        charging = DumpsysProbe._STATUS.get(int(status)) if status is not None else None
        if charging is None:   # status unknown: fall back to "is anything plugged in"
            powered = [fields.get(f"{k} powered", "").lower() for k in ("ac", "usb", "wireless", "dock")]
            if any(p == "true" for p in powered):
                charging = True
            elif any(p == "false" for p in powered):
                charging = False
        return BatteryReading(
            percent=_clamp_percent(percent), charging=charging,
            temp_c=_scaled(fields.get("temperature"), 0.1),
            voltage_v=_scaled(fields.get("voltage"), 1e-3),
            current_a=_scaled(fields.get("current now"), 1e-6),
            charge_ah=_scaled(fields.get("charge counter"), 1e-6),
            source="dumpsys")

    def read(self) -> BatteryReading:
        return self.parse(_call_runner(self.runner, "dumpsys battery"))


class TermuxProbe:
    """``termux-battery-status`` (Termux with the Termux:API app): JSON, ``current`` in µA,
    ``voltage`` in mV and ``charge_counter`` in µAh where the version reports them."""

    name = "termux"

    def __init__(self, runner: Callable[[], str] | None = None):
        self.runner = runner or (lambda: _run(["termux-battery-status"]))

    @staticmethod
    def parse(text: str) -> BatteryReading:
        try:
            data = json.loads(text)
        except ValueError:
            raise ProbeError(f"termux-battery-status: not JSON: {text.strip()[:120]!r}") from None
        if not isinstance(data, dict) or "percentage" not in data:
            raise ProbeError(f"termux-battery-status: no 'percentage' in {text.strip()[:120]!r}")
        status = str(data.get("status") or "").upper()
        plugged = str(data.get("plugged") or "").upper()
        if status in ("CHARGING", "FULL"):
            charging: bool | None = True
        elif status in ("DISCHARGING", "NOT_CHARGING"):
            charging = False
        elif plugged:
            charging = plugged != "UNPLUGGED"
        else:
            charging = None
        charge = _scaled(data.get("charge_counter"), 1e-6)
        return BatteryReading(
            percent=_clamp_percent(_scaled(data.get("percentage"), 1)), charging=charging,
            temp_c=_scaled(data.get("temperature"), 1),
            current_a=_scaled(data.get("current"), 1e-6),
            voltage_v=_scaled(data.get("voltage"), 1e-3),
            charge_ah=charge if charge is not None and charge > 0 else None,
            source="termux")

    def read(self) -> BatteryReading:
        return self.parse(_call_runner(self.runner, "termux-battery-status"))


# --------------------------------------------------------------------------- replay / none

def _parse_bool(text: str) -> bool | None:
    t = text.strip().lower()
    if not t:
        return None
    if t in ("1", "true", "yes"):
        return True
    if t in ("0", "false", "no"):
        return False
    raise ValueError(f"charging must be 1/0/true/false, got {text!r}")


class ReplayProbe:
    """Replays a recorded trace: CSV ``t_s,percent,charging,temp_c[,current_a,voltage_v]``.

    ``t_s`` counts seconds from the first ``read()``; a read returns the last row whose
    ``t_s`` is <= the elapsed time (the first row before that, the last row after the end).
    ``speed`` fast-forwards: 60 replays a minute of trace per real second.
    """

    name = "replay"
    REQUIRED = ("t_s", "percent", "charging", "temp_c")

    def __init__(self, path: str | Path, clock: Callable[[], float] = time.monotonic,
                 speed: float = 1.0):
        if not speed > 0:
            raise ValueError(f"replay speed must be > 0, got {speed}")
        self.path, self.clock, self.speed = Path(path), clock, float(speed)
        self.times, self.rows = self._load(self.path)
        self._start: float | None = None

    @staticmethod
    def _load(path: Path) -> tuple[list[float], list[BatteryReading]]:
        with path.open(newline="") as f:
            reader = csv.DictReader(f)
            missing = [c for c in ReplayProbe.REQUIRED if c not in (reader.fieldnames or [])]
            if missing:
                raise ValueError(f"{path}: missing column(s) {', '.join(missing)}; "
                                 f"header must start with {','.join(ReplayProbe.REQUIRED)}")
            times: list[float] = []
            rows: list[BatteryReading] = []
            for lineno, row in enumerate(reader, start=2):
                def num(col: str) -> float | None:
                    v = (row.get(col) or "").strip()
                    return float(v) if v else None
                try:
                    t = float(row["t_s"])
                    reading = BatteryReading(
                        percent=num("percent"), charging=_parse_bool(row["charging"] or ""),
                        temp_c=num("temp_c"), current_a=num("current_a"),
                        voltage_v=num("voltage_v"), source=f"replay:{path.name}")
                except (TypeError, ValueError) as e:
                    raise ValueError(f"{path}:{lineno}: {e}") from None
                if times and t < times[-1]:
                    raise ValueError(f"{path}:{lineno}: t_s {t:g} goes backwards (previous {times[-1]:g})")
                times.append(t)
                rows.append(reading)
        if not rows:
            raise ValueError(f"{path}: no data rows")
        return times, rows

    @property
    def duration_s(self) -> float:
        """Trace time of the last row."""
        return self.times[-1]

    def elapsed(self) -> float:
        """Trace seconds since the first read (0 before it)."""
        if self._start is None:
            return 0.0
        return (self.clock() - self._start) * self.speed

    def read(self) -> BatteryReading:
        if self._start is None:
            self._start = self.clock()
        i = bisect.bisect_right(self.times, self.elapsed()) - 1
        return self.rows[max(i, 0)]


class NoneProbe:
    """No battery information at all: the gate then never throttles."""

    name = "none"

    def read(self) -> BatteryReading:
        return BatteryReading(percent=None, charging=None, temp_c=None, source="none")


class SafeProbe:
    """Wraps a probe so that a failure mid-run warns once and then degrades to
    :class:`NoneProbe` for good, instead of crashing the training run."""

    def __init__(self, probe: Probe, warn: Callable[[str], None] = print):
        self.inner, self.warn = probe, warn
        self.name = probe.name
        self.degraded = False
        self._none = NoneProbe()

    def read(self) -> BatteryReading:
        if self.degraded:
            return self._none.read()
        try:
            return self.inner.read()
        except Exception as e:
            self.degraded = True
            self.warn(f"battery probe '{self.name}' failed ({e}); "
                      "continuing without battery/thermal gating")
            return self._none.read()


# --------------------------------------------------------------------------- factory

def make_probe(spec: str, *, root: str | Path = SYSFS_ROOT, thermal_root: str | Path = THERMAL_ROOT,
               dumpsys_runner: Callable[[], str] | None = None,
               termux_runner: Callable[[], str] | None = None,
               clock: Callable[[], float] = time.monotonic, speed: float = 1.0,
               log: Callable[[str], None] = print) -> Probe:
    """Build a probe from ``auto|android-sysfs|dumpsys|termux|linux|replay:PATH|none``.

    ``auto`` tries android-sysfs, dumpsys, termux, linux in that order and returns the first
    whose ``read()`` works and gives a percent; otherwise a :class:`NoneProbe` (with a warning
    through ``log``). The returned probe carries ``chosen_because``: why it was picked.
    The keyword arguments let tests point the probes at fake trees and fake commands.
    """
    spec = spec.strip()
    builders: dict[str, Callable[[], Probe]] = {
        "android-sysfs": lambda: AndroidSysfsProbe(root),
        "dumpsys": lambda: DumpsysProbe(dumpsys_runner),
        "termux": lambda: TermuxProbe(termux_runner),
        "linux": lambda: LinuxPowerSupplyProbe(root, thermal_root),
        "none": NoneProbe,
    }
    if spec in builders:
        probe = builders[spec]()
        probe.chosen_because = f"requested with '{spec}'"
        return probe
    if spec.startswith("replay:"):
        path = spec[len("replay:"):]
        if "@" in path:                      # replay:TRACE.csv@40 fast-forwards 40x
            path, _, factor = path.rpartition("@")
            try:
                speed = float(factor)
            except ValueError:
                raise ValueError(f"replay speed {factor!r} is not a number: use replay:PATH@SPEED, e.g. @40") from None
        if not path:
            raise ValueError("replay needs a trace: use replay:PATH/TO/trace.csv")
        probe = ReplayProbe(path, clock=clock, speed=speed)
        probe.chosen_because = f"requested with '{spec}'"
        return probe
    if spec != "auto":
        raise ValueError(f"unknown battery probe {spec!r}; valid: {', '.join(SPECS)}")

    failures = []
    for key in ("android-sysfs", "dumpsys", "termux", "linux"):
        probe = builders[key]()
        try:
            reading = probe.read()
        except Exception as e:
            msg = str(e)
            failures.append(msg if msg.startswith(key) else f"{key}: {msg}")
            continue
        if reading.percent is None:
            failures.append(f"{key}: no battery percent")
            continue
        why = f"auto: {key} reads battery {reading.percent:g}%"
        probe.chosen_because = why + (f" ({'; '.join(failures)})" if failures else "")
        log(f"battery probe: {probe.chosen_because}")
        return probe
    probe = NoneProbe()
    probe.chosen_because = "auto: no probe works (" + "; ".join(failures) + ")"
    log(f"WARNING: battery probe: {probe.chosen_because}; running without battery/thermal gating")
    return probe
