"""The phone runner's decoder (android_runner/web/src/decoder.mjs, onnxruntime-web WASM in Node) against the Python
device decoder (ort_trainer/decoder.py) and so against transformers (tests/test_decoder.py): a run trained in WASM,
its adapter applied by both, greedy tokens identical over left-padded prompts of different lengths."""
from __future__ import annotations

import json
import subprocess

import pytest

from tests.conftest import WEB
from tests.test_web_parity import finish, node_train, web_bundle


@pytest.mark.parametrize("family, quant", [("qwen2", "none"), ("gemma3", "int4")])
def test_web_generate_matches_python_generate_with_a_web_trained_adapter(family, quant, tmp_path, node_web):
    from pocketlora_cli import main

    bundle = web_bundle(tmp_path, family, quant)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"instruction": f"say {w}", "output": f"{w} {w} {w}"}) + "\n"
                            for w in "red green blue amber violet teal".split() * 4))
    run = tmp_path / "web-run"
    finish(node_train(node_web, bundle, data, run, 4, lr=5e-2, warmup=0))
    prompts = ["say red", "a longer prompt than the first one, to pad the other rows", "x"]
    argv = ["generate", "--bundle", str(bundle), "--run", str(run), "--greedy", "--max-new-tokens", "16", "--json"]
    for p in prompts:
        argv += ["--prompt", p]
    node = subprocess.run(["node", str(WEB / "cli.mjs"), *argv, "--threads", "1"], capture_output=True, text=True,
                          timeout=600)
    assert node.returncode == 0, node.stderr
    web_rows = [json.loads(line) for line in node.stdout.splitlines()]
    import io
    from contextlib import redirect_stdout

    buf = io.StringIO()
    with redirect_stdout(buf):
        assert main(argv) == 0
    py_rows = [json.loads(line) for line in buf.getvalue().splitlines()]
    assert len(web_rows) == len(py_rows) == 3
    assert [r["token_ids"] for r in web_rows] == [r["token_ids"] for r in py_rows]
    assert [r["text"] for r in web_rows] == [r["text"] for r in py_rows]
    assert any(r["token_ids"] for r in py_rows)
