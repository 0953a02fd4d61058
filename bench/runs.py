"""Dated run files: every bench run is <stem>.md (its report, whole) with <stem>.json (its raw results) beside it,
and a plot <stem>.png where the bench draws one. The stem is the run's UTC start and what ran:

    2026-12-03T0913Z-train-throughput        2026-11-30T0629Z-gen-real-shapes        ...-train-throughput-quick

Every report opens with the same header (title, run, host fingerprint, command, files). A bench writes into
docs/bench/runs/ (RUNS) or, for smoke tests and --no-doc, into its workdir; it never edits a hand-written doc.

    python -m bench.runs [DIR]      a Markdown index of the runs in DIR (default docs/bench/runs): run, host, targets
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import re
from pathlib import Path

from bench.common import RUNS, fingerprint

STEM = re.compile(r"^(\d{4}-\d{2}-\d{2})T(\d{2})(\d{2})Z-(.+)$")


def stem(date: str, what: str) -> str:
    """"2026-12-03 09:13 UTC", "train-throughput" -> "2026-12-03T0913Z-train-throughput"."""
    t = dt.datetime.strptime(date, "%Y-%m-%d %H:%M UTC")
    return f"{t:%Y-%m-%dT%H%MZ}-{what}"


def header(title: str, run: str, bench: str, machine: dict, command: str | None, files: dict[str, str],
           notes: list[str] = ()) -> list[str]:
    """The lines every run report opens with. `files`: label -> file name beside the report."""
    lines = [f"# {title}: run {run}", "",
             f"- Bench: `{bench}`",
             f"- Host: {fingerprint(machine)}"]
    if command:
        lines.append(f"- Command: `{command}`")
    if files:
        lines.append("- Files: " + ", ".join(f"[{label}]({name})" for label, name in files.items()))
    lines += [f"- Note: {n}" for n in notes]
    return lines + [""]


def write(out_dir: Path, run: str, report: str, raw: dict | None = None) -> list[Path]:
    """Write <run>.md (and <run>.json) into out_dir whole; -> the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    md = out_dir / f"{run}.md"
    md.write_text(report.rstrip("\n") + "\n")
    out = [md]
    if raw is not None:
        out.append(out_dir / f"{run}.json")
        out[-1].write_text(json.dumps(raw, indent=1) + "\n")
    return out


def add_run_arguments(ap: argparse.ArgumentParser) -> None:
    """The options every bench shares: where it works, whether the run goes to docs/, re-rendering a run."""
    from bench.common import DEFAULT_WORKDIR

    ap.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR)
    ap.add_argument("--no-doc", action="store_true", help="write the run into the workdir, not docs/bench/runs/")
    ap.add_argument("--rerender", action="store_true", help="rewrite a run's report from its JSON")
    ap.add_argument("--run", type=Path, help="with --rerender: the run's JSON (default: the newest in docs/bench/runs/)")


def parse(ap: argparse.ArgumentParser, argv: list[str] | None, what: str, render):
    """Parse a bench's options (with add_run_arguments'); with --rerender, rewrite the run's report and return None."""
    add_run_arguments(ap)
    args = ap.parse_args(argv)
    if args.rerender:
        print(f"wrote {rerender(what, render, args.run)}")
        return None
    return args


def start(what: str, module: str, argv: list[str] | None) -> dict:
    """A run's payload head: what ran, its UTC start, the host, the command."""
    import sys

    from bench.common import machine, utc_now

    return {"what": what, "date": utc_now(), "machine": machine(),
            "command": " ".join([f"python -m {module}", *(argv if argv is not None else sys.argv[1:])])}


def finish(payload: dict, what: str, render, sub: Path, quick: bool = False, no_doc: bool = False) -> list[Path]:
    """Write a finished run as <date>-<what>[-quick].{md,json}: into docs/bench/runs/ (RUNS), or for --quick and
    --no-doc into sub/runs; log and return the paths."""
    from bench.common import log

    run = stem(payload["date"], what + ("-quick" if quick else ""))
    out = write(sub / "runs" if (no_doc or quick) else RUNS, run, render(payload, run), payload)
    for p in out:
        log(f"wrote {p}")
    return out


def rerender(what: str, render, raw_json: Path | None = None) -> Path:
    """Rewrite a run's report from its JSON (default: the newest `what` in RUNS); render(payload, stem) -> text."""
    raw_json = raw_json or latest(RUNS, what)
    if raw_json is None:
        raise SystemExit(f"error: no {what} run in {RUNS}; run the bench first or pass --run JSON")
    return write(raw_json.parent, raw_json.stem, render(json.loads(raw_json.read_text()), raw_json.stem))[0]


def latest(out_dir: Path, what: str) -> Path | None:
    """The newest <stem>.json of `what` in out_dir (stems sort by date), or None."""
    found = sorted(p for p in out_dir.glob(f"*-{what}.json") if (m := STEM.match(p.stem)) and m.group(4) == what)
    return found[-1] if found else None


def summary(md: Path) -> tuple[str, str]:
    """(host, targets) of a run report: its Host line, and 'met N of M' from its Targets list (if any)."""
    text = md.read_text()
    host = next((ln[len("- Host: "):] for ln in text.splitlines() if ln.startswith("- Host: ")), "?")
    met = len(re.findall(r"^- MET: ", text, re.M))
    missed = len(re.findall(r"^- \*\*MISSED\*\*: ", text, re.M))
    return host, (f"met {met} of {met + missed}" if met + missed else "-")


def index(out_dir: Path) -> str:
    """A Markdown table of every run in out_dir, newest first."""
    lines = ["| run | host | targets |", "|---|---|---|"]
    for md in sorted((p for p in out_dir.glob("*.md") if STEM.match(p.stem)), reverse=True):
        host, targets = summary(md)
        lines.append(f"| [{md.stem}](runs/{md.name}) | {host} | {targets} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Print a Markdown index of the dated runs in a directory.")
    ap.add_argument("dir", nargs="?", type=Path, default=RUNS)
    print(index(ap.parse_args(argv).dir))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
