"""The measuring of the training-throughput bench, in its order: the data, each shape's checkpoint and bundle
(cached), the optional pilot (every split of the batch, in lockstep), then per shape one lockstep of ort-8x1,
torch-8x1, ort-fit and the GEMM reference worker; measure_gemm samples the reference outside a lockstep."""
from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

from bench.children import THREADS, Lockstep, run_worker
from bench.common import LORA, SEQ_LEN, log, tail
from bench.throughput.config import (EFFECTIVE_BATCH, GEMM_LIBS, GEMM_TURN_S, GPT2_FALLBACK_ERROR, LEAN, LM_LINES,
                                     LM_SOURCE, PILOT, SFT_DATA, TARGET_RSS, VARIANT_SUFFIX)
from bench.throughput.flops import gemm_records, gemm_shapes
from bench.throughput.summary import measured


def prepare_data(sub: Path) -> dict[str, Path]:
    """The two workloads' data files: lm = the first LM_LINES lines of WikiText-2 train (written into `sub`), sft = Alpaca."""
    lm = sub / f"wikitext2-train-first{LM_LINES}.txt"
    with open(LM_SOURCE, encoding="utf-8") as f:
        text = "".join(line for _, line in zip(range(LM_LINES), f))
    if not lm.is_file() or lm.read_text(encoding="utf-8") != text:
        lm.write_text(text, encoding="utf-8")
    return {"lm": lm, "sft": SFT_DATA}


def setup_shape(name: str, sub: Path, quick: bool) -> dict:
    """A shape's random-weight checkpoint and bundle, built (or reused) by a setup worker; GPT-2 falls back to
    n_positions=512 on the one known build failure (config.GPT2_FALLBACK_ERROR)."""
    spec = {"name": name, "base": name, "subdir": str(sub), "quick": quick, "lora": LORA, "seq_len": SEQ_LEN}
    c = run_worker("setup", spec, sub / f"{name}-setup.log", timeout=3600)
    if not c.ok and name.startswith("gpt2") and GPT2_FALLBACK_ERROR in c.log_path.read_text(errors="replace"):
        err = next((ln for ln in reversed(c.log_path.read_text(errors="replace").splitlines()) if ln.strip()), "")
        log(f"   {name}: the real config's bundle fails ({err.strip()[:120]}); "
            f"falling back to n_positions=512")
        v = run_worker("setup", {**spec, "name": name + VARIANT_SUFFIX}, sub / f"{name}{VARIANT_SUFFIX}-setup.log",
                       timeout=3600)
        if v.ok:
            v.result["fallback_from_error"] = err.strip()
            v.result["setup_peak_rss"] = v.peak_rss()
            return v.result
        c = v
    if not c.ok:
        return {"name": name, "ok": False, "error": tail(c.log_path)}
    c.result["setup_peak_rss"] = c.peak_rss()
    return c.result


def run_pilot(setup: dict, wl: str, data: dict, sub: Path, pilot_steps: int, timeout: float) -> tuple[list, list]:
    """ORT at each PILOT setting, one process each, taking turns step by step (1 warm-up + pilot_steps each; the
    machine's drift hits every setting alike): the table and the fastest."""
    tag = f"{setup['name'].split('@')[0]}-{wl}"
    log(f"{tag}: pilot {', '.join(f'{m}x{a}' for m, a in PILOT)} (one process each, in lockstep, "
        f"1 warm-up + {pilot_steps} steps each)")
    workers = {f"{m}x{a}": ("ort", {"bundle": setup["bundle"], "threads": THREADS, "seed": 0, "phases": [
        {"data": str(data[wl]), "micro": m, "accum": a, "warmup": 1, "steps": pilot_steps}]}) for m, a in PILOT}
    ls = Lockstep(workers, [(wl, list(workers), 1 + pilot_steps)], sub, f"{tag}-pilot", timeout)
    ls.run()
    out = ls.finish()
    table = []
    for key, o in out.items():
        if key in ls.failed or not o["result"]:
            log(f"   pilot {key} FAILED:\n{ls.failed.get(key) or o['log_tail']}")
            continue
        ph = o["result"]["phases"][0]
        table.append({"micro": ph["micro"], "accum": ph["accum"], "rss_end": ph["steps"][-1]["rss"], "hwm": ph.get("hwm"),
                      "median_step_s": statistics.median(x["seconds"] for x in measured(o["result"]))})
    if not table:
        log("   pilot FAILED, using 1x8")
        return [], [1, EFFECTIVE_BATCH]
    best = min(table, key=lambda q: q["median_step_s"])
    log("   pilot: " + ", ".join(f"{q['micro']}x{q['accum']} {q['median_step_s']:.2f} s" for q in table)
        + f" -> best {best['micro']}x{best['accum']}")
    return table, [best["micro"], best["accum"]]


