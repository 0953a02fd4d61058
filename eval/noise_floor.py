"""The float-rounding noise floor of a parity run: ORT against ORT, the same math in a different order.

A parity report compares ORT's loss curve with PyTorch's. Two float32 implementations of the same
step differ in rounding (summation order, fused kernels), and training amplifies any difference step by
step. To tell amplified rounding from a real discrepancy, train ORT a second time with the same
examples per step, the same schedule and the same seed, but split into micro-batches differently (e.g.
8 x 1 instead of 4 x 2: identical gradients in exact arithmetic, since every step's loss is scaled by
1 / the step's labelled tokens). Its divergence from the first ORT run is the noise floor: if ORT vs
PyTorch stays within it, the gap is rounding, not an error.

    python -m eval.noise_floor --report REPORT_DIR --run SECOND_ORT_RUN [--plot PNG]

SECOND_ORT_RUN is a `pocketlora train` run directory with the same --max-steps, lr, schedule, seed and
data as the report's ORT run (it may be stopped early: the common steps are compared).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from .parity import ORT_RUN, TORCH_RESULT, TORCH_RUN, read_metrics
from .parity_checks import rel_diffs


def noise_floor(report_dir: str | Path, second_run: str | Path) -> dict:
    report_dir, second_run = Path(report_dir), Path(second_run)
    first_cfg = json.loads((report_dir / ORT_RUN / "run.json").read_text())
    second_cfg = json.loads((second_run / "run.json").read_text())
    same = ("data", "max_steps", "lr", "warmup", "schedule", "clip", "weight_decay", "seed")
    for c in (first_cfg, second_cfg):    # recorded as given on the command line: compare the files
        c["data"] = str(Path(c["data"]).resolve())
    if diff := [k for k in same if first_cfg.get(k) != second_cfg.get(k)]:
        raise ValueError(f"{second_run}: not the same training as {report_dir / ORT_RUN} "
                         f"({', '.join(f'{k}: {first_cfg.get(k)!r} vs {second_cfg.get(k)!r}' for k in diff)})")
    if first_cfg["micro_batch"] * first_cfg["accum"] != second_cfg["micro_batch"] * second_cfg["accum"]:
        raise ValueError("the two ORT runs must have the same examples per step (micro-batch x accum)")
    ort = [float(m["loss"]) for m in read_metrics(report_dir / ORT_RUN)]
    ort2 = [float(m["loss"]) for m in read_metrics(second_run)]
    torch = [float(x) for x in json.loads((report_dir / TORCH_RUN / TORCH_RESULT).read_text())["losses"]]
    n = min(len(ort), len(ort2), len(torch))
    vs_torch, vs_ort = rel_diffs(ort[:n], torch[:n]), rel_diffs(ort2[:n], ort[:n])
    split = lambda c: f"{c['micro_batch']}x{c['accum']}"  # noqa: E731
    return {"steps": n, "first": split(first_cfg), "second": split(second_cfg),
            "ort_vs_torch": vs_torch.tolist(), "ort_vs_ort": vs_ort.tolist(),
            "max_ort_vs_torch": float(vs_torch.max()), "max_ort_vs_ort": float(vs_ort.max()),
            "mean_ort_vs_torch": float(vs_torch.mean()), "mean_ort_vs_ort": float(vs_ort.mean())}


def plot(result: dict, path: str | Path) -> Path:
    from .report import _plt, save_line_plot

    plt = _plt()
    steps = np.arange(1, result["steps"] + 1)
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.semilogy(steps, np.maximum(result["ort_vs_torch"], 1e-12), marker=".", lw=1,
                label=f"ORT {result['first']} vs PyTorch")
    ax.semilogy(steps, np.maximum(result["ort_vs_ort"], 1e-12), marker=".", lw=1,
                label=f"ORT {result['second']} vs ORT {result['first']} (same math)")
    return save_line_plot(plt, fig, ax, path, "Loss divergence against the float-rounding noise floor",
                          "relative loss difference", grid_which="both")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--report", required=True, help="an `eval parity` report directory")
    ap.add_argument("--run", required=True, help="a second ORT run of the same training, split differently")
    ap.add_argument("--plot", help="write the two divergence curves to this PNG")
    ap.add_argument("--json", help="write the result to this JSON file")
    args = ap.parse_args(argv)
    r = noise_floor(args.report, args.run)
    print(f"steps 1-{r['steps']}: ORT {r['first']} vs PyTorch max {r['max_ort_vs_torch']:.3g} "
          f"(mean {r['mean_ort_vs_torch']:.3g}); ORT {r['second']} vs ORT {r['first']} max {r['max_ort_vs_ort']:.3g} "
          f"(mean {r['mean_ort_vs_ort']:.3g})")
    if args.plot:
        print(f"plot: {plot(r, args.plot)}")
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
