"""The phone runner (onnxruntime-web's WASM training build, in Node) against the native device loop, side by side.

Per shape (random weights, the real config from ../shared/data/configs; LoRA r=8, alpha=16 on the attention
projections, seq-len 128, effective batch 8, the LM workload: WikiText-2 train in 128-token blocks, so every step
is 1,024 tokens) every measured run is a process of its own, `pocketlora train` or `node cli.mjs train` with the
same flags (--battery none), and tok/s is the median over its steps after the first of the run's metrics.jsonl
(the runners' own per-step timing: one optimizer step, data and checkpointing excluded; the one checkpoint is
the final one, at the default --save-every 50). Peak RSS is the
process's (VmHWM / ru_maxrss; node's worker threads are in it).

  1. explore (one run each): native at every split of the batch (1x8 2x4 4x2 8x1); WASM at every split, then at
     its best split: 1 thread instead of 2, prepacked frozen weights (the runner turns prepacking off, see
     android_runner/web/src/engine.mjs), and, on GPT-2, head graph variants (--head-vocab-cols) from their own
     bundles. SIMD: onnxruntime-web 1.19.2 ships one training binary (ort-training-wasm-simd-threaded.wasm).
  2. side by side: ROUNDS rounds of [native at its best split, WASM at its best setting], alternating, so
     drift hits both alike; the ratio is of the medians over all rounds' steps.
  3. heap: the largest real shape under WASM's 4 GiB heap: Qwen2.5-0.5B trained by the WASM runner at 1x8.

    python -m bench.web_vs_native [--shapes gpt2-124m,gemma3-270m] [--steps 3] [--rounds 3] [--no-explore]
                                  [--no-heap] [--workdir DIR] [--quick] [--no-doc]

The run is written whole as docs/bench/runs/<date>-web-vs-native.{md,json} (bench/runs.py); --no-doc or --quick
writes it into WORKDIR/web_vs_native/runs/. Bundles are cached as the throughput bench caches them. Nothing is
downloaded.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
from pathlib import Path

from bench import runs
from bench.children import THREADS, child_env, run_child, run_command
from bench.common import LORA, REPO, SEQ_LEN, log, tail
from bench.throughput.phases import prepare_data, setup_shape
from bench.web_vs_native_render import render_report

WHAT = "web-vs-native"
SHAPES = ("gpt2-124m", "gemma3-270m")
HEAP_SHAPE = "qwen2.5-0.5b"
SPLITS = ((1, 8), (2, 4), (4, 2), (8, 1))
HEAD_VARIANTS = (4096, 50304)          # --head-vocab-cols of GPT-2's variant bundles (default 16384; 50304: one slice)
PREPACK = {"extra": {"session": {"disable_prepacking": "0"}}}
NODE_DRIVER = REPO / "bench" / "web_driver.mjs"
TARGET_RATIO = 0.4
TIMEOUT_S = 3600
WAIT_THEN_CLI = ("import runpy, sys; sys.stdin.readline(); sys.argv[0] = 'pocketlora_cli'; "
                 "runpy.run_module('pocketlora_cli', run_name='__main__')")


def run_one(runner: str, bundle: str, data: Path, micro: int, accum: int, steps: int, out: Path, *,
            threads: int = THREADS, session: dict | None = None, flags: list[str] = (),
            cgroup: Path | None = None, keep: bool = False) -> dict:
    """One training run of `runner` (native | web) for 1 + steps optimizer steps: its per-step tok/s, peak RSS.
    `flags`: more `train` flags; `cgroup`: run the native runner inside this memory cgroup; `keep`: leave the run
    directory (else removed after a successful run)."""
    if out.exists():
        shutil.rmtree(out)
    flags = ["--bundle", bundle, "--data", str(data), "--out", str(out), "--max-steps", str(1 + steps),
             "--micro-batch", str(micro), "--accum", str(accum), "--threads", str(threads), "--battery", "none",
             *flags]
    log_path = out.with_suffix(".log")
    out.parent.mkdir(parents=True, exist_ok=True)
    if runner == "native":
        if cgroup is None:
            c = run_child(["pocketlora_cli", "train", *flags], log_path, TIMEOUT_S, env=child_env(threads))
        else:          # waits for the go on stdin (sent once it is in the cgroup) before it imports anything
            c = run_command([sys.executable, "-c", WAIT_THEN_CLI, "train", *flags], log_path, TIMEOUT_S, cgroup,
                            env=child_env(threads))
    else:
        c = run_command(["node", str(NODE_DRIVER), json.dumps(session or {}), "train", *flags], log_path, TIMEOUT_S,
                        env=child_env(threads))
    rec = {"runner": runner, "micro": micro, "accum": accum, "threads": threads, "session": session or {},
           "bundle": Path(bundle).name, "exit": c.code, "wall_s": round(c.wall, 1), "peak_rss": c.peak_rss(),
           "cpu_s": c.cpu_s}
    if cgroup is not None:
        rec["cgroup"] = c.cgroup
    metrics = out / "metrics.jsonl"
    steps_seen = [json.loads(ln) for ln in metrics.read_text().splitlines()] if metrics.is_file() else []
    if c.code != 0 or len(steps_seen) < 1 + steps:
        rec["error"] = tail(log_path, 6)
        return rec
    measured = steps_seen[1:]
    rec["step_s"] = [m["step_s"] for m in measured]
    rec["tokens"] = [m["tokens"] for m in measured]
    rec["tok_s"] = statistics.median(m["tokens"] / m["step_s"] for m in measured)
    rec["first_step_s"] = steps_seen[0]["step_s"]
    rec["load_s"] = round(c.wall - sum(m["step_s"] for m in steps_seen), 1)
    if not keep:
        shutil.rmtree(out)                 # the checkpoints are GBs of nothing we need
    return rec


def _label(r: dict) -> str:
    extra = [f"{r['threads']} thr"] + (["prepack"] if r["session"] else []) + (
        [r["bundle"].split("@", 1)[1]] if "@" in r["bundle"] else [])
    return f"{r['runner']} {r['micro']}x{r['accum']} ({', '.join(extra)})"


def _say(r: dict) -> None:
    if "error" in r:
        log(f"   {_label(r)}: FAILED (exit {r['exit']}): {r['error'].splitlines()[-1] if r['error'] else ''}")
    else:
        log(f"   {_label(r)}: {r['tok_s']:.1f} tok/s, peak RSS {r['peak_rss'] / 2**20:,.0f} MiB")


def _best(records: list[dict]) -> dict | None:
    ok = [r for r in records if "error" not in r]
    return max(ok, key=lambda r: r["tok_s"]) if ok else None


def variant_bundle(name: str, sub: Path, tag: str, flags: list[str]) -> Path:
    """The shape's bundle rebuilt from its cached checkpoint with extra `gen` flags, as <name>-bundle@<tag>
    (cached by its flags)."""
    out = sub / f"{name}-bundle@{tag}"
    stamp = out.with_suffix(out.suffix + ".stamp")
    src = sub / f"{name}-bundle.stamp"
    want = json.dumps({"base": src.read_text(), "flags": flags})
    if not (stamp.is_file() and stamp.read_text() == want and (out / "manifest.json").is_file()):
        args = ["pocketlora_cli", "gen", "--model", str(sub / f"{name}-ckpt"), "--out", str(out), "--force",
                "--lora-r", str(LORA["r"]), "--lora-alpha", str(LORA["alpha"]), "--targets", LORA["targets"],
                "--seq-len", str(SEQ_LEN), *flags]
        c = run_child(args, sub / f"{out.name}.gen.log", TIMEOUT_S)
        if c.code != 0:
            raise SystemExit(f"gen of {out.name} failed:\n{tail(c.log_path)}")
        stamp.write_text(want)
    return out


def explore(name: str, bundle: str, data: Path, sub: Path, steps: int, quick: bool) -> dict:
    """Every split for both runners, then the WASM runner's threads, prepacking and head variants at its best."""
    runs_dir = sub / "runs-explore"
    out: dict = {"native": [], "web": []}
    for runner in ("native", "web"):
        for m, a in SPLITS:
            r = run_one(runner, bundle, data, m, a, steps, runs_dir / f"{name}-{runner}-{m}x{a}")
            _say(r)
            out[runner].append(r)
    best = _best(out["web"])
    if best is None:
        return out
    m, a = best["micro"], best["accum"]
    for kw in ({"threads": 1}, {"session": PREPACK}):
        r = run_one("web", bundle, data, m, a, steps, runs_dir / f"{name}-web-{m}x{a}-{'-'.join(kw)}", **kw)
        _say(r)
        out["web"].append(r)
    if name.startswith("gpt2") and not quick:
        for cols in HEAD_VARIANTS:
            vb = variant_bundle(name, sub, f"cols{cols}", ["--head-vocab-cols", str(cols)])
            r = run_one("web", str(vb), data, m, a, steps, runs_dir / f"{name}-web-{m}x{a}-cols{cols}")
            _say(r)
            out["web"].append(r)
    return out