def lockstep_shape(setup: dict, name: str, workloads: list[str], pilots: dict, data: dict, sub: Path,
                   warmup: int, steps: int, timeout: float, dims: dict,
                   quick: bool) -> tuple[list[dict], list[dict], dict]:
    """ort-8x1, torch-8x1 and ort-fit of one shape, each one process, taking turns step by step: sft, then lm
    (a worker's allocator only grows, so the smaller workload goes first). ort-fit is the runner's
    `--memory-budget` with the shape's peak-RSS target as the budget: before it is READY it measures two
    worst-case micro-batches and picks its split (android_runner/memory_fit.py). ort-8x1 first runs the
    memory-lean 1x8 setting on lm (1 warm-up + 1 step) while nothing else has been allocated in it. After each
    round the GEMM reference worker samples its products for GEMM_TURN_S seconds. -> (entries, GEMM records,
    its settings)"""
    wls = [w for w in ("sft", "lm") if w in workloads]
    base = {"bundle": setup["bundle"], "ckpt": setup["ckpt"], "threads": THREADS, "seed": 0}

    def phase(wl, m, a, w=warmup, n=steps):
        return {"data": str(data[wl]), "micro": m, "accum": a, "warmup": w, "steps": n}

    lean = "lm" in wls
    budget_mb = TARGET_RSS[name] / 2**20
    keys = {"ort-8x1": ("ort", EFFECTIVE_BATCH, 1), "torch-8x1": ("torch", EFFECTIVE_BATCH, 1), "ort-fit": ("ort", None, None)}
    workers = {
        "ort-8x1": ("ort", {**base, "phases": ([phase("lm", *LEAN, 1, 1)] if lean else [])
                            + [phase(w, EFFECTIVE_BATCH, 1) for w in wls]}),
        "torch-8x1": ("torch", {**base, "phases": [phase(w, EFFECTIVE_BATCH, 1) for w in wls]}),
        "ort-fit": ("ort", {**base, "memory_budget_mb": budget_mb, "phases": [phase(w, *LEAN) for w in wls]}),
    }
    workers["gemm-ref"] = ("gemm", {"threads": THREADS, "shapes": gemm_shapes(dims), "libs": list(GEMM_LIBS),
                                    "turn_seconds": 0.3 if quick else GEMM_TURN_S})
    slots = ([("lean", ["ort-8x1"], 2)] if lean else []) + [(w, [*keys, "gemm-ref"], warmup + steps) for w in wls]
    log(f"{name}: lockstep of {', '.join(keys)} (ort-fit: --memory-budget {budget_mb:,.0f} MiB), {warmup} warm-up + "
        f"{steps} steps each" + (f", after ort-8x1's lean {LEAN[0]}x{LEAN[1]} phase" if lean else "")
        + "; GEMM reference after each round")
    t0 = time.time()

    def on_step(slot, key, i):
        log(f"   {slot} {key} step {i}")

    ls = Lockstep(workers, slots, sub, name, timeout)
    ls.run(on_step=on_step if os.environ.get("BENCH_VERBOSE") else None)
    out = ls.finish()
    log(f"   done in {time.time() - t0:.0f} s" + "".join(f"; {k} FAILED" for k in ls.failed))

    def record(key: str, slot: str, idx: int) -> dict:
        o, res = out[key], out[key]["result"]
        ph = res["phases"][idx] if res and idx < len(res["phases"]) else None
        ok = ph is not None and key not in ls.failed
        smp = ls.samples.get((key, slot), {})
        return {"ok": ok, "code": o["code"], "wall": round(sum(x["wall"] for x in ph["steps"]), 1) if ph else None,
                "peak_rss": max(ph.get("hwm") or 0, smp.get("VmRSS", 0)) if ph else 0, "ru_maxrss": o["ru_maxrss"],
                "samples": smp, "cpu_s": None, "log_tail": None if ok else (ls.failed.get(key) or o["log_tail"]),
                "result": {**{k: v for k, v in res.items() if k != "phases"}, "phases": [ph]} if ok else None}

    fit = (out["ort-fit"]["result"] or {}).get("memory_fit")
    m, a = (fit["micro_batch"], fit["accum"]) if fit else LEAN
    entries = []
    for j, wl in enumerate(wls):
        runs, defs = {}, {}
        for key, (kind, mm, aa) in keys.items():
            idx = j + (1 if lean and key == "ort-8x1" else 0)
            label = f"ort-fit-{m}x{a}" if key == "ort-fit" else key
            runs[label] = [record(key, wl, idx)]
            defs[label] = [kind, mm or m, aa or a]
        table, _ = pilots.get((name, wl), ([], None))
        entry = {"shape": name, "model": setup["name"], "workload": wl, "ok": True, "pilot": table, "best": [m, a],
                 "memory_fit": fit and {**fit, "budget_target_bytes": TARGET_RSS[name]},
                 "runs": runs, "config_defs": defs, "configs": {}, "ort_padding_free": setup.get("padding_free", False)}
        if wl == "lm":
            lr = record("ort-8x1", "lean", 0)
            if lr["ok"]:
                st = [x["seconds"] for x in measured(lr["result"])]
                entry["lean"] = {"micro": LEAN[0], "accum": LEAN[1], "completed": True, "exit_code": 0,
                                 "peak_rss": lr["peak_rss"], "hwm": lr["result"]["phases"][0]["hwm"],
                                 "sampled": lr["samples"], "step_seconds": st, "median_step_s": statistics.median(st),
                                 "rss_stages": lr["result"].get("rss"), "wall_s": lr["wall"], "cgroup": None,
                                 "ru_maxrss": lr["ru_maxrss"]}
        for label, (r,) in runs.items():
            if r["ok"]:
                med = statistics.median(x["seconds"] for x in measured(r["result"]))
                log(f"   {wl} {label}: median step {med:.2f} s, peak RSS {r['peak_rss'] / 2**20:.0f} MiB")
            else:
                log(f"   {wl} {label}: FAILED:\n{r['log_tail']}")
        entries.append(entry)
    g = out["gemm-ref"]
    settings = {"turn_seconds": workers["gemm-ref"][1]["turn_seconds"]}
    if g["result"] and "gemm-ref" not in ls.failed:
        gemm = gemm_records(g["result"]["products"])
        settings |= {k: g["result"][k] for k in ("cold_bytes", "ort_spinning", "ort_pause_s", "short_pass_s")}
        log(f"   GEMM reference: {sum(x['n_samples'] for x in gemm)} samples of {len(gemm)} shapes x "
            f"{2 * len(GEMM_LIBS)} products")
    else:
        gemm = []
        log(f"   GEMM reference FAILED:\n{ls.failed.get('gemm-ref') or g['log_tail']}")
    return entries, gemm, settings


def measure_gemm(dims: dict, sub: Path, quick: bool, when: str) -> dict[str, list[dict]]:
    """The GEMM reference of every shape, sampled by one worker per shape outside any lockstep (--profile-only)."""
    gemm: dict[str, list[dict]] = {}
    for name, d in dims.items():
        log(f"GEMM throughput ({when}), {name} shapes")
        g = run_worker("gemm", {"threads": THREADS, "shapes": gemm_shapes(d), "libs": list(GEMM_LIBS),
                                "passes": 1 if quick else 3},
                       sub / f"{name}-gemm-{when}.log", timeout=900)
        gemm[name] = gemm_records(g.result["products"]) if g.ok else []
        if not g.ok:
            log(f"   GEMM FAILED:\n{tail(g.log_path)}")
    return gemm
