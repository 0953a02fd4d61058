"""The quantized frozen base (issue 29) against float32, side by side: bundle size, peak RSS and tok/s.

Per shape (random weights, the real config from ../shared/data/configs; LoRA r=8, alpha=16 on the attention
projections, seq-len 128, effective batch 8 at the runner's split or at `--split MxA` for all, the LM workload:
WikiText-2 train in 128-token blocks) the same checkpoint is built three times, `pocketlora gen --quant
none|int8|int4`, and each bundle is trained by `pocketlora train` in a process of its own for 1 + STEPS optimizer
steps; ROUNDS rounds of [none, int8, int4] alternate so drift hits all alike. tok/s is the median over each run's
steps after its first (the runner's own step timing), the ratio is of the medians over all rounds; peak RSS is the
process's VmHWM.
Bundle weights: the shard files (weights-*.bin). Random weights say nothing about quality (see docs/STATUS.md).

    python -m bench.quant_base [--shapes gpt2-124m,gemma3-270m] [--steps 3] [--rounds 2] [--split 2x4]
                               [--no-budget] [--no-lowmem] [--quick] [--no-doc]

Then per shape the int4 bundle trains once more with `--memory-budget` set to its peak-RSS goal: the runner measures
micro-batches of 1 and 2 sequences and picks the largest split of the effective batch 8 predicted to fit; reported:
that split, its peak RSS and tok/s (the same measurement as above), and float32's tok/s at that split (a run of
its own, for the ratio at the same split). Last, Qwen2.5-0.5B int4 trains with --memory low
at 1x8 inside a cgroup-v1 memory cgroup capped at 0.6 GB.
    python -m bench.quant_base --rerender [--run JSON]

The run is written whole as docs/bench/runs/<date>-quant-base.{md,json} (bench/runs.py).
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
from pathlib import Path

from android_runner.loop import RUN_CONFIG, SUMMARY
from bench import runs
from bench.common import SPEED_INT4_CODES, log
from bench.quant_base_render import MODES, render_report
from bench.throughput.phases import prepare_data, setup_shape
from bench.web_vs_native import _weight_bytes, run_one, variant_bundle

WHAT = "quant-base"
SHAPES = ("gpt2-124m", "gemma3-270m", "qwen2.5-0.5b")
SPLIT = {"gpt2-124m": (4, 2), "gemma3-270m": (2, 4), "qwen2.5-0.5b": (2, 4)}   # the runner's own (docs/STATUS.md)
GOALS = {  # shape: (bundle weights with int4, peak RSS with int4), bytes
    "gpt2-124m": (0.1e9, 0.5e9), "gemma3-270m": (0.25e9, 0.8e9), "qwen2.5-0.5b": (0.4e9, 1.0e9)}
TARGET_RATIO = 0.8
LOWMEM = ("qwen2.5-0.5b", "int4", 0.6e9)   # shape, mode, hard cap: trains under --memory low in a cgroup


def lowmem(bundle: str, data: Path, sub: Path, steps: int) -> dict:
    """The bundle trained with --memory low at 1x8 inside a cgroup-v1 memory cgroup capped at LOWMEM's bytes (its
    shards evicted from the page cache first, so their pages are charged to the cgroup)."""
    from bench.throughput.config import CGROUP, CGROUP_ROOT
    from bench.throughput.lowmem import _evict_page_cache, _reset_cgroup_counters

    cap = int(LOWMEM[2])
    if not CGROUP_ROOT.is_dir():
        return {"cap_bytes": cap, "error": f"{CGROUP_ROOT} does not exist (no cgroup v1 memory controller)"}
    CGROUP.mkdir(exist_ok=True)
    (CGROUP / "memory.limit_in_bytes").write_text(str(cap))
    _reset_cgroup_counters()
    _evict_page_cache([p for p in Path(bundle).iterdir() if p.name.startswith("weights-")])
    rec = run_one("native", bundle, data, 1, 8, steps, sub / "lowmem-run", flags=["--memory", "low"], cgroup=CGROUP)
    return {"cap_bytes": cap, **rec}


def budget_run(bundle: str, data: Path, steps: int, goal_bytes: float, out: Path) -> dict:
    """The int4 bundle trained at effective batch 8 with --memory-budget at the goal (in MiB): the runner's own
    split under it, as its run records it (run.json)."""
    budget_mib = int(goal_bytes / 2**20)
    rec = run_one("native", bundle, data, 2, 4, steps, out, flags=["--memory-budget", str(budget_mib)], keep=True)
    if (out / RUN_CONFIG).is_file():
        cfg = json.loads((out / RUN_CONFIG).read_text())
        rec["split"] = [cfg["micro_batch"], cfg["accum"]]
    if (out / SUMMARY).is_file():
        rec["memory_fit"] = json.loads((out / SUMMARY).read_text()).get("memory_fit")
    shutil.rmtree(out, ignore_errors=True)
    return {"budget_mib": budget_mib, **rec}


def bundles(name: str, sub: Path, quick: bool) -> dict[str, str] | dict:
    setup = setup_shape(name, sub, quick)
    if setup.get("ok") is False:
        return {"error": setup["error"]}
    out = {"none": setup["bundle"]}
    for mode in MODES[1:]:
        log(f"{name}: gen --quant {mode}")
        codes = SPEED_INT4_CODES if mode == "int4" else []
        out[mode] = str(variant_bundle(name, sub, mode, ["--quant", mode, *codes]))
    return out


def _split(text: str) -> tuple[int, int]:
    """'2x4' -> (2, 4): a split of the effective batch 8."""
    try:
        micro, accum = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give micro-batch x accumulation, e.g. 2x4") from None
    if micro < 1 or accum < 1 or micro * accum != 8:
        raise argparse.ArgumentTypeError(f"{text!r}: micro-batch x accumulation must make the effective batch 8")
    return micro, accum


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--steps", type=int, default=3, help="measured steps per run, after one warm-up step (default 3)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of none, int8, int4 (default 2)")
    ap.add_argument("--quick", action="store_true", help="tiny configs, 1 step, 1 round: a smoke test; docs untouched")
    ap.add_argument("--no-budget", action="store_true", help="skip the int4 runs under --memory-budget at the goal")
    ap.add_argument("--split", type=_split, default=None, metavar="MxA",
                    help="train every shape at this split of the effective batch 8 (default: each one's runner's "
                    "split)")
    ap.add_argument("--no-lowmem", action="store_true", help=f"skip {LOWMEM[0]} {LOWMEM[1]} under the capped "
                    "--memory low run")
    args = runs.parse(ap, argv, WHAT, render_report)
    if args is None:
        return 0
    if args.quick:
        args.steps, args.rounds = 1, 1
    sub = args.workdir / ("quant_base-quick" if args.quick else "quant_base")
    sub.mkdir(parents=True, exist_ok=True)
    data = prepare_data(sub)["lm"]
    payload = {**runs.start(WHAT, "bench.quant_base", argv), "steps": args.steps, "rounds": args.rounds,
               "target_ratio": TARGET_RATIO, "split_given": bool(args.split), "shapes": {}}
    for name in args.shapes.split(","):
        log(f"{name}: bundles")
        b = bundles(name, sub, args.quick)
        if "error" in b:
            payload["shapes"][name] = b
            continue
        micro, accum = args.split or SPLIT.get(name, (1, 8))
        entry = {"split": [micro, accum], "goals": GOALS.get(name), "modes": {
            m: {"weight_bytes": _weight_bytes(Path(b[m])), "runs": []} for m in MODES}}
        for r in range(args.rounds):
            for m in MODES:
                rec = run_one("native", b[m], data, micro, accum, args.steps, sub / f"{name}-{m}-run")
                log(f"   {name} {m} round {r + 1}: " + (f"{rec['tok_s']:.1f} tok/s, peak RSS "
                    f"{rec['peak_rss'] / 2**20:,.0f} MiB" if "error" not in rec else f"FAILED: {rec['error'][-200:]}"))
                entry["modes"][m]["runs"].append(rec)
        for m, e in entry["modes"].items():
            ok = [x for x in e["runs"] if "error" not in x]
            e["tok_s_median"] = statistics.median(t / s for x in ok for t, s in zip(x["tokens"], x["step_s"])) if ok else None
            e["peak_rss_max"] = max((x["peak_rss"] for x in ok), default=None)
        payload["shapes"][name] = entry
        if not args.no_budget and GOALS.get(name):
            log(f"{name}: int4 under --memory-budget {GOALS[name][1] / 1e9:.1f} GB")
            r = entry["budget"] = budget_run(b["int4"], data, args.steps, GOALS[name][1],
                                             sub / f"{name}-budget-run")
            log("   " + (f"split {r.get('split')}, {r['tok_s']:.1f} tok/s, peak RSS {r['peak_rss'] / 2**20:,.0f} MiB"
                         if "error" not in r else f"FAILED: {r['error'][-300:]}"))
            if r.get("split") and r["split"] != [micro, accum]:       # float32 at the same split, for its ratio
                f = r["none_at_split"] = run_one("native", b["none"], data, *r["split"], args.steps,
                                                 sub / f"{name}-none-split-run")
                log("   " + (f"none at {r['split']}: {f['tok_s']:.1f} tok/s" if "error" not in f
                             else f"none at {r['split']}: FAILED: {f['error'][-300:]}"))
        if name == LOWMEM[0] and not args.no_lowmem:
            log(f"{name}: {LOWMEM[1]} under --memory low, capped at {LOWMEM[2] / 1e9:.1f} GB")
            payload["lowmem"] = {"shape": name, "mode": LOWMEM[1], **lowmem(b[LOWMEM[1]], data, sub, args.steps)}
            r = payload["lowmem"]
            log("   " + (f"{r['tok_s']:.1f} tok/s, peak RSS {r['peak_rss'] / 2**20:,.0f} MiB" if "error" not in r
                         else f"FAILED: {r['error'][-300:]}"))
    runs.finish(payload, WHAT, render_report, sub, args.quick, args.no_doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
