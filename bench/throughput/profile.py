"""Where an ORT training step's time goes: one extra ORT-profiled step per shape (profile_runs) and the summary of
ORT's profiler output (summarize_profile): kernel time by op and node, the matmuls' FLOPs and rates by kind."""
from __future__ import annotations

import json
import math
from pathlib import Path

from bench.children import THREADS, run_worker
from bench.common import LORA, log, tail
from bench.throughput.config import EFFECTIVE_BATCH
from bench.throughput.summary import measured

MATMUL_OPS = ("MatMul", "FusedMatMul", "Gemm")
HEAD_PREFIX = "/chunked_head/"   # artifacts_gen.head_loss.PREFIX, not imported: head_loss pulls torch into this process


def profile_events(text: str) -> list[dict]:
    """The events of an ORT profile file, one JSON object per line; lines that do not parse are dropped. (ORT
    names the file prefix + start second; the worker starts the optimizer session in a later second than the
    training session, which once overwrote its file, but a killed run still leaves a truncated file.)"""
    out = []
    for line in text.splitlines():
        line = line.strip().lstrip("[").rstrip("]").rstrip(",")
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return out


def kernel_events(events: list[dict]) -> list[tuple[str, dict]]:
    """(node name, event) of every node's kernel run in a profile, in the order ORT ran them."""
    suffix = "_kernel_time"
    return [(e["name"][: -len(suffix)], e) for e in events if e.get("cat") == "Node" and e["name"].endswith(suffix)]


def _gemm_kind(node: str, shapes: list[list[int]], out: list[int], rank: int) -> str:
    """What a matmul kernel computes: the chunked LM head (its nodes' name prefix), a LoRA product (one side
    of rank `rank`), attention's batched products, or the body's frozen linear layers."""
    if node.startswith(HEAD_PREFIX):
        return "head"
    if any(min(s[-2:]) <= rank for s in (*shapes, out) if len(s) >= 2):
        return "lora"
    return "attention" if math.prod(out[:-2]) > 1 else "body"


def _gemm_flops(shapes: list[list[int]], out: list[int]) -> int:
    """2 * outputs * contracted length; the contracted length is what A's last two dims hold besides the output's
    rows (whichever of them is transposed)."""
    rows = out[-2] if len(out) >= 2 else 1
    if not rows or len(shapes[0]) < 2:
        return 0
    return 2 * math.prod(out) * (math.prod(shapes[0][-2:]) // rows)


def summarize_profile(files: list[Path], step_runs: int, rank: int = LORA["r"]) -> dict:
    """ORT profiler output -> kernel time of the last optimizer step (its last `step_runs` model runs of
    the training session) by op type and by node, plus the largest node outputs, and the matmuls' FLOPs and
    rates by kind (body, head, LoRA, attention).

    Each session profiles into its own file, with timestamps relative to that session's start: the training
    session is the file whose kernels include matmuls (the optimizer session has none), and its runs are
    matched with its own kernels only (mixing the files' clocks had picked the optimizer's run, with
    training kernels that happened to fall into its window)."""
    per_file = [profile_events(f.read_text()) for f in files]
    per_file = [ev for ev in per_file if any(e["args"].get("op_name") in MATMUL_OPS for _, e in kernel_events(ev))]
    if len(per_file) != 1:
        raise ValueError(f"profile: expected one training-session file among {len(files)}, found {len(per_file)}")
    events = per_file[0]
    nodes = [e for _, e in kernel_events(events)]
    runs = sorted((e for e in events if e.get("cat") == "Session" and e["name"] == "model_run"), key=lambda e: e["ts"])
    windows = [(e["ts"], e["ts"] + e["dur"]) for e in runs[-step_runs:]]
    kernels = [e for e in nodes if any(a <= e["ts"] <= b for a, b in windows)]
    run_us = sum(b - a for a, b in windows)
    by_op: dict[str, float] = {}
    by_node: dict[str, list] = {}
    out_bytes: dict[str, list] = {}
    gemm: dict[str, list] = {}
    for e in kernels:
        op = e["args"].get("op_name", "?")
        by_op[op] = by_op.get(op, 0.0) + e["dur"]
        node = e["name"][: -len("_kernel_time")]
        by_node.setdefault(node, [op, 0.0])[1] += e["dur"]
        size = int(e["args"].get("output_size", 0) or 0)
        if size:
            prev = out_bytes.get(node, [op, 0])
            out_bytes[node] = [op, max(prev[1], size)]
        if op in MATMUL_OPS:
            shapes = [next(iter(d.values())) for d in e["args"].get("input_type_shape", [])]
            out = next(iter(e["args"]["output_type_shape"][0].values()))
            g = gemm.setdefault(_gemm_kind(node, shapes, out, rank), [0, 0.0, 0])
            g[0] += 1
            g[1] += e["dur"]
            g[2] += _gemm_flops(shapes, out)
    kernel_us = sum(by_op.values())
    return {
        "step_runs": len(windows), "model_run_ms": run_us / 1e3, "kernel_ms": kernel_us / 1e3,
        "by_op_ms": dict(sorted(((k, v / 1e3) for k, v in by_op.items()), key=lambda kv: -kv[1])),
        "matmul_ms": sum(v for k, v in by_op.items() if k in MATMUL_OPS) / 1e3,
        "gemm_by_kind": {k: {"calls": n, "ms": us / 1e3, "gflop": fl / 1e9, "gflops": fl / us / 1e3 if us else 0.0}
                         for k, (n, us, fl) in sorted(gemm.items(), key=lambda kv: -kv[1][1])},
        "top_nodes": [[n, op, us / 1e3] for n, (op, us) in sorted(by_node.items(), key=lambda kv: -kv[1][1])[:12]],
        "largest_outputs": [[n, op, b] for n, (op, b) in sorted(out_bytes.items(), key=lambda kv: -kv[1][1])[:12]],
    }


def profile_runs(setups: dict, data: dict, sub: Path, results: list[dict], quick: bool) -> dict:
    """One extra ORT run per shape with SessionOptions.enable_profiling (lm workload; micro-batch 8 and the
    best setting; 1 warm-up + 1 profiled step); not used for any timing above."""
    out = {}
    for r in results:
        if not r.get("ok") or r["workload"] != "lm":
            continue
        s = setups[r["shape"]]
        for m, a in dict.fromkeys(((EFFECTIVE_BATCH, 1), tuple(r["best"]))):
            prefix = sub / f"profile-{r['shape']}-lm-{m}x{a}"
            for old in sub.glob(prefix.name + "_*.json"):
                old.unlink()
            log(f"profile {r['shape']} lm {m}x{a}")
            c = run_worker("ort", {"bundle": s["bundle"], "data": str(data["lm"]), "threads": THREADS, "seed": 0,
                                  "profile": str(prefix), "phases": [{"micro": m, "accum": a, "warmup": 1, "steps": 1}]},
                          sub / f"profile-{r['shape']}-lm-{m}x{a}.log", 300 if quick else 1800)
            files = sorted(sub.glob(prefix.name + "_*.json"))
            if not c.ok or not files:
                out[f"{r['shape']} {m}x{a}"] = {"ok": False, "log": tail(c.log_path)}
                continue
            try:
                summ = summarize_profile(files, a)
            except ValueError as e:          # e.g. a truncated file: one failed profile, not a lost run
                out[f"{r['shape']} {m}x{a}"] = {"ok": False, "log": str(e)}
                continue
            summ["step_seconds"] = measured(c.result)[0]["seconds"]
            summ["ok"] = True
            out[f"{r['shape']} {m}x{a}"] = summ
            for f in files:
                f.unlink()          # tens of MB each
    return out
