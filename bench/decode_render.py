"""The report of a bench.decode run, from its JSON alone (so any run re-renders to the same bytes)."""
from __future__ import annotations

from bench import runs

SIDES = ("ours-fp32", "ours-int4", "torch")
REAL = "gemma3-270m (real GGUF)"
REAL_SIDES = ("ours-keep", "llama.cpp", "torch")
TITLE = "KV-cache decoding: the bundle's decoder vs transformers generate()"


def _f(x, fmt: str, scale: float = 1.0) -> str:
    return "—" if x is None else format(x * scale, fmt)


def _nbits(p: dict) -> bool:
    return any(e.get("quantized_matmul") == "MatMulNBits" for e in p["shapes"].values())


def render_report(p: dict, run: str) -> str:
    lines = runs.header(TITLE, run, "bench/decode.py", p["machine"], p["command"], {"raw results": f"{run}.json"})
    lines += [
        f"Greedy decoding of {p['new']} new tokens after a prompt of {p['prompt_len']} random tokens, batch 1, "
        f"{p['threads']} threads, one process per run, {p['rounds']} rounds alternating. Random weights with the real "
        "configs; LoRA r=8 on attn with non-zero values (live, not merged). ours: `ort_trainer.decoder` on the "
        "bundle's decoder graph (fp32, and the `--quant int4` bundle); torch: transformers `generate()` on the "
        "PEFT-wrapped checkpoint with its defaults (SDPA, DynamicCache). Medians over rounds; peak RSS: VmHWM, the "
        "largest over rounds. Decode tok/s counts the tokens after the first over the time after it; time to first "
        "token is the prefill and the first pick.",
        *([] if not _nbits(p) else [
            "", "The quantized bundles' decoders multiply by the codes with ORT's MatMulNBits (artifacts_gen/nbits.py: "
            "uint4 codes as stored, 8-bit codes as two nibbles against an interleaved activation, float32 "
            "accumulation), never dequantizing a weight."]),
        *(["", f"The {REAL} row: the real Gemma3-270M Q4_K_M GGUF. ours-keep: its `pocketlora gen` default bundle "
           "(`--quant keep`, the GGUF's blocks" + (" multiplied by MatMulNBits" if _nbits(p) else
                                                  " dequantized per token by ORT 1.19's DequantizeLinear") +
           "); llama.cpp: "
           "llama-cpp-python on the GGUF itself (its own Q4_K / Q5_0 / Q6_K / Q8_0 kernels, no adapter); torch: "
           "transformers on the GGUF's weights dequantized to float32, with the adapter."] if REAL in p["shapes"] else []),
        "",
        "| shape | side | decode tok/s | vs torch | goal >= "
        f"{p['target_ratio']}x | prefill tok/s | TTFT ms | peak RSS MiB | load s | adapter switch ms |",
        "|---|---|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    targets = []
    for name, e in p["shapes"].items():
        if "error" in e:
            lines.append(f"| {name} | setup FAILED: {e['error'].splitlines()[-1][:160]} |||||||||")
            continue
        ref = e["sides"]["torch"]["decode_tok_s"]
        for side, x in e["sides"].items():
            tok = x["decode_tok_s"]
            ratio = tok / ref if tok and ref else None
            verdict = "" if side in ("torch", "llama.cpp") or ratio is None else (
                "met" if ratio >= p["target_ratio"] else "MISSED")
            if verdict:
                targets.append(f"- {'MET' if verdict == 'met' else '**MISSED**'}: {name} {side} decode "
                               f"{tok:.1f} tok/s = {ratio:.2f}x transformers ({ref:.1f}); goal >= {p['target_ratio']}x")
            lines.append(f"| {name} | {side} | {_f(tok, '.1f')} | {_f(ratio, '.2f')}x | {verdict} | "
                         f"{_f(x['prefill_tok_s'], '.0f')} | {_f(x['ttft_s'], '.0f', 1e3)} | "
                         f"{_f(x['peak_rss_max'], ',.0f', 2**-20)} | {_f(x['load_s'], '.2f')} | "
                         f"{_f(x.get('switch_s'), '.2f', 1e3)} |")
        lines.append(f"| {name} | the decoder graph: {e['decoder_bytes'] / 2**20:.1f} MiB beside "
                     f"{e['weight_bytes'] / 2**30:.2f} GiB of shared weights |||||||||")
    real = p["shapes"].get(REAL, {}).get("sides", {})
    if real.get("llama.cpp", {}).get("decode_tok_s") and real.get("ours-keep", {}).get("decode_tok_s"):
        o, ll = real["ours-keep"], real["llama.cpp"]
        lines += ["", f"The anchor: on the same GGUF, ours decodes at {o['decode_tok_s'] / ll['decode_tok_s']:.2f}x "
                      f"llama.cpp's rate ({o['decode_tok_s']:.1f} vs {ll['decode_tok_s']:.1f} tok/s) and prefills at "
                      f"{o['prefill_tok_s'] / ll['prefill_tok_s']:.2f}x."]
    if targets:
        lines += ["", "## Targets", "", *targets]
    lines += ["", "## Runs", "", "| shape | side | round | decode tok/s | TTFT ms | peak RSS MiB |",
              "|---|---|---:|---:|---:|---:|"]
    for name, e in p["shapes"].items():
        for side, x in e.get("sides", {}).items():
            for i, r in enumerate(x["runs"]):
                if "error" in r:
                    lines.append(f"| {name} | {side} | {i + 1} | FAILED: {r['error'].splitlines()[-1][:120]} | | |")
                else:
                    lines.append(f"| {name} | {side} | {i + 1} | {r['decode_tok_s']:.1f} | {r['ttft_s'] * 1e3:.0f} | "
                                 f"{r['peak_rss'] / 2**20:,.0f} |")
    return "\n".join(lines) + "\n"