def side_by_side(name: str, bundle: str, data: Path, sub: Path, steps: int, rounds: int, native: dict,
                 web: dict, sub_bundles: dict[str, str]) -> dict:
    """ROUNDS alternating rounds of native and WASM at their chosen settings: medians over all their steps."""
    recs: dict = {"native": [], "web": []}
    for i in range(rounds):
        for runner, cfg in (("native", native), ("web", web)):
            b = sub_bundles.get(cfg["bundle"], bundle)
            r = run_one(runner, b, data, cfg["micro"], cfg["accum"], steps, sub / "runs-sbs" / f"{name}-{runner}-{i}",
                        threads=cfg["threads"], session=cfg["session"] or None)
            _say(r)
            recs[runner].append(r)
    summary = {}
    for runner, rs in recs.items():
        ok = [r for r in rs if "error" not in r]
        per_step = [t / s for r in ok for t, s in zip(r["tokens"], r["step_s"])]
        summary[runner] = {"setting": _label(native if runner == "native" else web),
                           "tok_s_median": statistics.median(per_step) if per_step else None,
                           "tok_s_range": [min(per_step), max(per_step)] if per_step else None,
                           "peak_rss_max": max((r["peak_rss"] for r in ok), default=None),
                           "rounds_ok": len(ok), "rounds": len(rs)}
    n, w = summary["native"]["tok_s_median"], summary["web"]["tok_s_median"]
    summary["ratio"] = w / n if n and w else None
    return {"runs": recs, "summary": summary}


