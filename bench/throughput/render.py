"""The report of a training-throughput run, whole, from its JSON alone (nothing is measured here): the header
(bench/runs.py), what ran, throughput and peak RSS, FLOPs and the GEMM reference (render_flops.py), the
low-memory run, where memory and time go, and the targets."""
from __future__ import annotations

from bench import runs
from bench.common import mib
from bench.throughput.config import CGROUP, LOWMEM_FRACTION, PILOT
from bench.throughput.render_flops import render_flops
from bench.throughput.verdicts import best_key, judge, shown

TITLE = "Training throughput and memory"


def render_report(p: dict, run: str) -> str:
    """The Markdown of the run named `run` (its stem), from its results JSON `p`."""
    files = {"raw results": f"{run}.json", "plot": f"{run}.png"}
    lines = runs.header(TITLE, run, "bench/train_throughput.py", p["machine"], p["command"], files)
    lines += (_intro(p) + _gpt2_fallback(p) + _throughput(p) + render_flops(p) + _lowmem(p) + render_analysis(p)
              + _targets(p, run))
    return "\n".join(lines)


def _fit_mode(p: dict) -> bool:
    """Runs since 2026-12-02 08:00 UTC: the lockstep's third process is ort-fit (the runner's own split)."""
    return any(r.get("memory_fit") for r in p["results"])


def _rng(d: dict, fmt: str = "{:.2f}") -> str:
    return f"{fmt.format(d['median'])} ({fmt.format(d['min'])}-{fmt.format(d['max'])})"


def _pilot_words(p: dict) -> tuple[str, str]:
    """("1x8, 2x4, 4x2", "three"): the pilot's settings as this run's JSON records them."""
    pilot = p["settings"].get("pilot") or [list(q) for q in PILOT]
    return ", ".join(f"{m}x{a}" for m, a in pilot), {3: "three", 4: "four"}.get(len(pilot), str(len(pilot)))


def _fit_table(p: dict) -> list[str]:
    """How ort-fit chose its split (android_runner/memory_fit.py), against the peaks measured afterwards."""
    lines = ["", "How ort-fit split the batch (`--memory-budget` = the target; peaks in MiB; measured = one "
             "worst-case micro-batch of that many 128-token sequences, all labelled, before the first step):", "",
             "| shape | budget | measured at 1 / 2 sequences | per sequence | predicted 4 / 8 | chosen | measured at "
             "the chosen split | peak in the lockstep, sft / lm | fit took |",
             "|---|---:|---:|---:|---:|---|---:|---:|---:|"]
    by_shape: dict[str, dict] = {}
    for r in p["results"]:
        if r.get("ok") and r.get("memory_fit"):
            by_shape.setdefault(r["shape"], {})[r["workload"]] = r
    for shape, wls in by_shape.items():
        f = next(iter(wls.values()))["memory_fit"]
        meas, pred = f["measured_mb"], f["predicted_mb"]
        m = f["micro_batch"]
        peaks = " / ".join(mib(w["configs"][best_key(w)]["peak_rss"]) if w["configs"][best_key(w)].get("ok") else "-"
                           for w in (wls.get("sft"), wls.get("lm")) if w)
        two = f"{meas['2']:,.0f}" if "2" in meas else "not run"
        lines.append(f"| {shape} | {f['budget_mb']:,.0f} | {meas['1']:,.0f} / {two} | "
                     f"+{f['per_sequence_mb']:,.0f} | {pred.get('4', float('nan')):,.0f} / "
                     f"{pred.get('8', float('nan')):,.0f} | {m}x{f['accum']} | "
                     + (f"{meas[str(m)]:,.0f}" if m > 2 else "(= measured)") + f" | {peaks} | {f['seconds']:.0f} s |")
    return lines + [""]


