"""Generation with the bundle's KV-cache decoder (issue 30) against transformers generate(), side by side.

Per shape (random weights, the real config from ../shared/data/configs; LoRA r=8, alpha=16 on the attention
projections, with random non-zero values) the same prompt of PROMPT_LEN random tokens is greedy-decoded to NEW new
tokens by ours (`ort_trainer.decoder`, the fp32 bundle and its int4 variant) and by transformers' generate() on the
PEFT-wrapped checkpoint (its defaults: SDPA attention, a DynamicCache), each run a process of its own with 2
threads, ROUNDS rounds alternating. Reported per side: decode tok/s (the median over rounds; the goal is >= 1.5x
transformers), prefill tok/s and time to first token, peak RSS (VmHWM), load time, and for ours the adapter
switch time and the decoder graph's size beside the bundle's weights.

The anchor: the real Gemma3-270M, its default bundle (`--quant keep`, the GGUF's own blocks) against llama.cpp
(llama-cpp-python, built from source: `pip install llama-cpp-python`) on the same GGUF file, and transformers on its
dequantized weights; llama.cpp runs without an adapter (ours and transformers carry a live LoRA). On a CPU with AMX
(Sapphire Rapids and later) the default native build repacks the weights for ggml's AMX backend, which segfaults in
its first matmul (llama.cpp issue 20824; here on Intel Xeon 6-167-1); build without it:

    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
      -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF \
      -DGGML_AMX_BF16=OFF" pip install --no-cache-dir -e ".[llama]"

    python -m bench.decode [--shapes gemma3-270m,qwen2.5-0.5b] [--rounds 3] [--new 128] [--prompt-len 128]
                           [--quick] [--no-doc]
    python -m bench.decode --rerender [--run JSON]

The run is written whole as docs/bench/runs/<date>-decode.{md,json} (bench/runs.py).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from bench import runs
from bench.children import THREADS, run_child
from bench.common import SPEED_INT4_CODES, log
from bench.decode_render import REAL, REAL_SIDES, SIDES, render_report
from bench.throughput.phases import setup_shape
from bench.web_vs_native import _weight_bytes, variant_bundle

WHAT = "decode"
SHAPES = ("gemma3-270m", "qwen2.5-0.5b")
TARGET_RATIO = 1.5
TIMEOUT_S = 1800


def _has_decoder(bundle: Path) -> bool:
    """False for a missing bundle or one cached from before the decoder existed."""
    manifest = bundle / "manifest.json"
    return manifest.is_file() and bool(json.loads(manifest.read_text()).get("decoder", {}).get("file"))


def _bundles(name: str, sub: Path, quick: bool) -> dict:
    """Each side's bundle; "bundle": the one whose manifest (LoRA config) the torch side follows."""
    setup = setup_shape(name, sub, quick)
    if setup.get("ok") is False:
        return {"error": setup["error"]}
    fp32 = Path(setup["bundle"])
    if not _has_decoder(fp32):
        fp32 = variant_bundle(name, sub, "decoder", [])
    return {"ckpt": str(sub / f"{name}-ckpt"), "bundle": str(fp32), "ours-fp32": str(fp32),
            "ours-int4": str(variant_bundle(name, sub, "int4", ["--quant", "int4", *SPEED_INT4_CODES]))}


def _real_bundle(sub: Path) -> dict:
    """The real Gemma3-270M: its GGUF, and the default bundle of it (`gen`, --quant keep), cached in the workdir."""
    from artifacts_gen.source import EMBEDDED_DEFAULT, resolve_embedded

    directory, name = resolve_embedded(EMBEDDED_DEFAULT)
    out = sub / "gemma3-270m-real-bundle"
    if not _has_decoder(out):
        c = run_child(["pocketlora_cli", "gen", "--model", EMBEDDED_DEFAULT, "--out", str(out), "--force",
                       "--lora-r", "8", "--lora-alpha", "16", "--targets", "attn", "--seq-len", "128"],
                      sub / "gemma3-270m-real-gen.log", TIMEOUT_S)
        if c.code != 0:
            return {"error": c.failure()}
    return {"ckpt": str(directory), "gguf_file": name, "gguf": str(Path(directory) / name), "ours-keep": str(out),
            "bundle": str(out)}


