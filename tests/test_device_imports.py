"""The device packages must run without torch or transformers (issue: device training loop)."""
from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.bundle_helpers import build_tiny_bundle
from tests.conftest import REPO

BLOCK = textwrap.dedent("""
    import sys
    for name in ("torch", "transformers", "peft", "optimum"):
        sys.modules[name] = None     # as if not installed: import fails, find_spec answers None
""")

def test_device_trains_and_exports_without_torch(tmp_path, shared_data):
    _, bundle = build_tiny_bundle("gpt2", tmp_path)
    data = tmp_path / "d.txt"
    data.write_text("\n".join((shared_data / "wikitext2" / "valid.txt").read_text().splitlines()[:60]))
    script = BLOCK + textwrap.dedent(f"""
        import pocketlora_cli
        assert pocketlora_cli.main(["train", "--bundle", {str(bundle)!r}, "--data", {str(data)!r},
            "--out", {str(tmp_path / 'run')!r}, "--max-steps", "3", "--battery", "none", "--accum", "2"]) == 0
        assert pocketlora_cli.main(["export", "--run", {str(tmp_path / 'run')!r},
            "--peft", {str(tmp_path / 'peft')!r}, "--onnx", {str(tmp_path / 'm.onnx')!r}]) == 0
        import android_runner.loop, android_runner.probes, android_runner.gate, android_runner.metrics
        import ort_trainer.tokenizer, ort_trainer.records, ort_trainer.batching, ort_trainer.session, ort_trainer.adapter, ort_trainer.checkpoint
        bad = [m for m, mod in sys.modules.items() if mod is not None and m.split(".")[0] in ("torch", "transformers", "peft")]
        assert not bad, bad
        print("DEVICE-OK")
    """)
    res = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert "DEVICE-OK" in res.stdout, res.stdout[-2000:] + res.stderr[-4000:]
    assert (tmp_path / "peft" / "adapter_model.safetensors").is_file()


def test_cli_train_does_not_load_torch_even_where_installed(tmp_path, shared_data):
    """onnxruntime-training's `import onnxruntime` imports torch whenever it is installed; `pocketlora train`
    keeps it out, so a workstation run measures what a phone would (torch is installed in this environment)."""
    import json

    _, bundle = build_tiny_bundle("gpt2", tmp_path)
    data = tmp_path / "d.txt"
    data.write_text("\n".join((shared_data / "wikitext2" / "valid.txt").read_text().splitlines()[:60]))
    run = tmp_path / "run"
    res = subprocess.run([sys.executable, "-m", "pocketlora_cli", "train", "--bundle", str(bundle), "--data", str(data),
                          "--out", str(run), "--max-steps", "2", "--battery", "none", "--accum", "2"],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert json.loads((run / "summary.json").read_text())["torch_in_process"] is False
