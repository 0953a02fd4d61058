"""What computing the LM head only at labelled positions saves, on the demo's own data.

The bundle's training graph gathers the positions whose (shifted) label is not -100 before the LM head,
so a step pays the 262k-vocabulary head (~0.67 GFLOP per position for Gemma3-270M, forward plus the
activation gradient) only where there is loss. A graph that runs the head at every position does the
same work as this graph does when every real position is labelled. So the ablation runs, on the same
session, the same weights and the same micro-batches, alternating A B A B:
  A  forward + backward with the data's labels (answer tokens of the Q&A; every token of the replay);
  B  the same micro-batch with every non-padding position labelled (= the head at all positions).
No optimizer step is taken (the gradients are reset), so every measurement sees identical weights.

    python -m bench.label_positions --workdir pocketlora-demo [--batches 12] [--threads 2]

--workdir is a `pocketlora demo` work directory (its bundle/ and device/train.jsonl are used).
The run goes to docs/bench/runs/<date>-label-positions.md, its raw results beside it (.json); --no-doc prints
the report instead. --rerender rewrites a run's report from its JSON (--run, default the newest).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from bench import runs
from bench.common import RUNS, machine, utc_now

WHAT = "label-positions"         # run files: docs/bench/runs/<date>-label-positions.{md,json}
TITLE = "LM head only at labelled positions"
COMMAND = "python -m bench.label_positions --workdir DIR"


def all_positions_labelled(mb: dict) -> dict:
    import numpy as np

    labels = np.where(mb["attention_mask"] == 1, mb["input_ids"], -100).astype(np.int64)
    return {**mb, "labels": labels}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", type=Path, help="a `pocketlora demo` work directory (required)")
    ap.add_argument("--batches", type=int, default=12, help="micro-batches measured (each A and B; default 12)")
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-doc", action="store_true", help="print the report; write no run file")
    ap.add_argument("--rerender", action="store_true", help="rewrite a run's report from its JSON")
    ap.add_argument("--run", type=Path, help="with --rerender: the run's JSON (default: the newest in docs/bench/runs/)")
    args = ap.parse_args(argv)
    if args.rerender:
        runs.rerender(WHAT, render_report, args.run)
        return 0

    from ort_trainer.bundle import open_bundle
    from ort_trainer.tokenizer import TextTokenizer
    from ort_trainer.records import load_examples, loss_token_count
    from ort_trainer.batching import collate, DataOrder
    from ort_trainer.session import RuntimeOptions, TrainSession

    if args.workdir is None:
        ap.error("--workdir is required")
    bundle_dir, data = args.workdir / "bundle", args.workdir / "device" / "train.jsonl"
    for p in (bundle_dir, data):
        if not p.exists():
            ap.error(f"{p} is missing: --workdir must be a directory `pocketlora demo --workdir DIR` has filled")
    bundle = open_bundle(bundle_dir, verify="sizes")
    tok = TextTokenizer.from_dir(bundle.tokenizer_dir)
    examples, _ = load_examples(data, tok, bundle.manifest.seq_len)
    order = DataOrder(len(examples), 0, args.micro_batch)
    session = TrainSession(bundle, options=RuntimeOptions(threads=args.threads))

    def timed(mb):
        n = loss_token_count(mb["labels"])
        t0 = time.perf_counter()
        session.forward_backward(mb, 1.0 / n)
        s = time.perf_counter() - t0
        session.drop_grads()
        return s, n

    import os

    load_start = os.getloadavg()[0]
    rows = []
    warm = collate([examples[i] for i in order.next_batch()[0]], tok.pad_id)
    timed(warm), timed(all_positions_labelled(warm))          # warm-up, both label patterns
    for k in range(args.batches):
        mb = collate([examples[i] for i in order.next_batch()[0]], tok.pad_id)
        (a_s, a_n), (b_s, b_n) = timed(mb), timed(all_positions_labelled(mb))
        rows.append({"shape": list(mb["input_ids"].shape), "labelled": a_n, "all": b_n, "a_s": a_s, "b_s": b_s})
        print(f"micro-batch {k + 1}: {mb['input_ids'].shape}, labelled {a_n} of {b_n}: "
              f"{a_s:.2f} s vs all positions {b_s:.2f} s", flush=True)

    med_a, med_b = statistics.median(r["a_s"] for r in rows), statistics.median(r["b_s"] for r in rows)
    ratios = [r["b_s"] / r["a_s"] for r in rows]
    result = {"date": utc_now(), "command": COMMAND, "machine": machine(),
              "model": bundle.manifest.model.source, "workdir": str(args.workdir), "threads": args.threads,
              "micro_batch": args.micro_batch, "load1": [load_start, os.getloadavg()[0]], "rows": rows, "median_labelled_s": med_a, "median_all_s": med_b,
              "median_ratio": statistics.median(ratios), "labelled_fraction":
              sum(r["labelled"] for r in rows) / sum(r["all"] for r in rows)}
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=1))
    run = runs.stem(result["date"], WHAT)
    if args.no_doc:
        print(render_report(result, run))
    else:
        print("wrote " + ", ".join(map(str, runs.write(RUNS, run, render_report(result, run), result))))
    return 0


def render_report(r: dict, run: str) -> str:
    """The Markdown of the run named `run` (its stem), from its results JSON `r`."""
    command = r.get("command", "python bench/label_positions.py --workdir DIR")    # runs before 2026-12-04
    lines = [*runs.header(TITLE, run, "bench/label_positions.py", r["machine"], command, {"raw results": f"{run}.json"}),
             f"Measured {r['date']} on {r['machine'].get('cpu_model', 'this machine')}, {r['threads']} threads: "
             f"`{command}` on the data of a `pocketlora demo` run "
             f"({r['model']}, micro-batches of {r['micro_batch']} in the demo's data order). Forward + backward "
             "of one micro-batch, the same session and weights, alternating: A with the data's labels (the graph "
             "runs the LM head at those positions only), B with every real position labelled (the work of a "
             "graph that runs the head everywhere).", "",
             "| micro-batch | labelled / real positions | A: labelled only (s) | B: all positions (s) | B / A |",
             "|---|---:|---:|---:|---:|"]
    for r_ in r["rows"]:
        lines.append(f"| {r_['shape'][0]} x {r_['shape'][1]} | {r_['labelled']} / {r_['all']} | {r_['a_s']:.2f} | "
                     f"{r_['b_s']:.2f} | {r_['b_s'] / r_['a_s']:.2f} |")
    lines += ["", f"Median: {r['median_labelled_s']:.2f} s (labelled only) vs {r['median_all_s']:.2f} s (all "
              f"positions); median ratio {r['median_ratio']:.2f}x. {100 * r['labelled_fraction']:.0f}% of the real "
              "positions carry a label in these micro-batches. Load average (1 min) at start / end: "
              f"{r['load1'][0]:.1f} / {r['load1'][1]:.1f} on {r['machine']['nproc']} cores"
              + (" (above the core count: other jobs shared the machine; the absolute times are inflated, the "
                 "alternating ratio much less)." if max(r["load1"]) > r["machine"]["nproc"] + 0.5 else "."), ""]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
