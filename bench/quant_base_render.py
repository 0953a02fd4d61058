"""The report of a bench.quant_base run, from its JSON alone (so any run re-renders to the same bytes)."""
from __future__ import annotations

from bench import runs

MODES = ("none", "int8", "int4")
TITLE = "Quantized frozen base vs float32"


def _gb(b) -> str:
    return "—" if b is None else f"{b / 1e9:.3f}"


def _verdict(value, goal) -> str:
    if value is None or goal is None:
        return "—"
    return "met" if value <= goal else "MISSED"


def _same_split(r: dict, target: float) -> str:
    """int4's tok/s under the budget against float32's at the same split (its own run), with the verdict."""
    f = r.get("none_at_split")
    if f is None:
        return "— (the fixed split)"
    if "error" in f:
        return "float32 FAILED"
    ratio = r["tok_s"] / f["tok_s"]
    return f"{ratio:.2f}x of {f['tok_s']:.1f}: {'met' if ratio >= target else 'MISSED'}"


def render_report(p: dict, run: str) -> str:
    lines = runs.header(TITLE, run, "bench/quant_base.py", p["machine"], p["command"], {"raw results": f"{run}.json"})
    where = "the split given" if p.get("split_given") else "the runner's split"      # --split MxA: every shape at it
    lines += [
        "Each shape's random-weight checkpoint built three times (`pocketlora gen --quant none|int8|int4`), each "
        f"bundle trained by `pocketlora train` (2 threads, `--battery none`) for 1 + {p['steps']} steps, "
        f"{p['rounds']} rounds of none, int8, int4 alternating. LoRA r=8 on attn, seq-len 128, effective batch 8 at "
        f"{where}, WikiText-2 in 128-token blocks. tok/s: median over the steps after each run's first; "
        "ratio: of the medians; peak RSS: the process's VmHWM, the largest over the rounds. Weights: the bundle's "
        "shard files. int8: linear weights per column; int4: per block of 32 rows; both: embedding / LM head int8 "
        "per row.",
        "",
        "| shape | split | mode | weights GB | goal | peak RSS GB | goal | tok/s | vs none | goal >= "
        f"{p['target_ratio']}x |",
        "|---|---|---|---:|---|---:|---|---:|---:|---|",
    ]
    for name, e in p["shapes"].items():
        if "error" in e:
            lines.append(f"| {name} | setup FAILED: {e['error'].splitlines()[-1][:160]} |||||||||")
            continue
        goals = e.get("goals") or [None, None]
        base = e["modes"]["none"]["tok_s_median"]
        for m in MODES:
            x = e["modes"][m]
            tok = x["tok_s_median"]
            ratio = tok / base if tok and base else None
            four = m == "int4"
            lines.append(
                f"| {name} | {e['split'][0]}x{e['split'][1]} | {m} | {_gb(x['weight_bytes'])} | "
                f"{f'<= {goals[0] / 1e9:.2f}: ' + _verdict(x['weight_bytes'], goals[0]) if four and goals[0] else ''} | "
                f"{_gb(x['peak_rss_max'])} | "
                f"{f'<= {goals[1] / 1e9:.2f}: ' + _verdict(x['peak_rss_max'], goals[1]) if four and goals[1] else ''} | "
                f"{'FAILED' if tok is None else f'{tok:.1f}'} | {'—' if ratio is None else f'{ratio:.2f}x'} | "
                f"{'' if m == 'none' or ratio is None else ('met' if ratio >= p['target_ratio'] else 'MISSED')} |")
    budget = {n: e["budget"] for n, e in p["shapes"].items() if "budget" in e}
    if budget:
        new_probe = any(r.get("memory_fit") for r in budget.values())     # runs since 2026-12-07
        same = any("none_at_split" in r for r in budget.values())          # runs since 2026-12-07 12:00
        lines += ["", "## int4 under --memory-budget at the peak-RSS goal", "",
                  "The int4 bundle trained once more at effective batch 8 with `--memory-budget` set to the goal: the "
                  + ("runner measures a micro-batch of 1 (and of 2 only if bounded under the budget) and keeps the "
                     "largest split predicted to fit. Probe: the peaks it measured at 1 / 2 sequences (MiB). The ratio "
                     "is to none at the fixed split above." if new_probe else
                     "runner measures micro-batches of 1 and 2 and keeps the largest split predicted to fit."), "",
                  "| shape | budget MiB | split chosen | peak RSS GB | goal | tok/s | "
                  + ("vs none (fixed split) | probe |" if new_probe else "vs none at its split |")
                  + (" vs none at this split |" if same else ""),
                  "|---|---:|---|---:|---|---:|---:|" + ("---|" if new_probe else "") + ("---:|" if same else "")]
        for name, r in budget.items():
            goal = (p["shapes"][name].get("goals") or [None, None])[1]
            base = p["shapes"][name]["modes"]["none"]["tok_s_median"]
            if "error" in r:
                lines.append(f"| {name} | {r['budget_mib']:,} | FAILED (exit {r.get('exit')}): "
                             f"{(r['error'].splitlines() or ['?'])[-1][:160]} |||||")
                continue
            split = "x".join(map(str, r["split"])) if r.get("split") else "?"
            ratio = "—" if not base else f"{r['tok_s'] / base:.2f}x"
            probe = ""
            if new_probe:
                meas = (r.get("memory_fit") or {}).get("measured_mb", {})
                probe = " " + " / ".join(f"{meas[k]:,.0f}" if k in meas else "not run" for k in ("1", "2")) + " |"
            lines.append(f"| {name} | {r['budget_mib']:,} | {split} | {_gb(r['peak_rss'])} | "
                         f"<= {goal / 1e9:.2f}: {_verdict(r['peak_rss'], goal)} | {r['tok_s']:.1f} | "
                         f"{ratio} |{probe}" + (f" {_same_split(r, p['target_ratio'])} |" if same else ""))
    if "lowmem" in p:
        r = p["lowmem"]
        what = (f"FAILED (exit {r.get('exit')}): {(r['error'].splitlines() or ['?'])[-1][:200]}" if "error" in r else
                f"trained: {r['tok_s']:.1f} tok/s, peak RSS {r['peak_rss'] / 2**20:,.0f} MiB"
                + (f", cgroup high-water {r['cgroup'].get('memory.max_usage_in_bytes', 0) / 2**20:,.0f} MiB, limit hits "
                   f"{r['cgroup'].get('memory.failcnt', '?')}" if r.get("cgroup") else ""))
        lines += ["", f"## {r['shape']} {r['mode']} under a hard cap of {r['cap_bytes'] / 1e9:.1f} GB", "",
                  f"`pocketlora train --memory low` at 1x8 inside a cgroup-v1 memory cgroup "
                  f"(memory.limit_in_bytes {r['cap_bytes']:,}), its shards evicted from the page cache first: {what}."]
    lines += ["", "## Runs", "", "| shape | mode | round | tok/s | peak RSS MiB | wall s |", "|---|---|---:|---:|---:|---:|"]
    for name, e in p["shapes"].items():
        for m, x in e.get("modes", {}).items():
            for i, r in enumerate(x["runs"]):
                tok = "FAILED" if "error" in r else f"{r['tok_s']:.1f}"
                lines.append(f"| {name} | {m} | {i + 1} | {tok} | {r['peak_rss'] / 2**20:,.0f} | {r['wall_s']} |")
    return "\n".join(lines) + "\n"
