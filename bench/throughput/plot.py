"""The plot of a run: tokens/s per shape, workload and configuration (median, min-max), and peak RSS against the
targets. Drawn from the run's JSON, as the report is."""
from __future__ import annotations

from pathlib import Path

from bench.throughput.config import LOWMEM_SHAPE, TARGET_RSS
from bench.throughput.verdicts import best_key


def make_plot(p: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = [r for r in p["results"] if r.get("ok")]
    if not res:
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 5))
    colors = {"ort-8x1": "#4c72b0", "ort-best": "#55a868", "torch-8x1": "#c44e52"}
    best_label = "ort-fit (--memory-budget = target)" if any(r.get("memory_fit") for r in res) else "ort-best"
    labels = [f"{r['shape']}\n{r['workload']}" for r in res]
    width = 0.27
    for j, kind in enumerate(("ort-8x1", "ort-best", "torch-8x1")):
        xs, ys, lo, hi, names = [], [], [], [], []
        for i, r in enumerate(res):
            key = best_key(r) if kind == "ort-best" else next((k for k in r["configs"] if k.startswith(kind)), None)
            c = r["configs"].get(key, {})
            if c.get("ok"):
                t = c["tokens_per_s"]
                xs.append(i + (j - 1) * width)
                ys.append(t["median"])
                lo.append(t["median"] - t["min"])
                hi.append(t["max"] - t["median"])
                names.append(key.replace("ort-best-", "").replace("ort-fit-", "").replace("ort-", ""))
        bars = ax1.bar(xs, ys, width, yerr=[lo, hi], capsize=3, color=colors[kind],
                       label=best_label if kind == "ort-best" else kind)
        if kind == "ort-best":
            for b, nm in zip(bars, names):
                ax1.text(b.get_x() + b.get_width() / 2, b.get_height() * 0.02, nm, ha="center", va="bottom",
                         fontsize=7, rotation=90, color="white")
    ax1.set_xticks(range(len(res)), labels, fontsize=8)
    ax1.set_ylabel("real tokens / s (median, min-max)")
    ax1.set_title("Training throughput, effective batch 8, 2 threads")
    ax1.legend(fontsize=8)
    shapes = list(dict.fromkeys(r["shape"] for r in res))
    for j, kind in enumerate(("ort-8x1", "ort-best", "torch-8x1")):
        ys = []
        for sh in shapes:
            vals = [c["peak_rss"] for r in res if r["shape"] == sh for k, c in r["configs"].items()
                    if (k == best_key(r) if kind == "ort-best" else k.startswith(kind)) and c.get("ok")]
            ys.append(max(vals) / 2**30 if vals else 0)
        ax2.bar([i + (j - 1) * width for i in range(len(shapes))], ys, width, color=colors[kind],
                label=best_label if kind == "ort-best" else kind)
    for i, sh in enumerate(shapes):
        if sh in TARGET_RSS and not p["quick"]:
            ax2.hlines(TARGET_RSS[sh] / 2**30, i - 0.45, i + 0.45, colors="k", linestyles="dashed")
    lmres = p.get("lowmem")
    if lmres and lmres["low"]["completed"] and LOWMEM_SHAPE in shapes:
        i = shapes.index(LOWMEM_SHAPE)
        ax2.plot([i + 1.5 * width], [lmres["low"]["peak_rss"] / 2**30], "D", color="#8172b2", label="ort low-mem 1x8")
    ax2.set_xticks(range(len(shapes)), shapes, fontsize=8)
    ax2.set_ylabel("peak RSS, GiB (max over workloads; dashed: target)")
    ax2.set_title("Peak RSS")
    ax2.legend(fontsize=8)
    fig.suptitle(f"bench/train_throughput.py, {p['date']}" + (" (QUICK: tiny configs)" if p["quick"] else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
