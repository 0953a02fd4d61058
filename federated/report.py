"""DIR/report.md (+ rounds.png when matplotlib is installed) from rounds.jsonl and personalization.json."""
from __future__ import annotations

import json
from pathlib import Path

from . import data as fdata
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
        f"Devices hold {fdata.APP_FACTS_PER_DEVICE} of the {len(fdata.APP_FACTS)} app facts each (no device all of them) "
        "and one person's private wearable records each (non-IID).",
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
    dp = [r["dp"] for r in rounds if "dp" in r]
    if dp:
        lines += ["", f"Central differential privacy (Flower's DP wrapper, server-side fixed clipping; federated/privacy.py): "
                  f"noise multiplier {cfg.dp_noise:g}, clipping norm {cfg.dp_clip:g}; after the last round "
                  f"epsilon = {dp[-1]['epsilon']:.3g} at delta = {dp[-1]['delta']:g} over {dp[-1]['releases']} "
                  f"released rounds (client-level, no sampling amplification)."]
    sa = [r["secagg_detail"] for r in rounds if r.get("secagg")]
    if sa:
        bound = max((d["error_bound"] for d in sa if d["error_bound"] is not None), default=None)
        lines += ["", f"Secure aggregation (Flower's SecAgg+; federated/secure.py): the server saw only each round's "
                  f"weighted sum, never one device's tensors or loss (B·A gap: unknown to it). Secrets shared among "
                  f"{sa[-1]['shares']} devices, threshold {sa[-1]['threshold']}; values quantized in "
                  f"[-{sa[-1]['clip']:g}, {sa[-1]['clip']:g}] to 2^22 levels, max weight {sa[-1]['max_weight']} "
                  f"tokens: each round's global differs from plain FedAvg of the same tensors by at most "
                  f"{f'{bound:.2g}' if bound else '–'} per value. Not released: {sum(not d['released'] for d in sa)} of {len(sa)} rounds."]
    lines += ["", "B·A gap: how far the merged adapter's B·A is from the weighted average of the devices' B·A "
              "(relative Frobenius norm); 0 for FFA-LoRA by construction.", "",
              "## Personalization (held-out paraphrases, never trained on)", "",
              "Mean over reporting devices: exact match of the greedy answer (EM, as the demo scores), next-token "
              "accuracy on the answer tokens (teacher-forced) and their NLL (lower is better). Shared: the app "
              "facts, all of them asked on every device; private: the device's own person's facts. "
              f"local only: each device alone for {cfg.rounds * cfg.local_steps} steps; federated + personalized: "
              f"the global adapter fine-tuned {cfg.personalize} steps on the device.", "",
              "| adapter | private EM | shared EM | private acc | shared acc | private loss | shared loss |",
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    devs = final["devices"]
    for key, label in ADAPTERS:
        if not devs or f"{key}/private/loss" not in devs[0]:
            continue
        cols = ("private/em", "shared/em", "private/acc", "shared/acc", "private/loss", "shared/loss")
        mean = {m: sum(d[f"{key}/{m}"] for d in devs) / len(devs) for m in cols}
        lines.append(f"| {label} | " + " | ".join(_f(mean[m]) for m in cols) + " |")
    lines += ["", f"{len(devs)} devices reported; declined the final phase: "
              f"{', '.join(f'{d} ({why})' for d, why in final['declined'].items()) or 'none'}; "
              f"failed: {len(final['failed'])}.", "", "### Per device: exact match, private / shared", "",
              "| device | " + " | ".join(label for _, label in ADAPTERS) + " |",
              "| ---: | " + " | ".join("---:" for _ in ADAPTERS) + " |"]
    for d in devs:
        lines.append(f"| {int(d['device'])} | " + " | ".join(
            f"{_f(d.get(f'{k}/private/em'), 2)} / {_f(d.get(f'{k}/shared/em'), 2)}" for k, _ in ADAPTERS) + " |")
    if _plot(rounds, out / "rounds.png"):
        lines += ["", "![rounds](rounds.png)"]
    if devs and _plot_accuracy(devs, out / "personalization.png"):
        lines += ["", "![held-out exact match](personalization.png)"]
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def _pyplot():
    """matplotlib's pyplot on the Agg backend, or None where matplotlib is not installed (the report's plots are
    then left out)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def _plot(rounds: list[dict], path: Path) -> bool:
    plt = _pyplot()
    if plt is None:
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


def _plot_accuracy(devs: list[dict], path: Path) -> bool:
    """Mean held-out exact match per adapter, private and shared side by side."""
    plt = _pyplot()
    if plt is None:
        return False
    shown = [(k, label) for k, label in ADAPTERS if f"{k}/private/em" in devs[0]]
    fig, ax = plt.subplots(figsize=(7, 3.2))
    for j, split in enumerate(("private", "shared")):
        means = [100 * sum(d[f"{k}/{split}/em"] for d in devs) / len(devs) for k, _ in shown]
        ax.bar([i + 0.4 * j for i in range(len(shown))], means, width=0.4, label=f"{split} questions")
    ax.set_xticks([i + 0.2 for i in range(len(shown))], [label for _, label in shown], fontsize=8)
    ax.set_ylabel("held-out exact match (%)")
    ax.set_ylim(0, 100)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
