"""The server's state, persisted after every round as one file written atomically (temp file, fsync, rename):
the global LoRA tensors, the last completed round and every round's record. A server killed at any moment
leaves either the previous round's state or this one's; rerun, it continues with the next round.
DIR/rounds.jsonl is rewritten from the state each time, so it never disagrees with it.
"""
from __future__ import annotations

import io
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ort_trainer.faults import write_atomic   # whole or not at all (also used by apps.py, run.py)

STATE = "server_state.npz"
ROUNDS = "rounds.jsonl"
FINAL = "personalization.json"


@dataclass
class ServerState:
    round: int                              # rounds completed
    lora: dict[str, np.ndarray]             # the global adapter, ONNX names
    records: list[dict] = field(default_factory=list)
    config_sha256: str = ""
    privacy: dict | None = None             # the DP accountant's state (privacy.py), when DP is on


def save(out: Path, st: ServerState) -> None:
    meta = {"round": st.round, "records": st.records, "config_sha256": st.config_sha256, "names": sorted(st.lora),
            "privacy": st.privacy}
    buf = io.BytesIO()
    np.savez(buf, __meta__=np.array(json.dumps(meta)),
             **{f"t{i}": np.ascontiguousarray(st.lora[n], dtype=np.float32) for i, n in enumerate(meta["names"])})
    write_atomic(out / STATE, buf.getvalue())
    write_rounds(out, st)


def load(out: Path) -> ServerState | None:
    path = out / STATE
    if not path.exists():
        return None
    with np.load(path, allow_pickle=False) as z:
        meta = json.loads(str(z["__meta__"]))
        lora = {n: z[f"t{i}"].copy() for i, n in enumerate(meta["names"])}
    return ServerState(meta["round"], lora, meta["records"], meta["config_sha256"], meta.get("privacy"))


def write_rounds(out: Path, st: ServerState) -> None:
    write_atomic(out / ROUNDS, "".join(json.dumps(r) + "\n" for r in st.records).encode())
