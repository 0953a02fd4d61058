"""Run records -> statistics per configuration: step time, tokens/s, GFLOP/s against the GEMM reference, peak RSS.

The machine is shared, and other users' load only ever slows a run down: the headline is the least-disturbed run's
median step (see summarize)."""
from __future__ import annotations

import statistics

from bench.throughput.config import GEMM_LIBS
from bench.throughput.flops import combined_gemm, gemm_libs, gemm_reference, model_dims, step_flops


def measured(run: dict, phase: int = 0) -> list[dict]:
    """The measured (not warm-up) steps of one phase of a worker's result."""
    return [s for s in run["phases"][phase]["steps"] if not s["warmup"]]


def _mm(xs: list[float], headline: list[float]) -> dict:
    return {"median": statistics.median(headline), "min": min(xs), "max": max(xs), "pooled_median": statistics.median(xs)}


def summarize(records: list[dict], dims: dict, head_at: str, gemm: list[dict], rows_at: str = "padded") -> dict:
    """Statistics over the measured steps of all runs of one configuration.

    The machine is shared, and other users' load only ever slows a run down. So the headline `median`
    is the median step of the *least-disturbed run* (the run with the lowest median step time); `min`
    and `max` are over every measured step of every run, `pooled_median` over all of them."""
    ok = [r for r in records if r["ok"]]
    if not ok:
        return {"ok": False, "failed_runs": [{"code": r["code"], "log": r["log_tail"]} for r in records]}
    per_run = [measured(r["result"]) for r in ok]
    run_medians = [statistics.median(x["seconds"] for x in st) for st in per_run]
    best = per_run[min(range(len(ok)), key=run_medians.__getitem__)]
    steps = [x for st in per_run for x in st]

    def stats(fn):
        return _mm([fn(x) for x in steps], [fn(x) for x in best])

    def flops(x):
        return step_flops(dims, x["micro_shapes"], head_at, rows_at=rows_at)

    def gflops(x):
        return flops(x)["total"] / x["seconds"] / 1e9

    def ref(x, kind="asrun", only=()):
        r = gemm_reference(dims, x["micro_shapes"], head_at, gemm, kind, rows_at, only)
        return r["gemm_rate"] / 1e9 if r else None

    has = {kind: ref(steps[0], kind) is not None for kind in ("asrun", "warm")}
    # per library (runs that measured torch.mm too): the same step's matmuls on each kernel alone
    by_lib = ({lib: statistics.median([ref(x, only=(lib,)) for x in best]) for lib in GEMM_LIBS}
              if "torch" in gemm_libs(gemm) else None)

    cpu = [x for x in steps if "cpu_s" in x]
    return {
        "ok": True, "n_runs": len(ok), "n_steps": len(steps), "run_median_step_seconds": run_medians,
        "step_seconds": stats(lambda x: x["seconds"]),
        "tokens_per_s": stats(lambda x: x["tokens"] / x["seconds"]),
        "label_tokens_per_s": stats(lambda x: x["label_tokens"] / x["seconds"]),
        "tokens_per_s_aggregate": sum(x["tokens"] for x in steps) / sum(x["seconds"] for x in steps),
        "tokens_per_step": statistics.median([x["tokens"] for x in steps]),
        "label_tokens_per_step": statistics.median([x["label_tokens"] for x in steps]),
        "padded_positions_per_step": statistics.median([sum(b * ln for b, ln, _, _ in x["micro_shapes"]) for x in steps]),
        "gflop_per_step": statistics.median([flops(x)["total"] / 1e9 for x in steps]),
        "gflop_breakdown": {k: statistics.median([flops(x)[k] / 1e9 for x in steps]) for k in ("body", "lora", "attn", "head")},
        "achieved_gflops": stats(gflops),
        "gemm_reference_gflops": statistics.median([ref(x) for x in best]) if has["asrun"] else None,
        "efficiency": stats(lambda x: gflops(x) / ref(x)) if has["asrun"] else None,
        "gemm_reference_warm_gflops": statistics.median([ref(x, "warm") for x in best]) if has["warm"] else None,
        "efficiency_warm": stats(lambda x: gflops(x) / ref(x, "warm")) if has["warm"] else None,
        **({"gemm_reference_by_lib": by_lib} if by_lib else {}),
        "cpu_per_wall": _mm([x["cpu_s"] / x["seconds"] for x in cpu], [x["cpu_s"] / x["seconds"] for x in best if "cpu_s" in x]
                            or [x["cpu_s"] / x["seconds"] for x in cpu]) if cpu else None,
        "peak_rss": max(r["peak_rss"] for r in ok),
        "peak_rss_runs": [r["peak_rss"] for r in ok],
        "run_wall_seconds": [r["wall"] for r in records],
        "peak_rss_anon": max(r["samples"].get("RssAnon", 0) for r in ok),
        "peak_rss_file": max(r["samples"].get("RssFile", 0) for r in ok),
        "rss_stages": ok[-1]["result"].get("rss"),
        "first_step_loss": [r["result"]["phases"][0]["steps"][0]["loss"] for r in ok],
        "failed_runs": [{"code": r["code"], "log": r["log_tail"]} for r in records if not r["ok"]],
    }


def legacy_records(entry: dict, key: str) -> list[dict]:
    """Run records for results written before run records were stored (raw results + per-run peaks)."""
    cfg = entry["configs"][key]
    peaks = iter(cfg.get("peak_rss_runs", []))
    out = []
    for res in entry["raw"][key]:
        if res is None:
            out.append({"ok": False, "code": None, "wall": None, "peak_rss": 0, "samples": {}, "result": None,
                        "log_tail": "(not recorded)"})
        else:
            out.append({"ok": True, "code": 0, "wall": None, "peak_rss": next(peaks), "cpu_s": None,
                        "samples": {"RssAnon": cfg.get("peak_rss_anon", 0), "RssFile": cfg.get("peak_rss_file", 0)},
                        "result": res, "log_tail": None})
    walls = cfg.get("run_wall_seconds") or []
    for r, w in zip(out, walls):
        r["wall"] = w
    return out


def summarize_entry(entry: dict, dims: dict, gemm: list[dict]) -> None:
    """(Re)compute entry["configs"] from entry["runs"] (or, for older JSON, entry["raw"])."""
    if "runs" not in entry:
        entry["runs"] = {key: legacy_records(entry, key) for key in entry["configs"]}
        entry.pop("raw", None)
    defs = entry.get("config_defs") or {k: [c["backend"], c["micro"], c["accum"]] for k, c in entry["configs"].items()}
    entry["config_defs"] = defs
    configs = {}
    ort_rows = "real" if entry.get("ort_padding_free") else "padded"
    for key, (kind, m, a) in defs.items():
        summ = summarize(entry["runs"][key], dims, "all" if kind == "torch" else "labelled", gemm,
                         "padded" if kind == "torch" else ort_rows)
        summ.update(backend=kind, micro=m, accum=a)
        first = next((r for r in entry["runs"][key] if r["ok"]), None)
        if kind == "torch" and first:
            summ["attn_implementation"] = first["result"]["attn_implementation"]
        configs[key] = summ
    entry["configs"] = configs


def summarize_payload(payload: dict) -> None:
    """(Re)compute the statistics of every entry of a run's JSON in place (the GEMM reference of its shape)."""
    for entry in payload["results"]:
        if entry.get("ok"):
            summarize_entry(entry, model_dims(payload["setups"][entry["shape"]]["config"]),
                            combined_gemm(payload, entry["shape"]))
