"""DIR/report.md (+ rounds.png when matplotlib is installed) from rounds.jsonl and personalization.json."""
from __future__ import annotations

import json
from pathlib import Path

from . import state as fstate
from .config import FederateConfig

ADAPTERS = (("base", "base model"), ("global", "global only"), ("local-only", "local only"),
            ("personalized", "federated + personalized"))


def _f(v, digits=3) -> str:
    return "–" if v is None else f"{v:.{digits}f}"


def write_report(cfg: FederateConfig, out: Path) -> Path:
    rounds = [json.loads(line) for line in (out / fstate.ROUNDS).read_text().splitlines() if line.strip()]
    final = json.loads((out / fstate.FINAL).read_text())
    lines = [
        f"# Federated personalization: {cfg.devices} devices, {cfg.rounds} rounds, {cfg.strategy}",
        "",
        f"Bundle `{cfg.bundle}`. Each round every device whose battery gate allows it trains {cfg.local_steps} "
        f"local steps (micro-batch {cfg.micro_batch} x accum {cfg.accum}, lr {cfg.lr:g}) with the device loop and "
        f"sends only its LoRA tensors{' (B only: A is frozen at the shared init)' if cfg.strategy == 'ffa' else ''}; "
        f"the server averages them weighted by {'label tokens trained on this round' if cfg.weight == 'tokens' else 'the examples each device holds'}. "
        "Devices hold the same app facts and one person's private wearable records each (non-IID).",
        "",
        "## Rounds",
        "",
        "| round | loss | trained | declined | failed | MB up | MB down | B·A gap | s |",
        "| ---: | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rounds:
        declined = ", ".join(f"{d}" for d in r["declined"]) or "–"
        lines.append(f"| {r['round']} | {_f(r['loss'], 4)} | {len(r['participants'])} | {declined} | {len(r['failed'])} "
                     f"| {r['bytes_up'] / 1e6:.2f} | {r['bytes_down'] / 1e6:.2f} | {_f(r['product_gap'], 4)} | {r['seconds']:.1f} |")
    lines += ["", "B·A gap: how far the merged adapter's B·A is from the weighted average of the devices' B·A "
              "(relative Frobenius norm); 0 for FFA-LoRA by construction.", "",
              "## Personalization (held-out paraphrases, never trained on)", "",
              "Mean over reporting devices of the answer tokens' NLL (lower is better) and next-token accuracy. "
              f"local only: each device alone for {cfg.rounds * cfg.local_steps} steps; federated + personalized: "
              f"the global adapter fine-tuned {cfg.personalize} steps on the device.", "",
              "| adapter | private loss | private acc | shared loss | shared acc |", "| --- | ---: | ---: | ---: | ---: |"]
    devs = final["devices"]
    for key, label in ADAPTERS:
        if not devs or f"{key}/private/loss" not in devs[0]:
            continue
        mean = {m: sum(d[f"{key}/{m}"] for d in devs) / len(devs)
                for m in ("private/loss", "private/acc", "shared/loss", "shared/acc")}
        lines.append(f"| {label} | {_f(mean['private/loss'])} | {_f(mean['private/acc'])} | {_f(mean['shared/loss'])} "
                     f"| {_f(mean['shared/acc'])} |")
    lines += ["", f"{len(devs)} devices reported; declined the final phase: "
              f"{', '.join(f'{d} ({why})' for d, why in final['declined'].items()) or 'none'}; "
              f"failed: {len(final['failed'])}.", "", "### Per device (private loss)", "",
              "| device | " + " | ".join(label for _, label in ADAPTERS) + " |",
              "| ---: | " + " | ".join("---:" for _ in ADAPTERS) + " |"]
    for d in devs:
        lines.append(f"| {int(d['device'])} | " + " | ".join(_f(d.get(f"{k}/private/loss")) for k, _ in ADAPTERS) + " |")
    if _plot(rounds, out / "rounds.png"):
        lines += ["", "![rounds](rounds.png)"]
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def _plot(rounds: list[dict], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.2))
    xs = [r["round"] for r in rounds if r["loss"] is not None]
    a.plot(xs, [r["loss"] for r in rounds if r["loss"] is not None], marker="o")
    a.set_xlabel("round")
    a.set_ylabel("mean local training loss")
    b.bar([r["round"] for r in rounds], [len(r["participants"]) for r in rounds], label="trained")
    b.bar([r["round"] for r in rounds], [len(r["declined"]) for r in rounds],
          bottom=[len(r["participants"]) for r in rounds], label="declined")
    b.set_xlabel("round")
    b.set_ylabel("devices")
    b.legend(loc="lower right")
    for ax in (a, b):
        ax.set_xticks([r["round"] for r in rounds])
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
