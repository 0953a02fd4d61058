"""The demo's report: DIR/report.md, DIR/result.json and two PNGs (loss curve, accuracy before/after)."""
from __future__ import annotations

import json
from pathlib import Path


def _plots(work: Path, result: dict, run_dir: Path) -> tuple[str, str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], color="tab:blue")
    for state, color in (("slow", "tab:orange"), ("cooling", "tab:red"), ("paused", "tab:gray")):
        steps = [r["step"] for r in rows if r["gate"] == state]
        if steps:
            ax.scatter(steps, [rows[s - rows[0]["step"]]["loss"] for s in steps], s=10, color=color, label=f"gate {state}")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss (labelled tokens)")
    ax.set_title("On-device LoRA training (ORT)")
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    fig.tight_layout()
    fig.savefig(work / "loss.png", dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(4, 3.2))
    vals = [100 * result["accuracy_before"], 100 * result["accuracy_after"]]
    ax.bar(["base", "fine-tuned"], vals, color=["tab:gray", "tab:green"])
    for i, v in enumerate(vals):
        ax.text(i, v + 1, f"{v:.0f}%", ha="center")
    ax.set_ylim(0, 105)
    ax.set_ylabel("exact match, held-out questions (%)")
    fig.tight_layout()
    fig.savefig(work / "accuracy.png", dpi=120)
    plt.close(fig)
    return "loss.png", "accuracy.png"


def _ppl_rows(result: dict, seq_len: int) -> list[str]:
    pb, pa, rise = result["ppl_before"], result["ppl_after"], result["ppl_rise"]
    rows = [f"| WikiText-2 test perplexity, HF's sliding window ({pb['hf_tokens']} scored tokens, window {seq_len}, "
            f"BOS once at the start) | {pb['hf']:.3f} | {pa['hf']:.3f} ({rise['hf']:+.1%}) |"]
    if "bos" in rise:
        rows.append(f"| the same text with a BOS at the start of every window ({pb['bos_tokens']} scored tokens) | "
                    f"{pb['bos']:.3f} | {pa['bos']:.3f} ({rise['bos']:+.1%}) |")
    for k, v in result.get("ppl_rise_by_position", {}).items():
        rows.append(f"| ... only the tokens at positions {k} of each window | {pb['by_position'][k]:.3f} | "
                    f"{pa['by_position'][k]:.3f} ({v:+.1%}) |")
    return rows


def _chat_rows(chat: dict | None) -> list[str]:
    if not chat:
        return []
    rows = ["| turn | base model | fine-tuned |", "|---|---|---|"]
    for b, a in zip(chat["before"], chat["after"]):
        if b["role"] == "user":
            rows.append(f"| **user** | {b['content']} | |")
        else:
            rows.append(f"| assistant | {b['content'][:80]} | {a['content'][:80]} |")
    return rows + [""]


def write_demo_report(work: Path, result: dict, run_dir: Path) -> Path:
    loss_png, acc_png = _plots(work, result, run_dir)
    (work / "result.json").write_text(json.dumps(result, indent=1))
    r, ts = result["recipe"], result["train_summary"]
    gate = ts["gate"]
    lines = [
        "# PocketLoRA demo: personalizing a model on private wearable records",
        "",
        f"Model: `{result['model']}`. LoRA r={r['r']}, alpha={r['alpha']:g}, targets {r['targets']}; "
        f"{r['steps']} steps of micro-batch {r['micro_batch']} x accum {r['accum']}, lr {r['lr']:g} (cosine, "
        f"warmup {r['warmup']}); loss on answer tokens (and on the replayed general text).",
        "",
        "| measure | before | after |",
        "|---|---|---|",
        f"| exact match on {result['heldout']} held-out paraphrased questions | {result['accuracy_before']:.1%} | "
        f"{result['accuracy_after']:.1%} |",
        *_ppl_rows(result, r["seq_len"]),
        "",
        f"Training on the device: {ts['step']} steps in {ts['wall_s']:.0f} s, {ts['tokens_per_s']} tokens/s, "
        f"peak RSS {ts['peak_rss_mb']:.0f} MB. Gate time per state (s): "
        + ", ".join(f"{k} {v:.0f}" for k, v in gate["seconds_in"].items()) + ".",
        "",
        "Gate state changes (replayed battery trace of an evening on the charger):",
        "",
        *[f"- t={t['t_s']:.0f}s {t['from']} -> {t['to']}: {t['reason']}" for t in gate.get("transitions", [])],
        "",
        f"![loss]({loss_png}) ![accuracy]({acc_png})",
        "",
        "## Sample answers (greedy, exported ONNX model on plain onnxruntime)",
        "",
        f"The exported model's answers equal the decoder's for {result.get('samples_agree', '?')} of "
        f"{len(result['samples'])} of these questions.",
        "",
        "| question | true answer | base model | fine-tuned |",
        "|---|---|---|---|",
        *[f"| {s['question']} | {s['answer']} | {s['base'][:60]} | {s['tuned_standalone_onnx'][:60]} |"
          for s in result["samples"]],
        "",
        "## A short chat, before and after (greedy, the bundle's KV-cache decoder, the adapter swapped in)",
        "",
        *_chat_rows(result.get("chat")),
        "## Every held-out question",
        "",
        "| kind | question | gold | after |",
        "|---|---|---|---|",
        *[f"| {a['kind']} | {a['question']} | {a['gold']} | {a['after'][:60]} |" for a in result["answers"]],
        "",
        "Time per phase (s): " + ", ".join(f"{k} {v}" for k, v in result["timings_s"].items())
        + f"; total {result['total_s']} s.",
        "",
    ]
    path = work / "report.md"
    path.write_text("\n".join(lines))
    return path
