"""The report's section "FLOPs and GEMM throughput": how a step's FLOPs are counted, how the GEMM reference was
measured (as the run's JSON says), the reference's rates per matmul shape, and each step's FLOPs and rates."""
from __future__ import annotations

from bench.throughput.config import GEMM_LIBS
from bench.throughput.flops import combined_gemm, gemm_libs


def render_flops(p: dict) -> list[str]:
    padding_free = any(r.get("ort_padding_free") for r in p["results"])
    interleaved = p.get("gemm_mode") == "interleaved"       # the reference sampled inside the lockstep
    lines = ["## FLOPs and GEMM throughput", "",
             "FLOPs of one step are counted as the matmuls execute them (padding positions included, " +
             ("where they are computed: by PyTorch everywhere, by ORT's padding-free graph in attention only"
              if padding_free else "they are computed") + "): forward = 2 x (frozen linear params of the body) x positions + LoRA 2·r·(in+out) per "
             "adapted linear per position + attention scores 4·B·L²·heads·head_dim per layer + LM head 2·H·V per "
             "head position (ORT: labelled positions only; PyTorch: all positions); backward = activation gradients "
             "of the frozen linears and the head (same as their forward) + 2x attention + 2x LoRA (activation and "
             "weight gradients); no weight gradients for frozen weights. "
             "The embedding lookup, norms, softmax, AdamW etc. are not counted.", "",
             *(_gemm_description_interleaved(p) if interleaved else _gemm_description_before(p))]
    for name in p["gemm"]:
        for x in combined_gemm(p, name):
            asrun = (" | ".join(" / ".join(f"{x[f'asrun_{d}_{lib}']:.1f}" for lib in gemm_libs([x]))
                                for d in ("fwd", "bwd"))
                     if "asrun_fwd_ort" in x else "- | -")
            last = (f"{x['n_samples']}" if interleaved
                    else f"{x['numpy_gflops_median']:.1f} / {x['ort_gflops_median']:.1f}")
            lines.append(f"| {name} | {x['m']} | {x['k']} x {x['n']}{' (transB)' if x['trans_b'] else ''} | "
                         f"{x.get('cold_copies', '-')} | {asrun} | {last} |")
    by_lib = any("gemm_reference_by_lib" in c for r in p["results"] if r.get("ok") for c in r["configs"].values())
    lines += ["", "| shape | workload | config | GFLOP/step (body / LoRA / attention / head) | padded positions | "
              "labelled | achieved GFLOP/s | GEMM-weighted reference GFLOP/s: as run"
              + ("" if interleaved else " (warm, prepacked)") + " |"
              + (" the same on one kernel: numpy / torch / ORT | % of its own kernel (ORT; torch.mm) | ORT/PyTorch tok/s at "
                 "100% of ORT's kernel |" if by_lib else ""),
              "|---|---|---|---|---:|---:|---:|---:|" + ("---:|---:|---:|" if by_lib else "")]
    for r in p["results"]:
        if not r.get("ok"):
            continue
        for key, c in r["configs"].items():
            if c.get("ok"):
                b = c["gflop_breakdown"]
                lines.append(f"| {r['shape']} | {r['workload']} | {key} | {c['gflop_per_step']:.0f} ({b['body']:.0f} / "
                             f"{b['lora']:.1f} / {b['attn']:.1f} / {b['head']:.0f}) | {c['padded_positions_per_step']:.0f} | "
                             f"{c['label_tokens_per_step']:.0f} | {c['achieved_gflops']['median']:.1f} | "
                             f"{(c['gemm_reference_gflops'] or float('nan')):.1f}"
                             + (f" ({c['gemm_reference_warm_gflops']:.1f})"
                                if c.get("gemm_reference_warm_gflops") else "")
                             + " |" + (_by_lib_cells(c, _torch_step(r)) if by_lib else ""))
    return lines


def _gemm_description_before(p: dict) -> list[str]:
    """Runs without `gemm_mode` (before 2026-12-01 03:10 UTC): the reference measured before each lockstep."""
    return ["GEMM reference (measured in the same run, per shape just before its lockstep, 2 threads, float32, "
            "median of repeats): the step's own frozen-weight matmuls at M = 128 and 1024 rows, on numpy "
            "(OpenBLAS) and on ORT (MatMul; Gemm transB for the LM head, one vocabulary slice of the [V, H] weight "
            "as the training graph runs it), measured two ways:", "",
            "- **as run** (the reference of the target): the forward product x·W and the backward one dY·Wᵀ "
            "(the head: dZ·W), each half of the matmul's FLOPs, as the training session issues them: ORT with "
            "prepacking disabled, because ORT's training API refuses it (`Module` sets "
            "`session.disable_prepacking=1` and fails if asked otherwise: \"Prepacking is not supported for "
            "training scenarios\"), and each call on another copy of the weight, copies over >= 64 MiB (twice "
            "the L3), so the weight is read from memory as in a pass over the model, not from the 32 MiB L3.",
            "- **warm, prepacked** (in parentheses): x·W only, repeated on one weight (in L3 when it fits), ORT "
            "with the weight prepacked. An upper bound the training session cannot reach; it was the only "
            "reference before 2026-12-01.", "",
            "The \"% of GEMM\" column divides a step's achieved GFLOP/s by the FLOP-weighted rate of that step's "
            "matmuls (for each, the better of numpy/ORT at the nearer measured M)."
            + (f" `--profile-only` measured the rates again ({p['gemm_end_note']}); per shape and variant the "
               "better of the two is used." if p.get("gemm_end_note") else ""), "",
            "| shape | M | K x N | cold copies | as run: x·W numpy / ORT | as run: dY·Wᵀ numpy / ORT | "
            "warm: numpy / ORT prepacked |", "|---|---:|---|---:|---:|---:|---:|"]


