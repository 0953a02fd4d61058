"""The report of a bench/federated.py run (rendering kept apart from running)."""
from __future__ import annotations

import statistics

from bench import runs

GOALS = {"shared_global": 0.70, "private_personalized": 0.85}
ADAPTERS = (("base", "base model"), ("global", "global only"), ("local-only", "local only"),
            ("personalized", "federated + personalized"))


def _mean(devs: list[dict], key: str) -> float | None:
    vals = [d[key] for d in devs if key in d]
    return statistics.fmean(vals) if vals else None


def _pct(v) -> str:
    return "–" if v is None else f"{100 * v:.1f}%"


def render_report(p: dict, stem: str) -> str:
    lines = runs.header("Federated personalization (Flower simulation engine)", stem, "bench/federated.py",
                        p["machine"], p.get("command"), {"raw": f"{stem}.json"}, p.get("notes", []))
    targets = []
    for name, r in p["shapes"].items():
        lines += [f"## {name}", "", f"`pocketlora {' '.join(r['argv'])}`", ""]
        if r.get("code") != 0:
            lines += [f"FAILED (exit {r.get('code')}):", "", "```", r.get("error", ""), "```", ""]
            continue
        rounds = r["rounds"]
        lines += [f"- wall {r['wall_s']:.0f} s; median round {r['round_s_median']:.1f} s "
                  f"({', '.join(format(x['seconds'], '.1f') for x in rounds)}); final phase (local-only training, "
                  f"personalization, evaluation on every device) {r['final_phase_s']:.0f} s",
                  f"- peak memory of the whole process tree (up to {r['processes']} processes: the server, Ray's GCS "
                  f"and raylet, its workers): RSS summed {r['tree_rss'] / 2**20:,.0f} MiB"
                  + (f", PSS summed {r['tree_pss'] / 2**20:,.0f} MiB (shared pages counted once)" if r.get("tree_pss") else "")
                  + f"; the largest process {r['largest_rss'] / 2**20:,.0f} MiB RSS"
                  + ("; a device's own peak RSS (its runs' VmHWM): " + ", ".join(
                      f"{k} {v:,.0f} MiB" for k, v in sorted(r["device_peak_rss_mb"].items()))
                     if r.get("device_peak_rss_mb") else ""),
                  f"- per round: {statistics.fmean(x['bytes_up'] for x in rounds) / 1e6:.2f} MB up, "
                  f"{statistics.fmean(x['bytes_down'] for x in rounds) / 1e6:.2f} MB down; trained "
                  f"{', '.join(str(len(x['participants'])) for x in rounds)} devices; losses "
                  f"{', '.join('–' if x['loss'] is None else format(x['loss'], '.3f') for x in rounds)}", ""]
        if "dp" in rounds[-1]:
            dp = rounds[-1]["dp"]
            lines += [f"- central DP: noise multiplier {dp['noise_multiplier']:g}, clipping norm {dp['clip']:g}; "
                      f"epsilon {dp['epsilon']:.3g} at delta {dp['delta']:g} after {dp['releases']} released rounds", ""]
        devs = r["devices"]
        lines += [f"Held-out questions on {len(devs)} devices (mean; EM = exact match of the greedy answer):", "",
                  "| adapter | private EM | shared EM | private token acc | shared token acc |",
                  "| --- | ---: | ---: | ---: | ---: |"]
        for key, label in ADAPTERS:
            if _mean(devs, f"{key}/private/em") is None:
                continue
            lines.append(f"| {label} | {_pct(_mean(devs, f'{key}/private/em'))} | {_pct(_mean(devs, f'{key}/shared/em'))} "
                         f"| {_pct(_mean(devs, f'{key}/private/acc'))} | {_pct(_mean(devs, f'{key}/shared/acc'))} |")
        lines.append("")
        if name == "real":
            shared = _mean(devs, "global/shared/em")
            private = _mean(devs, "personalized/private/em")
            for goal, got, what in ((GOALS["shared_global"], shared, "shared questions, global adapter"),
                                    (GOALS["private_personalized"], private, "private questions, personalized")):
                ok = got is not None and got >= goal
                targets.append(f"- {'MET' if ok else '**MISSED**'}: {what} {_pct(got)} (goal >= {_pct(goal)})")
    if targets:
        lines += ["## Targets", "", *targets, ""]
    return "\n".join(lines)
