"""The issue's targets, judged on a run's statistics: throughput against PyTorch, peak RSS (absolute and against
PyTorch), compute efficiency against the GEMM reference. Also which configuration of an entry is which."""
from __future__ import annotations

from bench.common import mib
from bench.throughput.config import (EFFECTIVE_BATCH, TARGET_EFFICIENCY, TARGET_RSS, TARGET_RSS_VS_TORCH,
                                     TARGET_SPEEDUP)


def best_key(entry: dict) -> str:
    """The config that ran ORT's best setting: ort-best-MxA, or ort-8x1 itself when 8x1 won the pilot."""
    return next((k for k in entry["configs"] if k.startswith(("ort-best", "ort-fit"))), "ort-8x1")


def ort_keys(entry: dict) -> list[str]:
    """ort-8x1 and the best setting's config, once each."""
    return list(dict.fromkeys(("ort-8x1", best_key(entry))))


def shown(entry: dict, key: str) -> str:
    """A config's name in tables and verdicts: `ort-8x1 (best)` where 8x1 won the pilot."""
    return f"{key} (best)" if key == "ort-8x1" and best_key(entry) == key else key


def memory_fit(r: dict) -> dict | None:
    """The fastest pilot setting of one shape and workload whose peak (the VmHWM of its own pilot process) meets
    both memory targets, and its throughput against PyTorch estimated from the lockstep: the lockstep's ort-8x1
    ratio times the pilot's 8x1 / that setting step time. None without a lockstep pilot or a fitting setting."""
    t, o = r["configs"].get("torch-8x1", {}), r["configs"].get("ort-8x1", {})
    table = {(q["micro"], q["accum"]): q for q in r.get("pilot") or [] if q.get("hwm")}
    if not (t.get("ok") and o.get("ok") and (8, 1) in table):
        return None
    limit = min(TARGET_RSS[r["shape"]], TARGET_RSS_VS_TORCH * t["peak_rss"])
    fits = [q for q in table.values() if q["hwm"] <= limit]
    if not fits:
        return None
    q = min(fits, key=lambda q: q["median_step_s"])
    ratio = o["tokens_per_s"]["median"] / t["tokens_per_s"]["median"] * table[8, 1]["median_step_s"] / q["median_step_s"]
    return {"setting": f"{q['micro']}x{q['accum']}", "hwm": q["hwm"], "torch_peak": t["peak_rss"], "ratio": ratio,
            "step_s": q["median_step_s"], "step_8x1_s": table[8, 1]["median_step_s"]}