def _intro(p: dict) -> list[str]:
    """When and how it ran, on which machine, and what each configuration and number is."""
    m = p["machine"]
    s = p["settings"]
    pilot_list, pilot_n = _pilot_words(p)
    fit_mode = _fit_mode(p)
    mb8_best = [] if fit_mode else [f"{r['shape']} {r['workload']}" for r in p["results"]
                                    if r.get("ok") and best_key(r) == "ort-8x1"]
    padding_free = any(r.get("ort_padding_free") for r in p["results"])
    return [
        f"Measured {p['date']} by `bench/train_throughput.py` in {p['wall_seconds'] / 60:.0f} min"
        + (" (**--quick smoke test: tiny configs, numbers meaningless**)" if p["quick"] else "") + ". "
        "One optimizer step at effective batch 8 (8 sequences of at most 128 tokens), LoRA r=8, alpha=16 on the "
        "attention projections, random-weight float32 checkpoints of the real configs (`../shared/data/configs`), "
        f"{s['threads']} threads everywhere, each run in its own process. Weights are random: the numbers are about "
        "speed and memory only.",
        "", "```sh", p["command"], "```", "",
        *([f"Re-measured afterwards with `{m['command']}` ({m['date']}, {m['wall_seconds'] / 60:.0f} min, load "
           f"{m['load_at_start'][0]:.2f} -> {m['load_at_end'][0]:.2f}): {', '.join(m['replaced'])}; those rows are "
           "from that run." for m in p.get("merges", [])] + [""] if p.get("merges") else []),
        f"Machine: {m['nproc']} CPUs ({m['cpu_model']}" + (f" family-model-stepping {m['cpu_id']}" if m.get("cpu_id") else "")
        + ", "
        + (("SIMD flags " + ", ".join(m["simd"])) if "simd" in m else "AVX2/FMA, no AVX-512")     # older runs: the AMD host
        + f"), {m['ram_bytes'] / 2**30:.1f} GiB RAM; "
        f"Linux {m['kernel']}, Python {m['python']}, " + ", ".join(f"{k} {v}" for k, v in m["versions"].items())
        + f". Load average at start {p['load_at_start'][0]:.2f}, at end {p['load_at_end'][0]:.2f} "
        "(the machine was shared; see the ranges).",
        "",
        "What runs:",
        "",
        "- **ORT** = the device path: `TrainSession` (`RuntimeOptions(threads=2)`) + `train_step`, fed the "
        "micro-batches `android_runner/loop.py` builds (`DataOrder(n, seed=0, micro)` + `collate`, right-padded to "
        "the longest sequence of each micro-batch), torch not importable in the process (as on a phone). "
        "`ort-8x1` = micro-batch 8, accum 1; " + (
            "`ort-fit-MxA` = the runner's `--memory-budget` with the shape's peak-RSS target as the budget "
            "(1.0 / 1.6 / 2.8 GB = 954 / 1,526 / 2,670 MiB): before its first step the process measures the peak "
            "of one worst-case micro-batch of 1 and of 2 sequences (128 labelled tokens each), predicts the "
            "others linearly, runs the largest divisor of 8 predicted to fit once more, and trains at that split "
            "(`android_runner/memory_fit.py`, the code `pocketlora train --memory-budget` runs)."
            + (f" `--pilot` also timed {pilot_list}, one process each, in turns (speed map below)."
               if any(r.get("pilot") for r in p["results"]) else "") if fit_mode else
        f"`ort-best-MxA` = the fastest of {pilot_list} in a pilot "
            + ("(`--pilot`: one process per setting, shape and workload, the settings taking turns step by step as in "
               f"the lockstep below, 1 warm-up + {s['pilot_steps']} " if s.get("pilot_mode") == "lockstep" else
               f"(`--pilot`: one process per shape and workload, the {pilot_n} settings in turn, 1 warm-up + {s['pilot_steps']} ")
            + "measured step each, lowest median step time wins), stored in `bench/best_splits.json` and used by later runs "
            "(pilot numbers below when this run re-measured them)" + (
                "." if not mb8_best else f". Where 8x1 won ({', '.join(mb8_best)}), the best setting's numbers are "
                "ort-8x1's, marked `ort-8x1 (best)`, and no second process runs it.")),
        "- **PyTorch** = `eval.reference.reference_train` (PEFT LoRA with the bundle's own `target_modules`, "
        "transformers' default attention (SDPA), base model in `eval()`, AdamW, clipping 1.0, loss = summed NLL "
        "over the step's labelled tokens / their count), `torch.set_num_threads(2)`, one micro-batch of the same 8 "
        "sequences (`collate` of `DataOrder(n, 0, 8)`: exactly the examples ORT sees). It computes full logits at "
        "every position" + ("" if not padding_free else
        " and every layer at padding positions too; ORT's graph is padding-free (`artifacts_gen/packing.py`): "
        "its per-token layers run on the real tokens only, and attention alone on the padded [B, L] layout") +
        "; ORT's graph gathers the labelled positions before the LM head, and computes the head, the "
        "loss and dLoss/dh in the forward pass, over the vocabulary in slices of <= 16,384 entries with an online "
        "softmax (`artifacts_gen/head_loss.py`; no [N, V] tensor whole). Both processes drop the tokenizer once "
        "the data is tokenized and trim the heap, as `android_runner/loop.py` does.",
        "- Workloads: **lm** = the first 2000 lines of WikiText-2 train cut into 128-token blocks (every token "
        "labelled, 1024 real tokens per step); **sft** = `alpaca_en_demo.json` with prompts labelled -100 (GPT-2 "
        "tokenizer: Alpaca prompt; Qwen2.5: its chat template). Both through `ort_trainer.data.load_examples`.",
        "- Tokenizers: GPT-2's for gpt2-124m **and gemma3-270m** (Gemma's own is not in `../shared`; with random "
        "weights any tokenizer whose vocabulary (50,257) is <= the model's (262,144) fits; only the data's token "
        "counts change), Qwen2.5's for qwen2.5-0.5b.",
        f"- Lockstep, per shape: three processes (ort-8x1, torch-8x1, {'ort-fit' if fit_mode else 'ort-best'}) load at the same time, then take "
        f"turns one step at a time (A B C A B C ...), so no two steps ever overlap and slow phases of the machine hit "
        f"all three alike{' (ort-best only in the workloads a split won)' if mb8_best else ''}: first the sft workload, then lm, each {s['warmup']} warm-up + {s['steps']} measured steps "
        "on the same data in every process. Before its sft phase, the ort-8x1 process runs the memory-lean setting "
        "1x8 on lm (1 warm-up + 1 measured step), while nothing else has been allocated in it: that phase gives the "
        "lean peak RSS and the normal-mode comparison of the low-memory section. "
        "Step time = `StepResult.seconds` (ORT: forward/backward of every micro-batch, grad norm, optimizer step) "
        "or the time from handing the batch to `reference_train` to its progress callback (PyTorch: forward, "
        "backward, clip, AdamW, scheduler). Headline = median of the measured steps, with (min-max).",
        "- tokens/s = real tokens (attention_mask sum) / step time; labelled tok/s = tokens carrying loss.",
        "- Peak RSS per workload = max(the phase's VmHWM, reset through /proc/self/clear_refs when the phase starts; "
        "VmRSS sampled by the parent every 0.1 s during the phase); it includes the interpreter, tokenizer, both "
        "workloads' data and (ORT) the session. A process runs sft before lm: what an allocator keeps from sft "
        "can only add to lm's peak, never hide it.",
        "",
    ]