def heap_probe(sub: Path, data: Path, steps: int, quick: bool) -> dict:
    """The largest real shape (Qwen2.5-0.5B, 1.98 GB of fp32 weights) in the WASM runner at 1x8."""
    setup = setup_shape(HEAP_SHAPE, sub, quick)
    if setup.get("ok") is False:
        return {"shape": HEAP_SHAPE, "error": setup["error"]}
    r = run_one("web", setup["bundle"], data, 1, 8, steps, sub / "runs-heap" / f"{HEAP_SHAPE}-web-1x8")
    _say(r)
    return {"shape": HEAP_SHAPE, "weight_bytes": _weight_bytes(Path(setup["bundle"])), "run": r}


def _weight_bytes(bundle: Path) -> int:
    return sum(p.stat().st_size for p in bundle.glob("weights-*.bin"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--steps", type=int, default=3, help="measured steps per run, after one warm-up step (default 3)")
    ap.add_argument("--rounds", type=int, default=3, help="side-by-side rounds (default 3)")
    ap.add_argument("--no-explore", action="store_true", help="skip the exploration; both runners at 1x8, 2 threads")
    ap.add_argument("--no-heap", action="store_true", help=f"skip the {HEAP_SHAPE} heap run")
    ap.add_argument("--quick", action="store_true", help="tiny configs, 1 step, 1 round: a smoke test; docs untouched")
    args = runs.parse(ap, argv, WHAT, render_report)
    if args is None:
        return 0
    if args.quick:
        args.steps, args.rounds = 1, 1
    sub = args.workdir / ("web_vs_native-quick" if args.quick else "web_vs_native")
    sub.mkdir(parents=True, exist_ok=True)
    data = prepare_data(sub)["lm"]
    payload = {**runs.start(WHAT, "bench.web_vs_native", argv), "steps": args.steps, "rounds": args.rounds,
               "threads": THREADS, "lora": LORA, "seq_len": SEQ_LEN, "target_ratio": TARGET_RATIO, "shapes": {}}
    for name in args.shapes.split(","):
        log(f"{name}: bundle")
        setup = setup_shape(name, sub, args.quick)
        if setup.get("ok") is False:
            payload["shapes"][name] = {"error": setup["error"]}
            continue
        bundle = setup["bundle"]
        entry: dict = {"weight_bytes": _weight_bytes(Path(bundle))}
        default = {"micro": 1, "accum": 8, "threads": THREADS, "session": {}, "bundle": Path(bundle).name}
        native = web = default
        if not args.no_explore:
            log(f"{name}: explore")
            entry["explore"] = explore(name, bundle, data, sub, args.steps, args.quick)
            native = _best(entry["explore"]["native"]) or default
            web = _best(entry["explore"]["web"]) or default
        log(f"{name}: side by side, {args.rounds} rounds")
        variants = {p.name: str(p) for p in sub.glob(f"{name}-bundle@cols*") if p.is_dir()}
        entry["side_by_side"] = side_by_side(name, bundle, data, sub, args.steps, args.rounds, native, web, variants)
        s = entry["side_by_side"]["summary"]
        log(f"{name}: native {s['native']['tok_s_median']} tok/s, web {s['web']['tok_s_median']} tok/s, "
            f"ratio {s['ratio']}")
        payload["shapes"][name] = entry
    if not args.no_heap:
        log(f"heap: {HEAP_SHAPE}")
        payload["heap"] = heap_probe(sub, data, 1, args.quick)
    runs.finish(payload, WHAT, render_report, sub, args.quick, args.no_doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