def judge(payload: dict) -> list[tuple[str, bool | None, str]]:  # noqa: C901
    """(target, met?, evidence) for each target of the issue."""
    res = [r for r in payload["results"] if r.get("ok")]
    out = []
    for r in res:
        t = r["configs"]["torch-8x1"]
        for key in ort_keys(r):
            o = r["configs"][key]
            if not (o.get("ok") and t.get("ok")):
                continue
            ratio = o["tokens_per_s"]["median"] / t["tokens_per_s"]["median"]
            need = TARGET_SPEEDUP[r["workload"]]
            out.append((f"throughput {r['shape']} {r['workload']} ({shown(r, key)}) >= {need}x PyTorch", ratio >= need,
                        f"{ratio:.2f}x"))
        if not r.get("memory_fit") and (fit := memory_fit(r)):     # runs before the lockstep's ort-fit: estimated
            need = TARGET_SPEEDUP[r["workload"]]
            out.append((f"throughput {r['shape']} {r['workload']} at the fastest setting within both memory targets "
                        f"({fit['setting']}, from the pilot) >= {need}x PyTorch", fit["ratio"] >= need,
                        f"{fit['ratio']:.2f}x estimated (ort-8x1's lockstep ratio x pilot step 8x1 {fit['step_8x1_s']:.2f} s / "
                        f"{fit['setting']} {fit['step_s']:.2f} s); peak {fit['hwm'] / 1e9:.2f} GB, "
                        f"{fit['hwm'] / fit['torch_peak']:.2f}x PyTorch"))
    by_shape: dict[str, dict] = {}
    for r in res:
        by_shape.setdefault(r["shape"], {})[r["workload"]] = r
    for shape, wls in by_shape.items():
        t_peak = max(w["configs"]["torch-8x1"]["peak_rss"] for w in wls.values() if w["configs"]["torch-8x1"].get("ok"))
        seen = []
        best_name = ("ort-fit, the runner's --memory-budget split" if any(w.get("memory_fit") for w in wls.values())
                     else "ort-best")
        for key_name, pick in (("ort-8x1", lambda w: "ort-8x1"), (best_name, best_key)):   # best may be ort-8x1
            peaks = [(w["configs"][pick(w)]["peak_rss"], f"{wl} {pick(w)}") for wl, w in wls.items()
                     if w["configs"].get(pick(w), {}).get("ok")]
            if not peaks or peaks in seen:
                continue
            seen.append(peaks)
            peak, where = max(peaks)
            lim = TARGET_RSS[shape]
            out.append((f"peak RSS {shape} ({key_name}) <= {lim / 1e9:.1f} GB", peak <= lim,
                        f"{peak / 1e9:.2f} GB ({mib(peak)} MiB, {where})"))
            out.append((f"peak RSS {shape} ({key_name}) <= {TARGET_RSS_VS_TORCH}x PyTorch", peak <= TARGET_RSS_VS_TORCH * t_peak,
                        f"{peak / t_peak:.2f}x ({mib(peak)} vs {mib(t_peak)} MiB)"))
    lean: dict[str, list] = {}
    for r in res:
        q = next((q for q in r.get("pilot") or [] if (q["micro"], q["accum"]) == (1, EFFECTIVE_BATCH)), None)
        if r.get("lean"):
            lean.setdefault(r["shape"], []).append((r["lean"]["peak_rss"], f"{r['workload']}, the lean phase, first in "
                                                    "its process (max of VmHWM and sampled VmRSS)"))
        elif q and q.get("hwm"):
            lean.setdefault(r["shape"], []).append((q["hwm"], f"{r['workload']}, VmHWM of the pilot's 1x8 " + (
                "process" if payload["settings"].get("pilot_mode") == "lockstep" else "phase, run first")))
        elif q:
            lean.setdefault(r["shape"], []).append((q["rss_end"], f"{r['workload']}, VmRSS sample after the pilot's 1x8 steps"))
    lmem = payload.get("lowmem")
    if lmem and lmem["normal"].get("completed") and not lmem["normal"].get("source"):
        lean.setdefault(lmem["shape"], []).append((lmem["normal"]["peak_rss"], "lm, peak of the low-memory section's normal-mode run"))
    for shape, vals in lean.items():
        peak, where = max(vals)
        wls = by_shape.get(shape, {})
        t_peak = max((w["configs"]["torch-8x1"]["peak_rss"] for w in wls.values() if w["configs"]["torch-8x1"].get("ok")), default=0)
        out.append((f"peak RSS {shape} (ort-1x8, the memory-lean setting) <= {TARGET_RSS[shape] / 1e9:.1f} GB",
                    peak <= TARGET_RSS[shape], f"{peak / 1e9:.2f} GB ({mib(peak)} MiB; {where})"))
        if t_peak:
            out.append((f"peak RSS {shape} (ort-1x8) <= {TARGET_RSS_VS_TORCH}x PyTorch", peak <= TARGET_RSS_VS_TORCH * t_peak,
                        f"{peak / t_peak:.2f}x ({mib(peak)} vs {mib(t_peak)} MiB)"))
    if lmem and (lw := lmem.get("low_unlimited")) and lw.get("completed"):
        shape = lmem["shape"]
        out.append((f"peak RSS {shape} (ort-1x8, --memory low, no limit) <= {TARGET_RSS[shape] / 1e9:.1f} GB",
                    lw["peak_rss"] <= TARGET_RSS[shape], f"{lw['peak_rss'] / 1e9:.2f} GB ({mib(lw['peak_rss'])} MiB)"))
    for r in res:
        for key in ort_keys(r):
            o = r["configs"][key]
            if o.get("ok") and o.get("efficiency"):
                e = o["efficiency"]["median"]
                warm = (f"; {o['efficiency_warm']['median']:.0%} of the warm, prepacked upper bound "
                        f"{o['gemm_reference_warm_gflops']:.1f}" if o.get("efficiency_warm") else "")
                out.append((f"efficiency {r['shape']} {r['workload']} ({shown(r, key)}) >= {TARGET_EFFICIENCY:.0%} of GEMM "
                            "as the training session runs it", e >= TARGET_EFFICIENCY,
                            f"{e:.1%} ({o['achieved_gflops']['median']:.1f} of {o['gemm_reference_gflops']:.1f} "
                            f"GFLOP/s{warm})"))
    return out
