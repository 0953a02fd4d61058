"""The report of a bench.dequant_kernels run, from its JSON alone (so any run re-renders to the same bytes)."""
from __future__ import annotations

from bench import runs

TITLE = "Dequantization kernels of ORT's CPU provider"


def render_report(p: dict, run: str) -> str:
    n, k = p["shape"]
    lines = runs.header(TITLE, run, "bench/dequant_kernels.py", p["machine"], p["command"], {"raw results": f"{run}.json"})
    lines += [
        f"onnxruntime {p['onnxruntime']}. One [{n:,}, {k:,}] weight (Qwen2.5-0.5B's gate/up projections, random "
        f"codes; blocks of {p['block']} along its {k} inputs) dequantized to float32, gated on a small input so that "
        "it runs on every call as in the bundles. Kernel time of the dequantizing nodes alone (ORT's profiler; not the "
        "gate, whose Reshape hands on the scales or, for the Cast and uint8 forms, the codes), median "
        f"over {p['reps']} calls, per weight element. A ratio near 1.0 between 1 and 2 threads: the kernel runs on "
        "one thread.",
        "",
        "| form | ns / element, 1 thread | 2 threads | 1 / 2 threads | what |",
        "|---|---:|---:|---:|---|",
    ]
    for name, f in p["forms"].items():
        one, two = f["ns_per_element"]["1"], f["ns_per_element"]["2"]
        lines.append(f"| {name} | {one:.2f} | {two:.2f} | {one / two:.2f}x | {f['what']} |")
    return "\n".join(lines) + "\n"
