"""Write a parity report: REPORT/report.json, REPORT/report.md and PNG plots (matplotlib, Agg).

The report states how every number is defined, and shows each check as PASS or FAIL with its
value and threshold: a failed check is reported, never hidden.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

DEFINITIONS = {
    "loss": "Per optimizer step: mean shifted next-token NLL over all labelled tokens of the step's micro-batches "
            "(HF causal-LM loss; each micro-batch contributes sum_NLL / N_step). The ORT value is the device "
            "runner's metrics.jsonl `loss`; the PyTorch value is eval.reference.reference_train's.",
    "loss_rel_diff": "Per step |L_ort - L_torch| / |L_torch|; the check uses the maximum over steps, the mean is "
                     "shown too.",
    "weights": "Per LoRA tensor (PEFT key and layout): max_abs = max |W_ort - W_torch|, "
               "max_rel = max_abs / max |W_torch| (relative to the tensor's largest PyTorch value).",
    "perplexity": "exp(total NLL / scored tokens) over the held-out file, tokenized with the bundle tokenizer "
                  "(no special tokens in the body, the tokenizer's BOS once at the start if it adds one), scored "
                  "with a sliding window of seq_len tokens moved by stride as in Hugging Face's perplexity guide: "
                  "each window scores only the tokens not scored by the previous window (the first window scores "
                  "all but its first token). NLLs are summed exactly; the scored-token count is reported.",
    "ppl_rel_diff": "|ppl(ORT-trained LoRA, ORT) - ppl(PyTorch-trained LoRA, PyTorch)| / "
                    "ppl(PyTorch-trained, PyTorch). "
                    "Cross-checks: inference = same ORT-trained weights scored in ORT vs PyTorch; training = "
                    "ORT-trained vs PyTorch-trained weights both scored in PyTorch.",
    "mmlu": "Hendrycks' prompt ('The following are multiple choice questions (with answers) about {subject}.', "
            "then k solved dev-split examples, then the question ending in 'Answer:'), encoded with the tokenizer's "
            "BOS if it adds one; a prompt that does not fit the length budget loses shots from the end (counted as "
            "shots dropped). The prediction is the argmax of the next-token logits restricted to the tokens of "
            "' A', ' B', ' C', ' D'. micro = correct / questions over all subjects; macro = mean of per-subject "
            "accuracies. The check compares micro accuracy in percentage points.",
    "perf": "Each side trains in its own subprocess. train_s = time inside optimizer steps; tokens/s = real "
            "(attention-mask) tokens / train_s; peak RSS = the training process's peak resident set (Linux VmHWM, "
            "else ru_maxrss: interpreter, libraries, model and training). With --in-process both sides share one "
            "process and the RSS figures are not per side.",
}

LOSS_PNG = "loss_curves.png"
REL_PNG = "loss_rel_diff.png"
MMLU_PNG = "mmlu_per_subject.png"
LABELS = {"base": "base", "ort_trained": "ORT-trained", "torch_trained": "PyTorch-trained"}
BACKENDS = {"ort": "ORT", "torch": "PyTorch"}


def _fmt(x, digits: int = 4) -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return str(x)
    if isinstance(x, int):
        return str(x)
    if isinstance(x, float):
        if math.isnan(x):
            return "nan"
        if x != 0 and (abs(x) < 1e-3 or abs(x) >= 1e6):
            return f"{x:.{digits - 1}e}"
        return f"{x:.{digits}g}"
    return str(x)


def _table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join((c if isinstance(c, str) else _fmt(c)).replace("|", "\\|") for c in row) + " |"
              for row in rows]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Plots
# --------------------------------------------------------------------------------------------
def _plt():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def save_line_plot(plt, fig, ax, path, title: str, ylabel: str, grid_which: str = "major") -> Path:
    """The common end of a step-axis line plot: labels, legend, grid, save, close."""
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3, which=grid_which)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def plot_loss_curves(report: dict, path: Path) -> Path:
    plt = _plt()
    loss = report["loss"]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(loss["steps"], loss["torch"], label="PyTorch + PEFT", lw=2.5, alpha=0.6)
    ax.plot(loss["steps"], loss["ort"], label="ORT (device runner)", lw=1.0, ls="--")
    return save_line_plot(plt, fig, ax, path, "Training loss, both sides", "training loss (mean NLL)")


def plot_rel_diff(report: dict, path: Path) -> Path:
    plt = _plt()
    loss = report["loss"]
    thr = report["thresholds"]["loss_max_rel"]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    vals = [max(v, 1e-12) for v in loss["rel_diff"]]
    ax.semilogy(loss["steps"], vals, marker=".", lw=1, label="ORT vs PyTorch")
    if loss.get("floor"):
        ax.semilogy(loss["steps"], [max(v, 1e-12) for v in loss["floor"]["rel_diff"]], marker=".", lw=1,
                    label=f"noise floor: ORT {loss['floor']['split']} vs ORT (same math)")
    else:
        ax.axhline(thr, color="red", ls=":", label=f"threshold {thr:g}")
    return save_line_plot(plt, fig, ax, path, "Loss relative difference per step", "|L_ort - L_torch| / |L_torch|",
                          grid_which="both")


def plot_mmlu(report: dict, path: Path) -> Path:
    plt = _plt()
    matrix = report["mmlu"]["matrix"]
    series = [(w, b) for w in ("base", "ort_trained", "torch_trained") for b in ("ort", "torch")
              if b in matrix.get(w, {})]
    subjects = list(next(iter(matrix.values()))["ort"]["per_subject"])
    n = len(series)
    width = 0.8 / max(1, n)
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(subjects) + 2), 4))
    for j, (w, b) in enumerate(series):
        accs = [100 * (matrix[w][b]["per_subject"][s]["acc"] or 0) if matrix[w][b]["per_subject"][s]["n"] else 0
                for s in subjects]
        ax.bar([i + (j - (n - 1) / 2) * width for i in range(len(subjects))], accs, width,
               label=f"{LABELS[w]} via {BACKENDS[b]}")
    ax.set_xticks(range(len(subjects)))
    ax.set_xticklabels([s.replace("_", " ") for s in subjects], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("accuracy (%)")
    ax.set_ylim(0, 100)
    ax.axhline(25, color="grey", ls=":", lw=1)
    ax.set_title("MMLU per subject")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------------------------
# Markdown
# --------------------------------------------------------------------------------------------
def checks_table(report: dict) -> str:
    rows = [[c["status"] if c["pass"] else f"**{c['status']}**", c["name"], _fmt(c["value"]),
             f"<= {_fmt(c['threshold'])}" + (f" {c['unit']}" if c.get("unit") else ""), c["detail"]]
            for c in report["checks"]]
    return _table(["result", "check", "value", "threshold", "detail"], rows)


def ppl_table(report: dict) -> str:
    p = report["perplexity"]
    m = p["matrix"]
    rows = [[LABELS[w], _fmt(m[w]["ort"]["ppl"], 7), _fmt(m[w]["torch"]["ppl"], 7),
             _fmt(abs(m[w]["ort"]["ppl"] - m[w]["torch"]["ppl"]) / m[w]["torch"]["ppl"])]
            for w in ("base", "ort_trained", "torch_trained") if w in m]
    return _table(["LoRA weights", "ppl via ORT", "ppl via PyTorch", "rel diff (inference)"], rows)


def mmlu_table(report: dict) -> str:
    m = report["mmlu"]["matrix"]
    rows = []
    for w in ("base", "ort_trained", "torch_trained"):
        for b in ("ort", "torch"):
            if b in m.get(w, {}):
                r = m[w][b]
                rows.append([LABELS[w], BACKENDS[b], f"{100 * r['micro']:.2f}", f"{100 * r['macro']:.2f}", r["n"],
                             r["shots_dropped"], r["truncated"]])
    return _table(["LoRA weights", "backend", "micro %", "macro %", "questions", "shots dropped", "truncated"], rows)


def mmlu_subject_table(report: dict) -> str:
    m = report["mmlu"]["matrix"]
    cols = [(w, b) for w in ("base", "ort_trained", "torch_trained") for b in ("ort", "torch") if b in m.get(w, {})]
    subjects = list(m[cols[0][0]][cols[0][1]]["per_subject"])
    rows = []
    for s in subjects:
        row = [s]
        for w, b in cols:
            st = m[w][b]["per_subject"][s]
            row.append(f"{100 * st['acc']:.1f} ({st['correct']}/{st['n']})" if st["n"] else "n/a")
        rows.append(row)
    return _table(["subject"] + [f"{LABELS[w]} / {BACKENDS[b]}" for w, b in cols], rows)


def perf_table(report: dict) -> str:
    p = report["perf"]
    rows = []
    for side, name in (("ort", "ORT (device runner)"), ("torch", "PyTorch + PEFT")):
        r = p[side]
        rows.append([name, _fmt(r["train_s"]), _fmt(r.get("process_wall_s")), r["tokens"], _fmt(r["tokens_per_s"]),
                     _fmt(r["peak_rss_mb"]), str(r.get("threads"))])
    return _table(["side", "train s", "process wall s", "tokens", "tokens/s", "peak RSS MiB", "threads"], rows)


def weights_table(report: dict, top: int = 8) -> str:
    t = report["weights"]["tensors"]
    worst = sorted(t.items(), key=lambda kv: -kv[1]["max_rel"])[:top]
    return _table(["tensor (PEFT key)", "max abs diff", "max rel diff", "max abs (PyTorch)"],
                  [[k, v["max_abs"], v["max_rel"], v["ref_max_abs"]] for k, v in worst])


def render_markdown(report: dict, images: dict[str, str]) -> str:
    cfg, b = report["config"], report["bundle"]
    loss = report["loss"]
    overall = "PASS" if report["pass"] else "FAIL"
    parts = [
        f"# Parity report: ORT device trainer vs PyTorch + PEFT ({b['family']})",
        "",
        f"**Overall: {overall}** ({sum(c['pass'] for c in report['checks'])}/{len(report['checks'])} checks pass). "
        f"Created {report['created']}.",
        "",
        "## Checks",
        "",
        checks_table(report),
        "",
        "## Setup",
        "",
        _table(["what", "value"], [
            ["bundle", f"`{b['path']}` ({b['architecture']}, source `{b['source']}`)"],
            ["LoRA", f"r={b['lora']['r']} alpha={b['lora']['alpha']} dropout={b['lora']['dropout']} "
                     f"targets {', '.join(b['lora']['target_modules'])}; {b['trainable_params']} trainable params"],
            ["training data", f"`{cfg['data']}` (seq_len {b['seq_len']})"],
            ["steps", f"{cfg['steps']} x {cfg['accum']} micro-batches of {cfg['micro_batch']}, "
                      f"{loss['label_tokens']} labelled tokens in all"],
            ["optimizer", f"AdamW lr {cfg['lr']} ({cfg['schedule']}, warmup {cfg['warmup']}), betas "
                          f"({b['optimizer']['beta1']}, {b['optimizer']['beta2']}), eps {b['optimizer']['eps']}, "
                          f"weight decay {cfg['weight_decay']}, clip {cfg['clip']}"],
            ["data order seed", str(cfg["seed"])],
        ]),
        "",
        "## Loss curves",
        "",
        f"Max relative difference {_fmt(loss['max_rel_diff'])}, mean {_fmt(loss['mean_rel_diff'])}; "
        f"final loss ORT {_fmt(loss['ort'][-1], 7)}, PyTorch {_fmt(loss['torch'][-1], 7)}." + (
            f" The noise floor (ORT again with the same steps split {loss['floor']['split']}): max "
            f"{_fmt(max(loss['floor']['rel_diff']))}, mean "
            f"{_fmt(sum(loss['floor']['rel_diff']) / len(loss['floor']['rel_diff']))}."
            if loss.get("floor") else ""),
        "",
        f"![loss curves]({images['loss']})",
        "",
        f"![relative difference]({images['rel']})",
        "",
        "## Final LoRA weights",
        "",
        f"Over {len(report['weights']['tensors'])} tensors: max abs diff {_fmt(report['weights']['max_abs'])}, "
        f"max rel diff {_fmt(report['weights']['max_rel'])} (ORT checkpoint at step {report['weights']['ort_step']}). "
        "Largest relative differences:",
        "",
        weights_table(report),
        "",
    ]
    p = report.get("perplexity")
    parts += ["## Held-out perplexity", ""]
    if p:
        parts += [
            f"`{p['data']}`: {p['tokens']} scored tokens, {p['windows']} windows, seq_len {p['seq_len']}, "
            f"stride {p['stride']}.",
            "",
            ppl_table(report),
            "",
            f"Final models (ORT-trained in ORT vs PyTorch-trained in PyTorch): rel diff {_fmt(p['final_rel_diff'])}. "
            f"Cross-checks: training only (both in PyTorch) {_fmt(p['training_rel_diff'])}; inference only "
            f"(ORT-trained weights, ORT vs PyTorch) {_fmt(p['inference_rel_diff'])}; base model "
            f"{_fmt(p['base_rel_diff'])}.",
            "",
        ]
    else:
        parts += ["Not run (no --heldout file).", ""]
    mm = report.get("mmlu")
    if mm:
        parts += [
            "## MMLU",
            "",
            f"`{mm['data']}`, split {mm['split']}, {mm['shots']}-shot, prompt budget {mm['max_len']} tokens"
            + (f", first {mm['limit_per_subject']} questions per subject" if mm.get("limit_per_subject") else "") + ".",
            "",
            mmlu_table(report),
            "",
            mmlu_subject_table(report),
            "",
            f"![MMLU per subject]({images['mmlu']})" if images.get("mmlu") else "",
            "",
        ]
    parts += ["## Speed and memory", "", perf_table(report), "", report["perf"]["how"] + ".", "",
              "Evaluation time (all perplexity and MMLU scoring above): "
              + ", ".join(f"{BACKENDS[k]} {v:.1f} s" for k, v in report["perf"]["eval_seconds"].items()) + ".", ""]
    if report.get("notes"):
        parts += ["## Notes", ""] + [f"- {n}" for n in report["notes"]] + [""]
    parts += ["## Metric definitions", ""] + [f"- **{k}**: {v}" for k, v in report["definitions"].items()] + [""]
    parts += ["## Versions", "", ", ".join(f"{k} {v}" for k, v in report["versions"].items()), ""]
    return "\n".join(parts)


def _json_safe(x):
    """NaN/inf -> None so report.json is strict JSON."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


def write_report(report: dict, out_dir: str | Path) -> dict[str, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    report = dict(report)
    report["definitions"] = DEFINITIONS
    images = {"loss": LOSS_PNG, "rel": REL_PNG}
    plot_loss_curves(report, out / LOSS_PNG)
    plot_rel_diff(report, out / REL_PNG)
    if report.get("mmlu"):
        plot_mmlu(report, out / MMLU_PNG)
        images["mmlu"] = MMLU_PNG
    report["images"] = images
    paths = {"json": out / "report.json", "md": out / "report.md"}
    paths["json"].write_text(json.dumps(_json_safe(report), indent=1, allow_nan=False) + "\n")
    paths["md"].write_text(render_markdown(report, images))
    paths.update({k: out / v for k, v in images.items()})
    return paths