def _quantized_matmul(bundle: Path) -> str:
    """How the quantized bundle's decoder multiplies by its weights: MatMulNBits (artifacts_gen/nbits.py, since
    2026-12-06) or a DequantizeLinear per weight and token (before)."""
    import onnx

    ops = {n.op_type for n in onnx.load(str(bundle / "decoder_model.onnx"), load_external_data=False).graph.node}
    return "MatMulNBits" if "MatMulNBits" in ops else "DequantizeLinear"


def _run(side: str, b: dict, spec: dict, log_path: Path) -> dict:
    kind = "torch" if side == "torch" else "llama" if side == "llama.cpp" else "ours"
    spec = {**spec, "bundle": b[side] if kind == "ours" else b["bundle"], "ckpt": b["ckpt"],
            "gguf_file": b.get("gguf_file"), "gguf": b.get("gguf")}
    c = run_child(["bench.decode_worker", kind, json.dumps(spec)], log_path, TIMEOUT_S)
    if not c.ok:
        return {"error": c.failure()}
    return {**c.result, "peak_rss": c.peak_rss()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new", type=int, default=128, help="new tokens per run (default 128)")
    ap.add_argument("--prompt-len", type=int, default=128, help="prompt tokens (default 128)")
    ap.add_argument("--quick", action="store_true", help="tiny configs, 1 round, 16 tokens: a smoke test")
    ap.add_argument("--no-anchor", action="store_true", help="skip the real Gemma3-270M GGUF against llama.cpp")
    args = runs.parse(ap, argv, WHAT, render_report)
    if args is None:
        return 0
    if args.quick:
        args.rounds, args.new, args.prompt_len = 1, 16, 16
    sub = args.workdir / ("decode-quick" if args.quick else "decode")
    sub.mkdir(parents=True, exist_ok=True)
    payload = {**runs.start(WHAT, "bench.decode", argv), "rounds": args.rounds, "new": args.new,
               "prompt_len": args.prompt_len, "threads": THREADS, "target_ratio": TARGET_RATIO, "shapes": {}}
    spec = {"new": args.new, "prompt_len": args.prompt_len, "threads": THREADS}
    shapes = [s for s in args.shapes.split(",") if s] + ([] if args.quick or args.no_anchor else [REAL])
    for name in shapes:
        log(f"{name}: bundles")
        b = _real_bundle(sub) if name == REAL else _bundles(name, sub, args.quick)
        if "error" in b:
            payload["shapes"][name] = b
            continue
        ours = Path(b["bundle"])
        sides = REAL_SIDES if name == REAL else SIDES
        entry = {"weight_bytes": _weight_bytes(ours), "decoder_bytes": (ours / "decoder_model.onnx").stat().st_size,
                 "quantized_matmul": _quantized_matmul(Path(b["ours-keep" if name == REAL else "ours-int4"])),
                 "sides": {s: {"runs": []} for s in sides}}
        for r in range(args.rounds):
            for side in sides:
                rec = _run(side, b, spec, sub / f"{name}-{side}-r{r}.log")
                entry["sides"][side]["runs"].append(rec)
                log(f"   {name} {side} round {r + 1}: " + (
                    f"decode {rec['decode_tok_s']:.1f} tok/s, ttft {rec['ttft_s'] * 1e3:.0f} ms, peak RSS "
                    f"{rec['peak_rss'] / 2**20:,.0f} MiB" if "error" not in rec else f"FAILED: {rec['error'][-200:]}"))
        for e in entry["sides"].values():
            ok = [x for x in e["runs"] if "error" not in x]
            for key in ("decode_tok_s", "prefill_tok_s", "ttft_s", "load_s", "switch_s"):
                vals = [x[key] for x in ok if x.get(key) is not None]
                e[key] = statistics.median(vals) if vals else None
            e["peak_rss_max"] = max((x["peak_rss"] for x in ok), default=None)
        payload["shapes"][name] = entry
    runs.finish(payload, WHAT, render_report, sub, args.quick, args.no_doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
