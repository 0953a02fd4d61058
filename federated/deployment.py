"""The same federation on Flower's deployment engine: a SuperLink plus one SuperNode per device (docs/FEDERATED.md).

`server_app` is the ServerApp the Flower app in federated/flower_app/ names; the ClientApp is apps.client_app, as
in the simulation. The run config (`flwr run ... --run-config "settings='...' out='...'"`) carries

    settings   a federate.json-style settings file (FederateConfig's fields; `bundle`, `devices`, `rounds`
               required, the rest default as in `pocketlora federate`), or that JSON itself
    out        the run directory, as `pocketlora federate --out`

Both as absolute paths (and the bundle's and any replay trace's in the settings): the ServerApp runs in a process
the SuperLink starts, in the SuperLink's working directory. The run then goes as `pocketlora federate` goes
(run.py): the same settings check and resume, the same round loop (apps.server_loop), the same DIR/global/ and
DIR/report.md at the end. Every SuperNode must be started with `--node-config "partition-id=I"`, I = 0..devices-1
(its device number), and the ClientApps write their device directories under `out` (so on one machine or a shared
file system; see docs/FEDERATED.md).
"""
from __future__ import annotations

import json
from logging import INFO
from pathlib import Path

from flwr.app import Context
from flwr.common import log as flwr_log
from flwr.serverapp import Grid, ServerApp

from .apps import server_loop
from .config import FederateConfig, FederateError
from .run import complete, finish, prepare

server_app = ServerApp()


def _log(msg: str) -> None:
    flwr_log(INFO, msg)        # Flower's logger: shown by `flwr run --stream` / `flwr log`


def settings_from_run_config(run_config) -> tuple[FederateConfig, Path]:
    """(FederateConfig, out) from the run config's `settings` (a file, or the JSON itself) and `out`."""
    settings, out = str(run_config.get("settings", "")).strip(), str(run_config.get("out", "")).strip()
    if not settings or not out:
        raise FederateError("the run config needs `settings` (a federate.json-style file, or its JSON) and `out` "
                            "(the run directory): flwr run APP CONNECTION --run-config \"settings='...' out='...'\"")
    if settings.startswith("{"):
        text = settings
    else:
        if not Path(settings).is_absolute():
            raise FederateError(f"settings={settings!r}: use an absolute path (the ServerApp runs in the "
                                "SuperLink's working directory)")
        text = Path(settings).read_text()
    if not Path(out).is_absolute():
        raise FederateError(f"out={out!r}: use an absolute path (the ServerApp runs in the SuperLink's working "
                            "directory)")
    try:
        cfg = FederateConfig.from_json(text)
    except (TypeError, json.JSONDecodeError) as e:
        raise FederateError(f"settings: not FederateConfig JSON ({e})") from None
    if not Path(cfg.bundle).is_absolute():
        raise FederateError(f"settings: bundle={cfg.bundle!r}: use an absolute path")
    return cfg, Path(out)


@server_app.main()
def _main(grid: Grid, context: Context) -> None:
    cfg, out = settings_from_run_config(context.run_config)
    cfg, out, bundle = prepare(cfg, out)
    if not complete(cfg, out):
        server_loop(grid, cfg, out, _log, context)
    finish(cfg, out, bundle, _log)