def _by_lib_cells(c: dict, torch_step_s: float | None) -> str:
    """' numpy / torch / ORT | % of own kernel | ceiling |': the step's matmuls priced on each kernel alone; the
    step's share of its own library's kernel (ORT's, or torch.mm for PyTorch); and, for ORT, its ORT/PyTorch
    tok/s if it ran at 100% of ORT's kernel (the step's FLOPs at the ORT-only rate, against PyTorch's step)."""
    lib = c.get("gemm_reference_by_lib")
    if not lib:
        return " - | - | - |"
    ceiling = (f"{torch_step_s / (c['gflop_per_step'] / lib['ort']):.2f}x"
               if c.get("backend") == "ort" and torch_step_s else "-")
    own = lib["torch" if c.get("backend") == "torch" else "ort"]
    return (" " + " / ".join(f"{lib[x]:.1f}" for x in GEMM_LIBS)
            + f" | {c['achieved_gflops']['median'] / own:.0%} | {ceiling} |")


def _torch_step(r: dict) -> float | None:
    """PyTorch's median step seconds in one (shape, workload) result, or None."""
    t = next((c for c in r["configs"].values() if c.get("ok") and c.get("backend") == "torch"), None)
    return t["step_seconds"]["median"] if t else None


def _gemm_description_interleaved(p: dict) -> list[str]:
    m = sorted({x["m"] for g in p["gemm"].values() for x in g})
    torch_mm = any("torch" in gemm_libs(g) for g in p["gemm"].values())
    libs = "numpy / torch / ORT" if torch_mm else "numpy / ORT"
    st = p.get("gemm_settings") or {"turn_seconds": 4.0}      # the first two such runs (03:10, 03:46) did not say
    spin = ("ORT's threads spin between nodes, as in the training session; each ORT sample starts "
            f"{st['ort_pause_s'] * 1000:.0f} ms after the previous one (another session's pool still spins), and a "
            f"pass shorter than {st['short_pass_s']:.1f} s is timed after an untimed one." if st.get("ort_spinning")
            else "ORT's threads did not spin (`allow_spinning=0`): at M = 128 that reads ~4-8% below a "
            "spinning session, so this run's reference is a little low for the small micro-batches.")
    return ["GEMM reference, sampled **inside each shape's lockstep**: a fourth process takes a turn after every "
            f"round of steps and samples for {st['turn_seconds']:g} s, round-robin over the step's own frozen-weight "
            f"matmuls at M = {', '.join(map(str, m))} rows " + (
                "(the micro-batches of 1, 2, 4 and 8 sequences)" if min(m) >= 128 else
                "(the rows a micro-batch gives a matmul: in the padding-free body its real tokens, ~55-128 per "
                "Alpaca sequence; at the LM head its labelled rows, ~6-92 per sequence, so the head also at 32)") + ", so the "
            "reference and the steps see this shared machine in the same minutes (earlier runs measured it before "
            "the lockstep and the machine drifted in between by up to ~15%). 2 threads, float32. Each matmul "
            "is timed as the training session issues it:",
            "- both products, each half of its FLOPs: forward x·W and backward dY·Wᵀ (the LM head, one vocabulary "
            "slice of the [V, H] weight as the training graph runs it: x·Wᵀ and dZ·W);",
            "- on ORT (MatMul; Gemm transB) with prepacking disabled, because ORT's training API refuses it "
            "(`Module` sets `session.disable_prepacking=1`: \"Prepacking is not supported for training "
            "scenarios\"), and on numpy (OpenBLAS), which reaches close to prepacked rates without prepacking;"
            + (" and on torch (`torch.mm` on the same arrays, 2 threads: the peer's own kernel, MKL in this "
               "x86 wheel);" if torch_mm else ""),
            "- one sample = one pass over copies of the weight filling >= 64 MiB (twice the L3), each used once: the "
            "weight comes from memory, as in a pass over the model, not from the 32 MiB L3;"
            + (" (the Intel hosts report a 105 MiB L3; there, 256 MiB of copies gave torch.mm the same rates as "
               "64 MiB within 7%, measured 2026-12-02)" if torch_mm else ""),
            f"- {spin}", "",
            "The \"% of GEMM\" column divides a step's achieved GFLOP/s by the FLOP-weighted rate of that step's "
            "matmuls: for each, the " + ("best of numpy, torch and ORT" if torch_mm else "better of numpy and ORT")
            + " (median of its samples) at the nearest measured M. "
            "The better library per product is the harder target: the training session has only ORT's kernel.", "",
            f"| shape | M | K x N | cold copies | x·W {libs} (median GFLOP/s) | dY·Wᵀ {libs} | samples |",
            "|---|---:|---|---:|---:|---:|---:|"]
