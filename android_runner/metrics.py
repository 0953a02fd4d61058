"""What a run reports: one JSON line per optimizer step, and an end-of-run summary.

Energy: where the battery exposes current and voltage (or energy_now), the energy drawn while
discharging is integrated from the readings and reported as measured. Otherwise, and while on
the charger (the battery then shows the charge current, not the load), it is estimated from CPU
time at ESTIMATE_WATTS_PER_CORE and labelled as an estimate.
"""
from __future__ import annotations

import json
import os
import resource
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from ort_trainer.faults import write_atomic

ESTIMATE_WATTS_PER_CORE = 1.5   # a phone big core under sustained load, roughly; only for the labelled estimate


def rss_mb() -> float:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return float("nan")


def status_mb(key: str, path: str = "/proc/self/status") -> float | None:
    """One kB field of /proc/self/status (VmHWM, RssAnon, RssFile, ...) or of another such file
    (/proc/meminfo: MemAvailable) in MiB; None where there is none."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def file_mappings(paths, smaps: str = "/proc/self/smaps") -> list[tuple[str, int, int, int]]:
    """This process's memory maps of `paths` (ORT maps each external initializer of a bundle's shards on its own):
    (path, file offset, size, resident) in bytes each. [] where /proc/self/smaps is unreadable."""
    wanted = {os.path.realpath(p) for p in paths}
    found, current = [], None
    try:
        with open(smaps) as f:
            for line in f:
                key, _, rest = line.partition(" ")
                if not key.endswith(":"):           # a mapping's header: range perms offset dev inode [path]
                    fields = rest.split(maxsplit=4)
                    path = fields[4].strip().removesuffix(" (deleted)") if len(fields) == 5 else ""
                    lo, hi = (int(x, 16) for x in key.split("-"))
                    current = [path, int(fields[1], 16), hi - lo, 0] if path in wanted else None
                    if current:
                        found.append(current)
                elif current and key == "Rss:":
                    current[3] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return []
    return [tuple(m) for m in found]


def unfaulted_mb(paths) -> float:
    """MiB of this process's maps of `paths` not yet in its RSS: what they add once every page has been read (pages
    the kernel dropped after a peak count again here: an over-estimate, never an under-estimate)."""
    return sum(size - rss for _, _, size, rss in file_mappings(paths)) / 2**20


def peak_rss_mb() -> float:
    """This process's peak RSS. VmHWM, not ru_maxrss: Linux carries ru_maxrss over fork and exec, so a
    runner started by a bigger process (a test, a notebook) would report its parent's peak."""
    hwm = status_mb("VmHWM")
    return hwm if hwm is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def torch_in_process() -> bool:
    """Whether torch is loaded here (on a phone it never is; see pocketlora_cli._as_on_device)."""
    return any(m.split(".")[0] == "torch" and v is not None for m, v in sys.modules.items())


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux, Android: '5' > /proc/self/clear_refs), so that the next
    peak_rss_mb() is the peak since now. False where unsupported (the peak then stays the process's)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class MetricsLog:
    """RUN/metrics.jsonl. On resume, lines past the checkpoint's step are dropped: those steps run again."""

    def __init__(self, path: Path, keep_through_step: int):
        self.path = Path(path)
        if self.path.exists():
            kept = [line for line in self.path.read_text(errors="replace").splitlines()   # damage: dropped below
                    if line.strip() and _step_of(line) is not None and _step_of(line) <= keep_through_step]
            write_atomic(self.path, "".join(line + "\n" for line in kept))   # a torn last line goes too
        self._f = open(self.path, "ab", buffering=0)   # unbuffered: a failed write (full disk) leaves nothing
                                                       # pending that a later flush would retry at exit

    def write(self, record: dict) -> None:
        line = memoryview((json.dumps(record) + "\n").encode())
        try:
            while line:
                line = line[self._f.write(line):]
        except OSError as exc:      # os.write's error names no file
            raise OSError(exc.errno, exc.strerror, str(self.path)) from exc

    def close(self) -> None:
        self._f.close()


def _step_of(line: str) -> int | None:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None   # a line torn by a kill


@dataclass
class EnergyMeter:
    measured_j: float = 0.0
    measured_s: float = 0.0
    first_percent: float | None = None
    last_percent: float | None = None
    _last: tuple | None = field(default=None, repr=False)
    _cpu0: float = field(default_factory=time.process_time, repr=False)

    def add(self, reading, now: float) -> None:
        if reading.percent is not None:
            if self.first_percent is None:
                self.first_percent = reading.percent
            self.last_percent = reading.percent
        power = None
        if reading.charging is False and reading.current_a is not None and reading.voltage_v is not None:
            power = abs(reading.current_a * reading.voltage_v)
        energy_wh = reading.energy_wh if reading.charging is False else None
        if self._last is not None:
            t0, p0, e0 = self._last
            dt = now - t0
            if e0 is not None and energy_wh is not None and e0 >= energy_wh:
                self.measured_j += (e0 - energy_wh) * 3600.0
                self.measured_s += dt
            elif p0 is not None and power is not None:
                self.measured_j += 0.5 * (p0 + power) * dt
                self.measured_s += dt
        self._last = (now, power, energy_wh)

    def summary(self, wall_s: float) -> dict:
        cpu_s = time.process_time() - self._cpu0
        out = {
            "battery_percent_start": self.first_percent,
            "battery_percent_end": self.last_percent,
            "battery_percent_used": (None if self.first_percent is None or self.last_percent is None
                                     else round(self.first_percent - self.last_percent, 2)),
            "cpu_seconds": round(cpu_s, 2),
            "energy_estimate_j": round(cpu_s * ESTIMATE_WATTS_PER_CORE, 1),
            "energy_estimate_basis": f"CPU seconds x {ESTIMATE_WATTS_PER_CORE} W per busy core (an estimate, not a measurement)",
        }
        if self.measured_s > 0:
            out["energy_measured_j"] = round(self.measured_j, 1)
            out["energy_measured_over_s"] = round(self.measured_s, 1)
            out["energy_measured_basis"] = "battery current x voltage (or energy_now) integrated while discharging"
        return out
