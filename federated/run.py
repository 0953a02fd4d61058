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
    from ort_trainer.adapter import export_peft
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
    st = fstate.load(out)
    if st is None or st.round < cfg.rounds or not (out / fstate.FINAL).exists():
        _simulate(cfg, out, log)
    st = fstate.load(out)
    export_peft(bundle.manifest, st.lora, out / GLOBAL)
    from .report import write_report

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

    # run_simulation is the engine the brief asks for (flwr run needs an app package and a SuperLink process);
    # its deprecation warning, repeated by every run, is kept off the output. Errors still show.
    for name in ("flwr", "ray"):
        logging.getLogger(name).setLevel(logging.ERROR)
    run_simulation(
        server_app=make_server_app(cfg, out, log), client_app=client_app, num_supernodes=cfg.devices,
        backend_config={"client_resources": {"num_cpus": cfg.device_cpus, "num_gpus": 0.0},
                        "init_args": {"logging_level": logging.ERROR, "log_to_driver": False,
                                      "num_cpus": max(1, os.cpu_count() or 1)}},
    )
    st = fstate.load(out)
    if st is None or st.round < cfg.rounds or not (out / fstate.FINAL).exists():
        raise RuntimeError(f"the simulation ended before the run was complete (round "
                           f"{st.round if st else 0}/{cfg.rounds}); see the log above, then rerun to resume")
    sys.stdout.flush()
