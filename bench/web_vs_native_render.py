"""The report of a web-vs-native run (bench/web_vs_native.py), whole, from its results alone: header, the
side-by-side table with the goal's verdict, the exploration per shape, the heap run and what the columns mean."""
from __future__ import annotations

from bench import runs
from bench.common import mib

TITLE = "Phone runner (WASM) vs native device loop"
MFT = {"gpt2-124m": 28, "gemma3-270m": 39}      # MobileFineTuner's tok/s (arXiv 2512.08211), the anchor


def _label(r: dict) -> str:
    extra = [f"{r['threads']} thr"] + (["prepack"] if r.get("session") else []) + (
        [r["bundle"].split("@", 1)[1]] if "@" in r.get("bundle", "") else [])
    return f"{r['micro']}x{r['accum']}, {', '.join(extra)}"


def _tok(v) -> str:
    return "—" if v is None else f"{v:.1f}"


def _failure(r: dict) -> str:
    """The run's last log line; a bare number is what onnxruntime-web throws for a C++ exception in the WASM."""
    last = (r["error"].splitlines() or ["?"])[-1].replace("|", "/")[:160]
    return f"WASM threw C++ exception {last} (out of the 4 GiB heap)" if last.strip().isdigit() else last


def render_report(p: dict, run: str) -> str:
    lines = runs.header(TITLE, run, "bench/web_vs_native.py", p["machine"], p["command"], {"raw results": f"{run}.json"})
    lines += [
        f"Both runners train the same bundle on the same data with the same flags (`--threads {p['threads']}`, "
        f"`--battery none`), each run a process of its own: `pocketlora train` (ORT 1.19.2 native) and "
        "`node android_runner/web/cli.mjs train` (onnxruntime-web 1.19.2's WASM training build, SIMD + threads). "
        f"Random-weight models of real shapes, LoRA r={p['lora']['r']} on {p['lora']['targets']}, seq-len "
        f"{p['seq_len']}, effective batch 8, WikiText-2 in full 128-token blocks (1,024 tokens a step). tok/s: the "
        f"median over each run's {p['steps']} steps after its first (the runners' own step timing); peak RSS: the "
        "process's.",
        "",
        "## Side by side",
        "",
        f"{p['rounds']} rounds of native then WASM, each at its fastest setting from the exploration below; the ratio "
        "is of the medians over all rounds' steps. Goal: WASM >= "
        f"{p['target_ratio']}x native tok/s.",
        "",
        "| shape | native setting | native tok/s (range) | WASM setting | WASM tok/s (range) | WASM / native | goal "
        "| native peak RSS MiB | WASM peak RSS MiB | MobileFineTuner tok/s |",
        "|---|---|---:|---|---:|---:|---|---:|---:|---:|",
    ]
    for name, e in p["shapes"].items():
        if "error" in e:
            lines.append(f"| {name} | FAILED: {e['error'].splitlines()[-1]} |||||||||")
            continue
        s = e["side_by_side"]["summary"]
        n, w = s["native"], s["web"]
        rng = lambda d: "" if not d["tok_s_range"] else f" ({d['tok_s_range'][0]:.1f}-{d['tok_s_range'][1]:.1f})"
        ratio = s["ratio"]
        verdict = "—" if ratio is None else ("MET" if ratio >= p["target_ratio"] else "MISSED")
        lines.append(
            f"| {name} | {n['setting'].split(' ', 1)[1]} | {_tok(n['tok_s_median'])}{rng(n)} | "
            f"{w['setting'].split(' ', 1)[1]} | {_tok(w['tok_s_median'])}{rng(w)} | "
            f"{'—' if ratio is None else f'{ratio:.2f}x'} | {verdict} | "
            f"{mib(n['peak_rss_max']) if n['peak_rss_max'] else '—'} | "
            f"{mib(w['peak_rss_max']) if w['peak_rss_max'] else '—'} | {MFT.get(name, '—')} |")
    lines += ["", "## Exploration (one run per setting)", ""]
    for name, e in p["shapes"].items():
        if "explore" not in e:
            continue
        lines += [f"### {name} ({e['weight_bytes'] / 1e9:.2f} GB of fp32 frozen weights)", "",
                  "| runner | setting | tok/s | first step s | load s | peak RSS MiB |", "|---|---|---:|---:|---:|---:|"]
        for runner in ("native", "web"):
            for r in e["explore"][runner]:
                if "error" in r:
                    lines.append(f"| {runner} | {_label(r)} | FAILED (exit {r['exit']}): {_failure(r)} |||"
                                 f" {mib(r['peak_rss'])} |")
                else:
                    lines.append(f"| {runner} | {_label(r)} | {r['tok_s']:.1f} | {r['first_step_s']:.1f} | "
                                 f"{r['load_s']:.1f} | {mib(r['peak_rss'])} |")
        lines.append("")
    if "heap" in p:
        h = p["heap"]
        lines += ["## The 4 GiB WASM heap", ""]
        if "error" in h:
            lines.append(f"{h['shape']}: setup FAILED: {h['error'].splitlines()[-1]}")
        else:
            r = h["run"]
            what = (f"trained at 1x8: {r['tok_s']:.1f} tok/s, peak RSS {mib(r['peak_rss'])} MiB" if "error" not in r
                    else f"FAILED (exit {r['exit']}): {_failure(r)}")
            lines.append(f"{h['shape']} ({h['weight_bytes'] / 1e9:.2f} GB of fp32 frozen weights) in the WASM "
                         f"runner: {what}.")
        lines.append("")
    lines += [
        "## Columns",
        "",
        "- *setting*: micro-batch x accumulation, WASM threads; *prepack*: the frozen MatMul weights prepacked at "
        "session creation (the runner's default is off: the copies do not fit the heap at Gemma3-270M); "
        "*colsN*: a bundle built with `--head-vocab-cols N` (the LM head's vocabulary slice; default 16384).",
        "- *load s*: the run's wall time minus its steps (process start, bundle and session load, data, the final "
        "checkpoint).",
        "- MobileFineTuner: the C++ trainer of arXiv 2512.08211 as that issue quotes it, not run here.",
    ]
    return "\n".join(lines) + "\n"
