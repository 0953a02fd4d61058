"""bench/runs.py and the run files in docs/bench/runs: every result is a dated run, and a run's report is what the
renderer makes of its JSON (rendering is apart from running, so any run re-renders to the same bytes)."""
from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

from bench import runs
from bench.common import RUNS

DOCS = Path(__file__).resolve().parents[1] / "docs"


def test_stem_names_a_run_by_its_utc_start_and_what_ran(tmp_path):
    assert runs.stem("2026-12-03 09:13 UTC", "train-throughput") == "2026-12-03T0913Z-train-throughput"
    for name in ("2026-12-03T0913Z-train-throughput", "2026-12-03T0839Z-train-throughput",
                 "2026-12-04T0100Z-train-throughput-quick", "2026-12-04T0200Z-gen-real-shapes"):
        (tmp_path / f"{name}.json").write_text("{}")
    assert runs.latest(tmp_path, "train-throughput").stem == "2026-12-03T0913Z-train-throughput"
    assert runs.latest(tmp_path, "label-positions") is None


def test_docs_hold_dated_runs_only():
    assert not [p.name for p in DOCS.glob("bench_*")], "results belong in docs/bench/runs/, named by date"
    undated = [p.name for p in RUNS.iterdir() if not runs.STEM.match(p.stem)]
    assert not undated
    for md in RUNS.glob("*.md"):
        assert md.read_text().startswith("# ") and "\n- Host: " in md.read_text(), md.name


def _rendered(raw: Path) -> str:
    p = json.loads(raw.read_text())
    what = runs.STEM.match(raw.stem).group(4)
    if what == "train-throughput":
        from bench.throughput.render import render_report
        from bench.throughput.summary import summarize_payload

        summarize_payload(p)
        return render_report(p, raw.stem)
    if what == "gen-real-shapes":
        from bench.gen_real_shapes_render import render_report

        return render_report(p.pop("results"), p, raw.stem)
    module = {"quant-quality": "bench.quant_quality_render", "quant-base": "bench.quant_base_render",
              "web-vs-native": "bench.web_vs_native_render", "decode": "bench.decode_render",
              "federated": "bench.federated_render", "dequant-kernels": "bench.dequant_kernels_render"}.get(what,
                                                                                                  "bench.label_positions")
    return importlib.import_module(module).render_report(p, raw.stem)


@pytest.mark.parametrize("raw", [p for p in sorted(RUNS.glob("*.json"))
                                 if "converted on" not in p.with_suffix(".md").read_text()], ids=lambda p: p.stem)
def test_a_run_re_renders_to_its_report(raw):
    """Runs the current renderer wrote (converted runs keep the tables of the renderer of their day)."""
    assert _rendered(raw).rstrip("\n") + "\n" == raw.with_suffix(".md").read_text()      # as runs.write writes it


@pytest.mark.parametrize("split", ["3x3", "2x2", "0x8", "2x4x1", "twoxfour"])
def test_quant_base_refuses_a_split_that_is_not_of_the_effective_batch_8(split, capsys, tmp_path):
    """`bench.quant_base --split MxA` compares against the goals at effective batch 8: any other product, or text
    that is not MxA, stops at the command line with one line naming it, before a bundle is built."""
    from bench import quant_base

    with pytest.raises(SystemExit) as exc:
        quant_base.main(["--split", split, "--quick", "--no-doc", "--workdir", str(tmp_path), "--shapes", "no-such"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"argument --split: {split!r}" in err and "Traceback" not in err