def _gpt2_fallback(p: dict) -> list[str]:
    gpt2 = p["setups"].get("gpt2-124m")
    if not (gpt2 and gpt2.get("fallback_from_error")):
        return []
    return [f"**gpt2-124m runs with `n_positions=512` instead of 1024**: the real config's bundle cannot be "
            f"built (`{gpt2['fallback_from_error'][:160]}`, see bench/gen_real_shapes.py, KNOWN_FAILURES). Every "
            "matmul of a 128-token step is the same; only the position table (and the causal-mask constant) is "
            "smaller (393k instead of 786k parameters, 1.5 MiB).", ""]


def _throughput(p: dict) -> list[str]:
    """The main table, the pilot, how ort-fit split the batch, and the first step's loss on both sides."""
    fit_mode = _fit_mode(p)
    lines = ["## Throughput and peak RSS", "",
             "Step s, tokens/s, GFLOP/s and % of GEMM: median of the measured steps (min-max). ORT/PyTorch = ratio "
             "of the tokens/s medians. CPU/wall = process CPU seconds per wall second during the steps (2.0 = both "
             "cores busy). % of GEMM: the step's GFLOP/s over the GEMM rate of its own matmuls as the training "
             "session runs them" + (", and in parentheses over the warm, prepacked upper bound" if any(
                 c.get("efficiency_warm") for r in p["results"] if r.get("ok") for c in r["configs"].values())
                 else "") + " (see \"FLOPs and GEMM throughput\").", "",
             "| shape | workload | config | step s | tokens/s | labelled tok/s | ORT/PyTorch tok/s | "
             "peak RSS MiB | GFLOP/step | GFLOP/s | % of GEMM | CPU/wall |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in p["results"]:
        if not r.get("ok"):
            lines.append(f"| {r['shape']} | | **FAILED** | {r.get('error', '')[:200]} | | | | | | | |")
            continue
        t = r["configs"]["torch-8x1"]
        for key, c in r["configs"].items():
            if not c.get("ok"):
                lines.append(f"| {r['shape']} | {r['workload']} | {key} | **FAILED** | | | | | | | |")
                continue
            ratio = (f"{c['tokens_per_s']['median'] / t['tokens_per_s']['median']:.2f}x"
                     if c["backend"] == "ort" and t.get("ok") else "1")
            eff = f"{c['efficiency']['median']:.0%}" if c.get("efficiency") else "-"
            eff += f" ({c['efficiency_warm']['median']:.0%})" if c.get("efficiency_warm") else ""
            cpu = f"{c['cpu_per_wall']['median']:.2f}" if c.get("cpu_per_wall") else "-"
            lines.append(
                f"| {r['shape']} | {r['workload']} | {shown(r, key)} | {_rng(c['step_seconds'])} | "
                f"{_rng(c['tokens_per_s'], '{:.0f}')} | {c['label_tokens_per_s']['median']:.0f} | {ratio} | "
                f"{mib(c['peak_rss'])} | {c['gflop_per_step']:.0f} | {_rng(c['achieved_gflops'], '{:.1f}')} | {eff} | {cpu} |")
    if p.get("best_splits_measured"):
        lines += ["", f"ort-best splits from `bench/best_splits.json`, measured {p['best_splits_measured']}."]
    lines += [] if not any(r.get("pilot") for r in p["results"]) else [
        "", "Pilot (ORT micro-batch x accum, median step seconds, one process): " + "; ".join(
        f"{r['shape']} {r['workload']}: " + ", ".join(f"{q['micro']}x{q['accum']} {q['median_step_s']:.2f}" for q in r["pilot"])
        + (f" -> fastest {min(r['pilot'], key=lambda q: q['median_step_s'])['micro']}x"
           f"{min(r['pilot'], key=lambda q: q['median_step_s'])['accum']}" if fit_mode
           else f" -> {r['best'][0]}x{r['best'][1]}") for r in p["results"] if r.get("ok") and r["pilot"]) + ".", ""]
    lines += _fit_table(p) if fit_mode else []
    losses = []
    for r in p["results"]:
        if r.get("ok"):
            o, t = r["configs"]["ort-8x1"], r["configs"]["torch-8x1"]
            if o.get("ok") and t.get("ok"):
                losses.append(f"{r['shape']} {r['workload']} {o['first_step_loss'][0]:.5f} vs {t['first_step_loss'][0]:.5f}")
    if losses:
        lines += ["Sanity check, loss of the first step (same weights, same batch, LoRA B = 0), ORT vs PyTorch: "
                  + "; ".join(losses) + ".", ""]
    return lines


def _lowmem(p: dict) -> list[str]:
    lm = p.get("lowmem")
    lines = ["", "## Low-memory mode", ""]
    if lm is None:
        lines.append("Not run (qwen2.5-0.5b not among --shapes, or --no-lowmem).")
    else:
        n, lo = lm["normal"], lm["low"]
        lines.append(
            f"{lm['shape']}, lm, micro-batch 1 x accum 8 (the loop's default), {lm['warmup']} warm-up + {lm['steps']} "
            f"measured steps, `RuntimeOptions(threads=2, memory=\"low\")` under a hard limit of "
            f"{lm['limit_bytes'] / 2**20:,.0f} MiB = {LOWMEM_FRACTION:.0%} of the fp32 weight bytes "
            f"({lm['fp32_weight_bytes'] / 2**20:,.0f} MiB){' (' + lm['note'] + ')' if lm.get('note') else ''}. "
            f"Mechanism: {lm.get('mechanism')}"
            + (f" (`{CGROUP}`: memory.limit_in_bytes, child moved into cgroup.procs before it imported anything; "
               "the bundle's shard files were evicted from the page cache first (posix_fadvise DONTNEED on those "
               "files only) so that their pages are charged to the cgroup when the child maps them)"
               if lm.get("mechanism") == "cgroup-v1" else "")
            + (f"; cgroup error: {lm['cgroup_error']}" if lm.get("cgroup_error") else "")
            + (f"; the child was {'verified' if (lo.get('cgroup') or {}).get('moved') else 'NOT verified'} to be in the "
               "cgroup (/proc/PID/cgroup)" if lm.get("mechanism") == "cgroup-v1" else "") + ".")
        lines += ["", "| mode | completed | median step s | peak RSS MiB (RssAnon / RssFile) | cgroup max usage MiB | limit hits (failcnt) |",
                  "|---|---|---:|---:|---:|---:|"]
        modes = [("normal (no limit)", n)] + ([("low (no limit)", lm["low_unlimited"])] if lm.get("low_unlimited") else [])
        fit = lm.get("low_fit")
        if fit and fit.get("memory_fit"):
            f = fit["memory_fit"]
            fit_label = f"low (limited), `--memory-budget auto`: {f['micro_batch']}x{f['accum']}"
        else:
            fit_label = "low (limited), `--memory-budget auto`"
        for label, x in modes + [("low (limited)", lo)] + ([(fit_label, fit)] if fit else []):
            cg = x.get("cgroup") or {}
            smp = x.get("sampled", {})
            lines.append(
                f"| {label} | {'yes' if x['completed'] else 'NO (exit %s)' % x['exit_code']} | "
                f"{x.get('median_step_s', float('nan')):.2f} | {mib(x['peak_rss'])} ({mib(smp.get('RssAnon', 0))} / "
                f"{mib(smp.get('RssFile', 0))}) | "
                f"{mib(cg['memory.max_usage_in_bytes']) if 'memory.max_usage_in_bytes' in cg else '-'} | "
                f"{cg.get('memory.failcnt', '-')} |")
        if fit and fit.get("memory_fit"):
            f = fit["memory_fit"]
            meas = ", ".join(f"{m}: {v:,.0f}" for m, v in f["measured_mb"].items())
            lines += ["", f"`--memory-budget auto` in the cgroup: budget {f['budget_mb']:,.0f} MiB of {f['counts']} "
                      f"({f['budget_source']}); measured MiB at micro-batch {meas} (+{f['per_sequence_mb']:,.0f} per "
                      f"sequence) -> {f['micro_batch']}x{f['accum']}, "
                      + (f"{lo['median_step_s'] / fit['median_step_s']:.2f}x the speed of the 1x8 low run above."
                         if fit.get("completed") and lo.get("completed") else "did not complete.")]
        for x in (lo, fit or {"completed": True}):
            if not x["completed"]:
                lines += ["", "Low-memory run output (tail):", "", "```", x.get("log_tail", "")[-1500:], "```"]
    return lines


def _targets(p: dict, run: str) -> list[str]:
    lines = ["", "## Targets", ""]
    for target, met, ev in judge(p):
        lines.append(f"- {'MET' if met else '**MISSED**'}: {target}: {ev}")
    return lines + ["", f"Plot: [{run}.png]({run}.png). Raw numbers (every step, RSS at each stage, pilot, GEMM): "
                    f"[{run}.json]({run}.json).", ""]


def render_analysis(p: dict) -> list[str]:
    """RSS at each stage of a run (from the children's /proc/self/status), and the ORT profile if run."""
    lines = ["", "## Where the memory goes (RSS at each stage of one run)", "",
             "VmRSS of the child (anonymous + file-backed) when: the interpreter and libraries are imported; the "
             "data is tokenized; the session (ORT: `TrainSession`, i.e. training graph + weights + optimizer) or "
             "model (PyTorch: `from_pretrained` + PEFT) exists; the last step is done. Peak = as in the table above.",
             "", "| shape | workload | config | imports | + data | + session / model | end of run (anon / file) | peak |",
             "|---|---|---|---:|---:|---:|---:|---:|"]
    for r in p["results"]:
        if not r.get("ok"):
            continue
        for key, c in r["configs"].items():
            raw = next((x["result"] for x in r.get("runs", {}).get(key, []) if x["ok"]), None)
            if not raw or not c.get("ok"):
                continue
            st = raw["rss"]
            mid = st.get("after_session") or st.get("after_model") or {}
            end = st.get("end", {})
            lines.append(f"| {r['shape']} | {r['workload']} | {key} | {mib(st['start']['VmRSS'])} | "
                         f"{mib(st['after_data']['VmRSS'])} | {mib(mid.get('VmRSS', 0))} | {mib(end.get('VmRSS', 0))} "
                         f"({mib(end.get('RssAnon', 0))} / {mib(end.get('RssFile', 0))}) | {mib(c['peak_rss'])} |")
    pil = [r for r in p["results"] if r.get("ok") and r.get("pilot")]
    if pil:
        lines += ["", ("ORT VmRSS after the pilot's steps (one process per setting; a sample after a step, not the peak): "
                       if p["settings"].get("pilot_mode") == "lockstep" else
                       f"ORT VmRSS after the pilot's steps (one process running {_pilot_words(p)[0].replace(', ', ', then ')}; "
                       "only the first, 1x8, is free of the earlier settings' allocations; a sample after a step, not the peak): ")
                  + "; ".join(f"{r['shape']} {r['workload']}: " + ", ".join(
                      f"{q['micro']}x{q['accum']} {mib(q['rss_end'])} MiB" for q in r["pilot"]) for r in pil) + "."]
    lm = p.get("lowmem")
    if lm and lm["normal"].get("completed"):
        smp = lm["normal"]["sampled"]
        lines += ["", f"{lm['shape']} at micro-batch 1 x accum 8 in its own process (the low-memory section's normal-mode "
                  f"run): peak {mib(lm['normal']['peak_rss'])} MiB, of which at most {mib(smp.get('RssAnon', 0))} MiB "
                  f"anonymous and {mib(smp.get('RssFile', 0))} MiB file-backed (the memory-mapped weight shards)."]
    prof = p.get("profile")
    if prof:
        lines += ["", "## Where the ORT step's time goes (ORT profiler)", "",
                  f"`{p.get('profile_command', p['command'] + ' --profile')}`"
                  + (f" ({p['profile_date']})" if p.get("profile_date") else "")
                  + ": one extra process per shape and setting with `SessionOptions.enable_profiling` (lm workload, "
                  "1 warm-up + 1 profiled step; profiling itself adds a little time). Kernel time of the profiled step "
                  "by op type (training session only; the optimizer session is < 1 ms).", ""]
        for key, x in prof.items():
            if not x.get("ok"):
                lines.append(f"- {key}: profiling run FAILED")
                continue
            ops = list(x["by_op_ms"].items())
            top = ", ".join(f"{k} {v:,.0f} ms ({v / x['model_run_ms']:.0%})" for k, v in ops[:8])
            lines.append(f"- **{key}**: step {x['step_seconds']:.2f} s; model runs {x['model_run_ms']:,.0f} ms, of which "
                         f"kernels {x['kernel_ms']:,.0f} ms; MatMul/FusedMatMul/Gemm {x['matmul_ms']:,.0f} ms "
                         f"({x['matmul_ms'] / x['model_run_ms']:.0%}). By op: {top}.")
            if x.get("gemm_by_kind"):
                kinds = "; ".join(f"{k} {g['ms']:,.0f} ms for {g['gflop']:,.1f} GFLOP = {g['gflops']:,.0f} GFLOP/s"
                                  for k, g in x["gemm_by_kind"].items())
                rest = x["model_run_ms"] - x["matmul_ms"]
                lines.append(f"  Matmuls by kind (FLOPs from the kernels' shapes): {kinds}. Everything else (other kernels "
                             f"and the gaps between them): {rest:,.0f} ms ({rest / x['model_run_ms']:.0%}).")
            nodes = "; ".join(f"`{n}` ({op}) {ms:,.0f} ms" for n, op, ms in x["top_nodes"][:6])
            lines.append(f"  Slowest nodes: {nodes}.")
            outs = "; ".join(f"`{n}` ({op}) {b / 2**20:,.0f} MiB" for n, op, b in x["largest_outputs"][:5])
            lines.append(f"  Largest node outputs: {outs}.")
    return lines
