"""The report of a bench.quant_quality run, from its JSON alone (so any run re-renders to the same bytes)."""
from __future__ import annotations

from bench import runs

TITLE = "Quantized base quality: real Gemma3-270M"


def _ppl(r: dict | None) -> str:
    if not r:
        return "—"
    return "FAILED" if "error" in r else f"{r['ppl']:.4f}"


def _recorded(modes: dict) -> bool:
    """Runs since 2026-12-07T09 record each mode's gen flags and calibration (int4's default changed then)."""
    return any("gen_flags" in e for e in modes.values())


def render_report(p: dict, run: str) -> str:
    lines = runs.header(TITLE, run, "bench/quant_quality.py", p["machine"], p["command"], {"raw results": f"{run}.json"})
    modes = p["modes"]
    base = modes.get("none", {}).get("ppl_ort", {}).get("ppl")
    lines += [
        f"`{p['model']}` built once per mode (`pocketlora gen --quant MODE --seq-len 128`), its base model scored with "
        f"no LoRA: perplexity on the first {p['ppl_tokens']:,} tokens of WikiText-2 test (`--bos-per-window`, "
        f"windows of 128), MMLU 5-shot on the val split, the first {p['mmlu_limit']} questions of each subject. "
        "none = gguf-py's dequantized weights in float32 (the reference); int8 / int4 requantize them " + (
            "(the modes' gen flags and codes are listed below); " if _recorded(modes) else
            "(int4-calib: int4's codes chosen by GPTQ on WikiText-2 train, `--quant-calib`); ") +
        "keep = the GGUF's own blocks.",
        "",
        "| mode | weights GB | ppl (ORT) | vs none | goal | ppl (PyTorch, same weights) | ORT vs PyTorch | MMLU micro "
        "(ORT) | questions |",
        "|---|---:|---:|---:|---|---:|---:|---:|---:|",
    ]
    for mode, e in modes.items():
        if "error" in e:
            lines.append(f"| {mode} | gen FAILED: {e['error'].splitlines()[-1][:160]} ||||||||")
            continue
        o, t, m = e.get("ppl_ort"), e.get("ppl_torch"), e.get("mmlu_ort") or {}
        rel = (o["ppl"] / base - 1) if base and o and "ppl" in o else None
        goal = p["goals"].get(mode)
        verdict = "" if goal is None or rel is None else f"<= +{goal:.0%}: {'met' if rel <= goal else 'MISSED'}"
        both = (abs(o["ppl"] - t["ppl"]) / t["ppl"]) if o and t and "ppl" in o and "ppl" in t else None
        lines.append(
            f"| {mode} | {e['weight_bytes'] / 1e9:.3f} | {_ppl(o)} | {'—' if rel is None else f'{rel:+.2%}'} | "
            f"{verdict} | {_ppl(t)} | {'—' if both is None else f'{both:.1e}'} | "
            f"{'—' if 'micro' not in m else format(m['micro'], '.2%')} | "
            f"{m.get('n', '—')} |")
    if _recorded(modes):
        lines += [""] + [f"- {mode}: `{' '.join(e['gen_flags'])}`" + (f"; {e['calibration']}" if e.get("calibration")
                                                                     else "") for mode, e in modes.items() if "gen_flags" in e]
    lines += ["", "Random-weight shapes say nothing about quality; this model is the only real pretrained one here. "
              "At 270M parameters MMLU sits near chance (25%), so its differences are noise; perplexity is the "
              "measure."]
    return "\n".join(lines) + "\n"
