"""Training throughput and memory: the device path (ORT) against PyTorch eager + PEFT, at real shapes.

For each shape (random weights, the real config from ../shared/data/configs; LoRA r=8, alpha=16 on
the attention projections, seq-len 128, effective batch 8) and each workload
  lm   WikiText-2 train (first LM_LINES lines), 128-token blocks, every token labelled;
  sft  ../shared/data/sft/alpaca_en_demo.json, prompt tokens labelled -100,
three configurations run, each in its own process with 2 threads:
  A  ORT device path: TrainSession + train_step on the loop's micro-batches, micro-batch 8 x accum 1;
  B  PyTorch eager + PEFT (eval.reference.reference_train; SDPA attention, eval() base, AdamW), 8 x 1;
  C  ORT as the runner splits the batch under `--memory-budget` = the shape's peak-RSS target
     (android_runner/memory_fit.py: two measured worst-case micro-batches, the largest fitting split).
--pilot adds a speed map: 1x8, 2x4, 4x2, 8x1, one process each, in lockstep, 1 warm-up + PILOT_STEPS steps.
Per shape the three processes load together, then take turns one step at a time (A B C A B C: Lockstep),
sft then lm, --warmup + --steps steps each; A first runs the memory-lean 1x8 setting on lm (1 + 1 steps).
Per phase: the worker's VmHWM (reset at the phase start) and the parent's 0.1 s VmRSS samples. A fourth
worker takes a turn in every round too: float32 GEMM throughput on the step's own matmul shapes
(numpy/OpenBLAS and ORT MatMul/Gemm as the training session runs them), the reference of the compute
efficiency, sampled in the same minutes as the steps. The bench counts each step's FLOPs, and finally runs
Qwen2.5-0.5B's device path with RuntimeOptions(memory="low") under a cgroup-v1 memory limit of 60% of its
fp32 weight bytes (compared with the lean phase).

    python -m bench.train_throughput [--shapes gpt2-124m,gemma3-270m,qwen2.5-0.5b] [--workloads lm,sft]
        [--steps 5] [--warmup 1] [--pilot] [--profile] [--workdir DIR] [--quick] [--no-doc]

The run is written whole as docs/bench/runs/<date>-train-throughput.md with its raw results (.json) and plot
(.png) beside it (bench/runs.py); --no-doc writes them into WORKDIR/train_throughput/runs/ instead.
--quick: tiny configs derived from the real ones (2 layers, hidden 64, real vocabularies), a pilot,
one warm-up + 2 measured steps: a smoke test of every path, numbers meaningless; the docs are not
touched (the run goes to WORKDIR/train_throughput-quick/runs/). Checkpoints and bundles are cached under
WORKDIR/train_throughput[-quick]/ and reused when their inputs (config, tokenizer, artifacts_gen
sources, LoRA settings) are unchanged. Nothing is downloaded.

This module is the entry point (flags, the order of the phases, writing the run); the phases, the summaries and
the report are in bench/throughput/ (see its __init__).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench import runs
from bench.common import DEFAULT_WORKDIR, LORA, REPO, RUNS, SEQ_LEN, SHAPES, log, machine, utc_now
from bench.children import THREADS
from bench.throughput.config import (EFFECTIVE_BATCH, LM_LINES, LOWMEM_SHAPE, PILOT, PILOT_STEPS, WHAT,
                                     WORKLOADS)
from bench.throughput.flops import model_dims
from bench.throughput.lowmem import lowmem_run
from bench.throughput.phases import lockstep_shape, measure_gemm, prepare_data, run_pilot, setup_shape
from bench.throughput.plot import make_plot
from bench.throughput.profile import profile_runs
from bench.throughput.render import render_report
from bench.throughput.summary import summarize_payload


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--steps", type=int, default=5, help="measured steps per configuration and workload (default 5)")
    ap.add_argument("--warmup", type=int, default=1, help="warm-up steps before them (default 1)")
    ap.add_argument("--pilot", action="store_true",
                    help="also time every split (1x8, 2x4, 4x2, 8x1) of each shape and workload, one process each, "
                         "for the speed map (adds ~11 min); the lockstep's ort-fit splits the batch by itself")
    ap.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR)
    ap.add_argument("--quick", action="store_true", help="tiny configs, smoke test (a few minutes); the run goes to the "
                                                         "workdir, docs untouched")
    ap.add_argument("--no-lowmem", action="store_true", help="skip the low-memory run")
    ap.add_argument("--no-doc", action="store_true", help="write the run into the workdir, not docs/bench/runs/")
    ap.add_argument("--profile", action="store_true",
                    help="also run one ORT-profiled step per shape (lm; 8x1 and the best setting) and report where it goes")
    ap.add_argument("--merge", action="store_true",
                    help="put this invocation's shapes/workloads into an existing run (--run, default the newest; "
                         "replacing the same ones) instead of starting a new one, e.g. to re-measure a shape that "
                         "other load disturbed")
    ap.add_argument("--rerender", action="store_true",
                    help="recompute the summaries from a run's JSON (--run, default the newest) and rewrite its "
                         "report and plot")
    ap.add_argument("--profile-only", action="store_true",
                    help="only the --profile runs, added to an existing run (--run, default the newest); its report "
                         "and plot re-rendered")
    ap.add_argument("--run", type=Path, metavar="JSON",
                    help="the run --merge, --rerender and --profile-only work on (its <stem>.json)")
    args = ap.parse_args(argv)
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    if bad := [s for s in shapes if s not in SHAPES]:
        ap.error(f"--shapes: unknown {bad}; known {SHAPES}")
    if bad := [w for w in workloads if w not in WORKLOADS]:
        ap.error(f"--workloads: unknown {bad}; known {WORKLOADS}")
    if args.steps < 1 or args.warmup < 0:
        ap.error("--steps >= 1, --warmup >= 0")
    if args.quick:
        steps, warmup, pilot_steps = 2, min(args.warmup, 1), 1
    else:
        steps, warmup, pilot_steps = args.steps, args.warmup, PILOT_STEPS
    workdir = args.workdir.absolute()
    sub = workdir / ("train_throughput-quick" if args.quick else "train_throughput")
    sub.mkdir(parents=True, exist_ok=True)
    t_begin = time.time()
    command = "python -m bench.train_throughput" + "".join(
        f" {flag} {val}" for flag, val, default in (
            ("--shapes", ",".join(shapes), ",".join(SHAPES)), ("--workloads", ",".join(workloads), ",".join(WORKLOADS)),
            ("--steps", args.steps, 5), ("--warmup", args.warmup, 1))
        if str(val) != str(default)) + (" --quick" if args.quick else "") + (" --merge" if args.merge else "") + (
        " --pilot" if args.pilot else "")
    info = {"date": utc_now(), "command": command, "machine": machine(), "quick": args.quick,
            "load_at_start": os.getloadavg(),
            "settings": {"lora": LORA, "seq_len": SEQ_LEN, "effective_batch": EFFECTIVE_BATCH, "threads": THREADS,
                         "steps": steps, "warmup": warmup, "mode": "lockstep", "pilot": [list(p) for p in PILOT],
                         "pilot_mode": "lockstep", "pilot_steps": pilot_steps, "lm_lines": LM_LINES}}
    data = prepare_data(sub)
    what = WHAT + ("-quick" if args.quick else "")
    out_dir = sub / "runs" if (args.quick or args.no_doc) else RUNS
    existing = args.run or runs.latest(out_dir, what)          # the run --rerender, --profile-only, --merge work on
    if (args.rerender or args.profile_only) and existing is None:
        ap.error(f"no {what} run in {out_dir}; name one with --run")

    if args.rerender:
        finish(json.loads(existing.read_text()), existing.parent, existing.stem)
        return 0
    if args.profile_only:
        payload = json.loads(existing.read_text())
        dims = {n: model_dims(s["config"]) for n, s in payload["setups"].items() if s.get("ok", True)}
        payload["gemm_end"] = measure_gemm(dims, sub, args.quick, "end")
        payload["gemm_end_note"] = "measured by the --profile-only invocation after the run"
        payload["profile"] = profile_runs(payload["setups"], data, sub, payload["results"], args.quick)
        payload["profile_command"] = command.replace("bench.train_throughput", "bench.train_throughput --profile-only", 1)
        payload["profile_date"] = utc_now()
        finish(payload, existing.parent, existing.stem)
        return 0

    # 1. checkpoints and bundles (cached), built side by side: nothing is measured yet, and a build is mostly
    #    one busy thread (tracing, ORT's gradient builder), so two cores take the three in ~half the time
    log(f"setup {', '.join(shapes)}: checkpoints + bundles, in parallel (cached in {sub})")
    with ThreadPoolExecutor(max_workers=len(shapes)) as pool:
        setups = dict(zip(shapes, pool.map(lambda n: setup_shape(n, sub, args.quick), shapes)))
    for name, s in setups.items():
        if s.get("ok", True):
            log(f"   {s['name']}: {s['ckpt_info']['params'] / 1e6:.1f} M params, bundle "
                f"{'built in %.0f s' % s['build_seconds'] if s['bundle_built'] else 'reused'}")
        else:
            log(f"   {name}: setup FAILED:\n{s['error']}")
    dims = {n: model_dims(s["config"]) for n, s in setups.items() if s.get("ok", True)}

    # 2. GEMM throughput on the step's own shapes: sampled inside each shape's lockstep (step 4), so that the
    #    reference and the steps see this shared machine in the same minutes
    gemm: dict[str, list[dict]] = {}
    gemm_settings: dict = {}

    # 3. optional pilot (--pilot; --quick too): every split in its own process, for the speed map only; the
    #    lockstep's ort-fit splits the batch itself (the runner's --memory-budget)
    results = []
    timeout = 300 if args.quick else 1800
    pilots: dict[tuple[str, str], list] = {}
    if args.pilot or args.quick:
        for name in shapes:
            for wl in workloads:
                if setups[name].get("ok", True):
                    pilots[name, wl] = run_pilot(setups[name], wl, data, sub, pilot_steps, timeout)

    # 4. per shape, one lockstep: ort-8x1, torch-8x1, ort-fit take turns step by step (sft, then lm)
    for name in shapes:
        s = setups[name]
        if not s.get("ok", True):
            results.append({"shape": name, "ok": False, "error": s["error"]})
            continue
        entries, gemm[name], gemm_settings = lockstep_shape(s, name, workloads, pilots, data, sub,
                                                            warmup, steps, timeout, dims[name], args.quick)
        results += entries

    # 5. low-memory mode under a hard limit; its normal-mode comparison is the lockstep's lean phase
    lowmem = None
    if LOWMEM_SHAPE in shapes and not args.no_lowmem and setups[LOWMEM_SHAPE].get("ok", True):
        lean = next((r.get("lean") for r in results if r["shape"] == LOWMEM_SHAPE and r.get("workload") == "lm"), None)
        lowmem = lowmem_run(setups[LOWMEM_SHAPE], data["lm"], sub, args.quick, 300 if args.quick else 900, lean)
    gemm_end = {}          # the reference is sampled in the lockstep; `--profile-only` adds a measurement after it
    info["wall_seconds"] = round(time.time() - t_begin, 1)
    info["load_at_end"] = os.getloadavg()
    payload = {**info, "setups": setups, "gemm": gemm, "gemm_mode": "interleaved", "gemm_settings": gemm_settings,
               "gemm_end": gemm_end, "results": results, "lowmem": lowmem}
    if args.profile:
        payload["profile"] = profile_runs(setups, data, sub, results, args.quick)
    if args.merge and existing is not None:
        finish(merge_into(json.loads(existing.read_text()), payload), existing.parent, existing.stem)
    else:
        finish(payload, out_dir, runs.stem(payload["date"], what))
    log(f"total {info['wall_seconds']:.0f} s (measurements; profiling not included)")
    return 0


def merge_into(old: dict, new: dict) -> dict:
    """--merge: this invocation's shapes/workloads replace the same ones in the existing results."""
    done = {(r["shape"], r.get("workload")) for r in new["results"]}
    old["results"] = [r for r in old["results"] if (r["shape"], r.get("workload")) not in done] + new["results"]
    order = {(sh, wl): i for i, (sh, wl) in enumerate((a, b) for a in SHAPES for b in (*WORKLOADS, None))}
    old["results"].sort(key=lambda r: order.get((r["shape"], r.get("workload")), 99))
    for k in ("setups", "gemm", "gemm_end"):
        old.setdefault(k, {}).update(new.get(k) or {})
    if new.get("lowmem"):
        old["lowmem"] = new["lowmem"]
    if new.get("profile"):
        old.setdefault("profile", {}).update(new["profile"])
    old.setdefault("merges", []).append({k: new[k] for k in ("date", "command", "wall_seconds", "load_at_start", "load_at_end")}
                                        | {"replaced": sorted(f"{a} {b}" for a, b in done)})
    return old


def finish(payload: dict, out_dir: Path, run: str) -> None:
    """(Re)compute the statistics, then write the run whole: <run>.json, <run>.md (the report) and <run>.png."""
    summarize_payload(payload)
    written = runs.write(out_dir, run, render_report(payload, run), payload)
    make_plot(payload, out_dir / f"{run}.png")
    log("wrote " + ", ".join(str(p.relative_to(REPO) if p.is_relative_to(REPO) else p)
                             for p in [*written, out_dir / f"{run}.png"]))


if __name__ == "__main__":
    sys.exit(main())
