"""eval/notebooks/parity.ipynb runs headless (nbclient, kernel python3) on a tiny parity report."""
from __future__ import annotations

import json

import pytest

from eval.parity import run_parity
from tests.bundle_helpers import build_tiny_bundle
from tests.conftest import REPO
from tests.test_eval_ort import write_mmlu
from tests.test_parity import parity_config, write_texts

NOTEBOOK = REPO / "eval" / "notebooks" / "parity.ipynb"


@pytest.fixture(scope="module")
def tiny_report(tmp_path_factory, shared_data):
    """A real parity run, kept small: 4 steps, a short held-out text, 2 MMLU subjects x 3 questions, 1 shot."""
    root = tmp_path_factory.mktemp("notebook")
    _, bundle = build_tiny_bundle("gpt2", root)
    train, heldout = write_texts(root, shared_data)
    mmlu = write_mmlu(root / "mmlu")
    cfg = parity_config(bundle, train, heldout, root / "report", steps=4, warmup=1, heldout_max_tokens=200,
                        mmlu_data=str(mmlu), shots=1, mmlu_split="test", isolate=False)
    report = run_parity(cfg, log=lambda *_: None)
    return root / "report", report


def test_notebook_executes_on_a_report(tiny_report, monkeypatch):
    import nbformat
    from nbclient import NotebookClient

    report_dir, report = tiny_report
    assert (report_dir / "mmlu_per_subject.png").is_file()
    assert {c["name"] for c in report["checks"]} >= {"mmlu_base_points_diff", "mmlu_finetuned_points_diff"}
    monkeypatch.setenv("POCKETLORA_REPORT", str(report_dir))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(nb, kernel_name="python3", timeout=180,
                   resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()

    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    markdown = "\n".join(o.get("data", {}).get("text/markdown", "") for o in outputs)
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(images) == 2                                  # loss curves (+ rel diff) and MMLU per subject
    overall = "PASS" if report["pass"] else "FAIL"
    assert f"**Overall: {overall}**" in markdown
    for check in json.loads((report_dir / "report.json").read_text())["checks"]:
        assert check["name"] in markdown
    assert "ppl via ORT" in markdown and "micro %" in markdown and "peak RSS MiB" in markdown
