"""Battery probes against fake sysfs trees, fake command output and recorded traces."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from android_runner import probes
from android_runner.probes import (
    AndroidSysfsProbe, BatteryReading, DumpsysProbe, LinuxPowerSupplyProbe, NoneProbe, Probe,
    ProbeError, ReplayProbe, SafeProbe, TermuxProbe, make_probe,
)

DATA = Path(__file__).parent / "data"
TRACES = Path(probes.__file__).parent / "traces"        # the packaged traces (android_runner/traces)

DUMPSYS_CHARGING = """\
Current Battery Service state:
  AC powered: false
  USB powered: true
  Wireless powered: false
  Max charging current: 500000
  status: 2
  health: 2
  present: true
  level: 57
  scale: 100
  voltage: 4012
  temperature: 301
  technology: Li-ion
"""

DUMPSYS_DISCHARGING = """\
Current Battery Service state:
  AC powered: false
  USB powered: false
  Wireless powered: false
  status: 3
  health: 2
  present: true
  level: 120
  scale: 200
  voltage: 3801
  temperature: 287
  Charge counter: 1500000
"""

TERMUX_JSON = ('{"health":"GOOD","percentage":57,"plugged":"PLUGGED_USB",'
               '"status":"CHARGING","temperature":30.1,"current":-250000}')


def write_tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text + "\n")
    return root


@pytest.fixture
def android_tree(tmp_path: Path) -> Path:
    return write_tree(tmp_path / "power_supply", {
        "battery/type": "Battery", "battery/capacity": "57", "battery/status": "Charging",
        "battery/temp": "301", "battery/current_now": "-250000", "battery/voltage_now": "4012000",
        "battery/charge_now": "2100000",
        "usb/type": "USB", "usb/online": "1",
    })


@pytest.fixture
def laptop_tree(tmp_path: Path) -> tuple[Path, Path]:
    ps = write_tree(tmp_path / "power_supply", {
        "AC/type": "Mains", "AC/online": "0",
        "BAT0/type": "Battery", "BAT0/capacity": "80", "BAT0/status": "Discharging",
        "BAT0/energy_now": "40000000", "BAT0/energy_full": "50000000",
        "BAT0/power_now": "8000000", "BAT0/voltage_now": "12000000",
        # a wireless mouse: type Battery but device scope, must be ignored
        "hidpp_battery_0/type": "Battery", "hidpp_battery_0/scope": "Device",
        "hidpp_battery_0/capacity": "5",
    })
    thermal = write_tree(tmp_path / "thermal", {
        "thermal_zone0/temp": "45000", "thermal_zone1/temp": "52500",
        "thermal_zone2/temp": "-273000",   # a dead sensor
    })
    return ps, thermal


def failing(msg: str):
    def run() -> str:
        raise ProbeError(msg)
    return run


# ----------------------------------------------------------------- sysfs

def test_android_sysfs(android_tree):
    r = AndroidSysfsProbe(android_tree).read()
    assert r == BatteryReading(percent=57.0, charging=True, temp_c=pytest.approx(30.1),
                               current_a=pytest.approx(-0.25), voltage_v=pytest.approx(4.012),
                               energy_wh=None, charge_ah=pytest.approx(2.1),
                               source="android-sysfs:battery")


@pytest.mark.parametrize("status,online,expected", [
    ("Full", "0", True), ("Discharging", "1", False), ("Not charging", "1", False),
    (None, "1", True), (None, "0", False), ("Unknown", "1", True),
])
def test_android_sysfs_charging(android_tree, status, online, expected):
    st = android_tree / "battery" / "status"
    if status is None:
        st.unlink()
    else:
        st.write_text(status + "\n")
    (android_tree / "usb" / "online").write_text(online)
    assert AndroidSysfsProbe(android_tree).read().charging is expected


def test_android_sysfs_no_battery(tmp_path):
    root = write_tree(tmp_path, {"usb/type": "USB", "usb/online": "1"})
    with pytest.raises(ProbeError, match="no android-sysfs battery.*usb"):
        AndroidSysfsProbe(root).read()
    with pytest.raises(ProbeError, match="cannot list"):
        AndroidSysfsProbe(tmp_path / "missing").read()


def test_android_sysfs_unreadable_battery(tmp_path):
    root = write_tree(tmp_path, {"battery/type": "Battery"})
    with pytest.raises(ProbeError, match="nothing readable"):
        AndroidSysfsProbe(root).read()


def test_android_probe_leaves_laptop_batteries_alone(laptop_tree):
    with pytest.raises(ProbeError, match="found: BAT0"):
        AndroidSysfsProbe(laptop_tree[0]).read()


def test_linux_laptop(laptop_tree):
    ps, thermal = laptop_tree
    r = LinuxPowerSupplyProbe(ps, thermal).read()
    assert r.source == "linux:BAT0"
    assert r.percent == 80.0
    assert r.charging is False
    assert r.temp_c == pytest.approx(52.5)          # hottest zone; the dead sensor is dropped
    assert r.energy_wh == pytest.approx(40.0)
    assert r.voltage_v == pytest.approx(12.0)
    assert r.current_a == pytest.approx(8.0 / 12.0)  # power_now / voltage_now
    assert r.charge_ah is None


def test_linux_battery_temp_wins_and_percent_from_charge(laptop_tree):
    ps, thermal = laptop_tree
    bat = ps / "BAT0"
    for f in ("capacity", "energy_now", "energy_full", "power_now"):
        (bat / f).unlink()
    write_tree(bat, {"temp": "315", "charge_now": "2000000", "charge_full": "4000000",
                     "current_now": "1500000"})
    r = LinuxPowerSupplyProbe(ps, thermal).read()
    assert r.temp_c == pytest.approx(31.5)
    assert r.percent == pytest.approx(50.0)
    assert r.charge_ah == pytest.approx(2.0)
    assert r.current_a == pytest.approx(1.5)


def test_linux_no_thermal_zones(laptop_tree, tmp_path):
    r = LinuxPowerSupplyProbe(laptop_tree[0], tmp_path / "no-thermal").read()
    assert r.temp_c is None and r.percent == 80.0


# ----------------------------------------------------------------- dumpsys / termux

def test_dumpsys_charging():
    r = DumpsysProbe(runner=lambda: DUMPSYS_CHARGING).read()
    assert r.percent == 57.0
    assert r.charging is True
    assert r.temp_c == pytest.approx(30.1)
    assert r.voltage_v == pytest.approx(4.012)
    assert r.source == "dumpsys"


def test_dumpsys_discharging():
    r = DumpsysProbe(runner=lambda: DUMPSYS_DISCHARGING).read()
    assert r.percent == 60.0                 # level 120 of scale 200
    assert r.charging is False
    assert r.temp_c == pytest.approx(28.7)
    assert r.charge_ah == pytest.approx(1.5)


@pytest.mark.parametrize("status,usb,expected", [
    (5, "false", True), (4, "true", False), (1, "true", True), (1, "false", False),
])
def test_dumpsys_status_codes(status, usb, expected):
    text = DUMPSYS_CHARGING.replace("status: 2", f"status: {status}").replace(
        "USB powered: true", f"USB powered: {usb}")
    assert DumpsysProbe(runner=lambda: text).read().charging is expected


def test_dumpsys_errors():
    with pytest.raises(ProbeError, match="no 'level'"):
        DumpsysProbe(runner=lambda: "Can't find service: battery\n").read()
    with pytest.raises(ProbeError, match="Permission Denial"):
        DumpsysProbe(runner=failing("Permission Denial")).read()

    def oserror() -> str:
        raise OSError("denied")
    with pytest.raises(ProbeError, match="dumpsys battery: denied"):
        DumpsysProbe(runner=oserror).read()


def test_default_runner_missing_command(monkeypatch):
    def no_such(*a, **kw):
        raise FileNotFoundError("dumpsys")
    monkeypatch.setattr(subprocess, "run", no_such)
    with pytest.raises(ProbeError, match="command not found"):
        DumpsysProbe().read()

    def hangs(argv, **kw):
        assert kw["timeout"] == 5.0
        raise subprocess.TimeoutExpired(argv, kw["timeout"])
    monkeypatch.setattr(subprocess, "run", hangs)
    with pytest.raises(ProbeError, match="no answer within 5 s"):
        TermuxProbe().read()


def test_termux():
    r = TermuxProbe(runner=lambda: TERMUX_JSON).read()
    assert r == BatteryReading(percent=57.0, charging=True, temp_c=pytest.approx(30.1),
                               current_a=pytest.approx(-0.25), source="termux")


@pytest.mark.parametrize("status,plugged,expected", [
    ("DISCHARGING", "UNPLUGGED", False), ("NOT_CHARGING", "PLUGGED_AC", False),
    ("FULL", "PLUGGED_AC", True), ("UNKNOWN", "PLUGGED_WIRELESS", True),
    ("UNKNOWN", "UNPLUGGED", False),
])
def test_termux_charging(status, plugged, expected):
    data = json.loads(TERMUX_JSON) | {"status": status, "plugged": plugged}
    assert TermuxProbe(runner=lambda: json.dumps(data)).read().charging is expected


def test_termux_errors():
    with pytest.raises(ProbeError, match="not JSON"):
        TermuxProbe(runner=lambda: "termux-api not installed").read()
    with pytest.raises(ProbeError, match="percentage"):
        TermuxProbe(runner=lambda: "{}").read()


# ----------------------------------------------------------------- replay

class FakeClock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_replay_follows_the_clock():
    clock = FakeClock()
    p = ReplayProbe(TRACES / "evening_charger.csv", clock=clock)
    clock.t += 500.0                           # before the first read: does not count
    r = p.read()
    assert (r.percent, r.charging, r.temp_c) == (35.0, False, 30.0)
    assert r.current_a == pytest.approx(-0.42) and r.voltage_v is not None
    assert r.source == "replay:evening_charger.csv"
    clock.t += 59.9
    assert p.read().percent == 35.0            # still the t=0 row
    clock.t += 0.1
    assert p.read().percent == 34.0            # t=60 row
    clock.t += 240.0
    assert p.read().charging is True           # plugged in at t=300
    clock.t += 1e6
    assert p.read().percent == 100.0           # past the end: last row
    assert p.duration_s == 7200.0


def test_replay_speed_and_text_booleans():
    clock = FakeClock(0.0)
    p = ReplayProbe(DATA / "battery_drain.csv", clock=clock, speed=60)
    assert p.read().percent == 70.0
    clock.t = 120.0                            # two real minutes = two trace hours
    r = p.read()
    assert (r.percent, r.charging) == (10.0, False)
    assert r.current_a is None                 # column absent in this trace
    clock.t = 121.0
    assert p.read().charging is True


def test_replay_bad_files(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("t_s,percent,temp_c\n0,50,30\n")
    with pytest.raises(ValueError, match="missing column.*charging"):
        ReplayProbe(bad)
    bad.write_text("t_s,percent,charging,temp_c\n0,50,maybe,30\n")
    with pytest.raises(ValueError, match=r"bad.csv:2: charging must be"):
        ReplayProbe(bad)
    bad.write_text("t_s,percent,charging,temp_c\n60,50,1,30\n0,50,1,30\n")
    with pytest.raises(ValueError, match="backwards"):
        ReplayProbe(bad)
    with pytest.raises(ValueError, match="speed"):
        ReplayProbe(DATA / "battery_drain.csv", speed=0)


def test_replay_blank_cells_are_none(tmp_path):
    f = tmp_path / "t.csv"
    f.write_text("t_s,percent,charging,temp_c\n0,,,\n")
    assert ReplayProbe(f, clock=FakeClock()).read() == BatteryReading(
        None, None, None, source="replay:t.csv")


# ----------------------------------------------------------------- make_probe / auto / safe

def test_none_probe():
    assert NoneProbe().read() == BatteryReading(None, None, None, source="none")


def test_every_probe_satisfies_the_protocol(android_tree):
    for p in (AndroidSysfsProbe(android_tree), LinuxPowerSupplyProbe(), DumpsysProbe(),
              TermuxProbe(), NoneProbe(), ReplayProbe(DATA / "battery_drain.csv"),
              SafeProbe(NoneProbe())):
        assert isinstance(p, Probe)


def test_make_probe_explicit(android_tree):
    assert isinstance(make_probe("android-sysfs", root=android_tree), AndroidSysfsProbe)
    assert isinstance(make_probe("linux"), LinuxPowerSupplyProbe)
    assert isinstance(make_probe("dumpsys"), DumpsysProbe)
    assert isinstance(make_probe("termux"), TermuxProbe)
    assert isinstance(make_probe("none"), NoneProbe)
    p = make_probe(f"replay:{DATA / 'battery_drain.csv'}", clock=FakeClock(), speed=2)
    assert isinstance(p, ReplayProbe) and p.speed == 2
    with pytest.raises(ValueError, match="valid: auto, android-sysfs, dumpsys, termux, linux"):
        make_probe("battery")
    with pytest.raises(ValueError, match="replay:PATH"):
        make_probe("replay:")


def test_auto_picks_android_sysfs(android_tree):
    log: list[str] = []
    p = make_probe("auto", root=android_tree, dumpsys_runner=failing("x"),
                   termux_runner=failing("x"), log=log.append)
    assert isinstance(p, AndroidSysfsProbe)
    assert p.chosen_because.startswith("auto: android-sysfs reads battery 57%")
    assert len(log) == 1 and "android-sysfs" in log[0]


def test_auto_falls_back_to_dumpsys_then_termux(tmp_path):
    log: list[str] = []
    p = make_probe("auto", root=tmp_path / "nothing", dumpsys_runner=lambda: DUMPSYS_CHARGING,
                   termux_runner=lambda: TERMUX_JSON, log=log.append)
    assert isinstance(p, DumpsysProbe)
    assert "android-sysfs: cannot list" in p.chosen_because

    p = make_probe("auto", root=tmp_path / "nothing", log=log.append,
                   dumpsys_runner=failing("Permission Denial: can't dump"),
                   termux_runner=lambda: TERMUX_JSON)
    assert isinstance(p, TermuxProbe)
    assert "dumpsys: Permission Denial" in p.chosen_because


def test_auto_picks_linux_on_a_laptop(laptop_tree):
    ps, thermal = laptop_tree
    p = make_probe("auto", root=ps, thermal_root=thermal, dumpsys_runner=failing("no dumpsys"),
                   termux_runner=failing("no termux"), log=lambda m: None)
    assert isinstance(p, LinuxPowerSupplyProbe)
    assert p.read().temp_c == pytest.approx(52.5)
    for why in ("android-sysfs: no android-sysfs battery", "dumpsys: no dumpsys", "termux: no termux"):
        assert why in p.chosen_because


def test_auto_skips_probes_without_a_percent(tmp_path):
    text = DUMPSYS_CHARGING.replace("level: 57", "level: ")   # parses, but no percent
    no_pct = json.dumps(json.loads(TERMUX_JSON) | {"percentage": None})
    log: list[str] = []
    p = make_probe("auto", root=tmp_path / "nothing", thermal_root=tmp_path,
                   dumpsys_runner=lambda: text, termux_runner=lambda: no_pct, log=log.append)
    assert isinstance(p, NoneProbe)
    assert "termux: no battery percent" in p.chosen_because
    assert log and log[0].startswith("WARNING") and "without battery/thermal gating" in log[0]


class Flaky:
    name = "flaky"

    def __init__(self, ok: int):
        self.ok, self.calls = ok, 0

    def read(self) -> BatteryReading:
        self.calls += 1
        if self.calls > self.ok:
            raise ProbeError("sysfs went away")
        return BatteryReading(50.0, False, 30.0, source="flaky")


def test_safe_probe_degrades_once():
    warnings: list[str] = []
    inner = Flaky(ok=2)
    p = SafeProbe(inner, warn=warnings.append)
    assert p.read().percent == 50.0 and p.read().percent == 50.0
    assert not p.degraded
    assert p.read() == NoneProbe().read()
    assert p.read() == NoneProbe().read()
    assert p.degraded and inner.calls == 3         # never asked again after failing
    assert len(warnings) == 1 and "flaky" in warnings[0] and "sysfs went away" in warnings[0]


def test_safe_probe_catches_any_error():
    class Broken:
        name = "broken"

        def read(self):
            raise KeyError("boom")
    assert SafeProbe(Broken(), warn=lambda m: None).read().source == "none"


def test_only_standard_library_imports():
    src = Path(probes.__file__).read_text()
    for banned in ("torch", "transformers", "numpy"):
        assert f"import {banned}" not in src


def test_replay_spec_with_speed(tmp_path):
    from android_runner.probes import make_probe

    trace = tmp_path / "t.csv"
    trace.write_text("t_s,percent,charging,temp_c\n0,50,0,30\n60,40,0,30\n")
    now = [0.0]
    probe = make_probe(f"replay:{trace}@60", clock=lambda: now[0], log=lambda *_: None)
    assert probe.read().percent == 50
    now[0] = 1.01                      # one real second = a minute of trace at 60x
    assert probe.read().percent == 40
    with pytest.raises(ValueError, match="not a number"):
        make_probe(f"replay:{trace}@fast", log=lambda *_: None)
