"""`pocketlora federate`: N virtual devices on Flower's simulation engine (Ray), R rounds, then the report.

DIR/
    federate.json        the settings (a rerun with other defining settings is refused)
    server_state.npz     global adapter + round records, written atomically after every round (resume point)
    rounds.jsonl         one line per round: loss, participants, declined, failed, weights, bytes up/down
    personalization.json every device's held-out numbers: base, global, local-only, personalized
    global/              the global adapter as a PEFT directory
    report.md, rounds.png
    devices/device-NNN/  each device's data and local runs (device.py)

Running the same command again after a kill resumes: finished rounds are not redone, a device's interrupted
local run resumes from its checkpoint.
"""
from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from .config import CONFIG, FederateConfig, settle
from . import state as fstate

GLOBAL = "global"
REPORT = "report.md"


def federate(cfg: FederateConfig, out: str | Path, log=print) -> dict:
    cfg, out, bundle = prepare(cfg, out)
    if not complete(cfg, out):
        _simulate(cfg, out, log)
    return finish(cfg, out, bundle, log)


def prepare(cfg: FederateConfig, out: str | Path):
    """Settings checked and settled against DIR's (a rerun resumes), the bundle opened (hashes verified on a fresh
    start), DIR/federate.json written. Shared by `pocketlora federate` and the deployment engine's ServerApp
    (deployment.py). Returns (cfg, out, bundle)."""
    from ort_trainer.bundle import open_bundle

    out = Path(out).resolve()
    cfg.bundle = str(Path(cfg.bundle).resolve())
    cfg.batteries = {k: _abs_replay(v) for k, v in cfg.batteries.items()}
    cfg.battery = _abs_replay(cfg.battery)
    cfg.validate()
    cfg, resuming = settle(out, cfg)
    out.mkdir(parents=True, exist_ok=True)
    bundle = open_bundle(cfg.bundle, verify="sizes" if resuming else "hashes")
    if not resuming:
        fstate.write_atomic(out / CONFIG, cfg.to_json().encode())
    return cfg, out, bundle


def complete(cfg: FederateConfig, out: Path) -> bool:
    """Every round done and every device's final numbers in."""
    st = fstate.load(out)
    return st is not None and st.round >= cfg.rounds and (out / fstate.FINAL).exists()


def finish(cfg: FederateConfig, out: Path, bundle, log=print) -> dict:
    """The end of a complete run: the global adapter as a PEFT directory (DIR/global/) and DIR/report.md."""
    from ort_trainer.adapter import export_peft

    from .report import write_report

    st = fstate.load(out)
    export_peft(bundle.manifest, st.lora, out / GLOBAL)
    write_report(cfg, out)
    log(f"global adapter (PEFT) in {out / GLOBAL}; report in {out / REPORT}")
    return {"rounds": st.round, "out": str(out)}


def _abs_replay(spec: str) -> str:
    if spec.startswith("replay:"):
        path, at, speed = spec[len("replay:"):].rpartition("@")
        if not at:
            path, speed = speed, ""
        return f"replay:{Path(path).resolve()}" + (f"@{speed}" if at else "")
    return spec


def _simulate(cfg: FederateConfig, out: Path, log) -> None:
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    from flwr.simulation import run_simulation

    from .apps import client_app, make_server_app

    # Flower's simulation engine in this process tree (deployment.py runs the same apps on a SuperLink and
    # SuperNodes); its deprecation warning, repeated by every run, is kept off the output. Errors still show.
    for name in ("flwr", "ray"):
        logging.getLogger(name).setLevel(logging.ERROR)
    run_simulation(
        server_app=make_server_app(cfg, out, log), client_app=client_app, num_supernodes=cfg.devices,
        backend_config={"client_resources": {"num_cpus": cfg.device_cpus, "num_gpus": 0.0},
                        "init_args": {"logging_level": logging.ERROR, "log_to_driver": False,
                                      "num_cpus": max(1, os.cpu_count() or 1)}},
    )
    if not complete(cfg, out):
        st = fstate.load(out)
        raise RuntimeError(f"the simulation ended before the run was complete (round "
                           f"{st.round if st else 0}/{cfg.rounds}); see the log above, then rerun to resume")
    sys.stdout.flush()
