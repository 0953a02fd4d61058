"""Bad input to `pocketlora gen`: a clear message naming the problem and the fix, and no files left behind."""
from __future__ import annotations

import json

import pytest

from pocketlora_cli import main
from tests.tiny_models import make_tiny_checkpoint


@pytest.fixture(scope="module")
def gpt2_ckpt(tmp_path_factory):
    return make_tiny_checkpoint("gpt2", tmp_path_factory.mktemp("ck") / "gpt2")


def _gen(capsys, *args) -> tuple[int, str]:
    code = main(["gen", *map(str, args)])
    return code, capsys.readouterr().err


def _nothing_left(parent, out):
    assert not out.exists()
    assert not [p for p in parent.iterdir() if ".partial-" in p.name]


def test_unsupported_architecture_lists_supported(tmp_path, capsys):
    src = tmp_path / "bert"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"architectures": ["BertForMaskedLM"], "model_type": "bert"}))
    code, err = _gen(capsys, "--model", src, "--out", tmp_path / "b")
    assert code == 2
    assert "BertForMaskedLM is not supported" in err
    for name in ("GPT2LMHeadModel", "Qwen2ForCausalLM", "Gemma3ForCausalLM"):
        assert name in err
    _nothing_left(tmp_path, tmp_path / "b")


def test_missing_config(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    code, err = _gen(capsys, "--model", tmp_path / "empty", "--out", tmp_path / "b")
    assert code == 2 and "no config.json" in err
    _nothing_left(tmp_path, tmp_path / "b")


def test_seq_len_above_positions(gpt2_ckpt, tmp_path, capsys):
    code, err = _gen(capsys, "--model", gpt2_ckpt, "--out", tmp_path / "b", "--seq-len", 512)
    assert code == 2 and "--seq-len 512 is above the model's 256 positions" in err
    _nothing_left(tmp_path, tmp_path / "b")


def test_unknown_target_module(gpt2_ckpt, tmp_path, capsys):
    code, err = _gen(capsys, "--model", gpt2_ckpt, "--out", tmp_path / "b", "--targets", "q_proj")
    assert code == 2 and "no linear layer named 'q_proj'" in err and "c_attn" in err
    _nothing_left(tmp_path, tmp_path / "b")


def test_failure_late_in_the_build_leaves_nothing(gpt2_ckpt, tmp_path, monkeypatch):
    import artifacts_gen.build as build

    def boom(*args, **kwargs):
        raise RuntimeError("simulated failure after export and shards")

    monkeypatch.setattr(build, "_generate_artifacts", boom)
    with pytest.raises(RuntimeError, match="simulated"):
        main(["gen", "--model", str(gpt2_ckpt), "--out", str(tmp_path / "b")])
    _nothing_left(tmp_path, tmp_path / "b")


def test_tensor_above_shard_size_gets_its_own_shard(gpt2_ckpt, tmp_path, capsys):
    import json

    assert _gen(capsys, "--model", gpt2_ckpt, "--out", tmp_path / "b", "--shard-mb", 1)[0] == 0
    files = json.loads((tmp_path / "b" / "manifest.json").read_text())["files"]
    shards = [f for f in files if f["role"] == "shard"]
    assert len(shards) > 1
    assert sum(f["bytes"] > 2**20 for f in shards) == 1     # only the 12 MB embedding's own shard is over


def test_out_holding_another_bundle_is_refused_and_kept(gpt2_ckpt, tmp_path, capsys):
    out = tmp_path / "b"
    assert _gen(capsys, "--model", gpt2_ckpt, "--out", out, "--seq-len", 32)[0] == 0
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    code, err = _gen(capsys, "--model", gpt2_ckpt, "--out", out, "--lora-r", 2)
    assert code == 2 and "already holds a gpt2 bundle" in err and "--force" in err
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before
    assert not [p for p in tmp_path.iterdir() if ".partial-" in p.name]
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "notes.txt").write_text("mine")
    code, err = _gen(capsys, "--model", gpt2_ckpt, "--out", tmp_path / "junk")
    assert code == 2 and "not empty" in err and (tmp_path / "junk" / "notes.txt").read_text() == "mine"


def test_ort_native_log_is_captured_and_shown_on_failure(gpt2_ckpt, tmp_path, monkeypatch, capfd):
    """ORT's gradient builder logs ~350 INFO lines to fd 2 whatever the Python severity: they go to a
    file during the build, and only a failure brings their tail (with the error) back."""
    import os

    from onnxruntime.training import artifacts

    real = artifacts.generate_artifacts

    def noisy(*args, **kwargs):
        os.write(2, b"native INFO line from the gradient builder\n")
        return real(*args, **kwargs)

    monkeypatch.setattr(artifacts, "generate_artifacts", noisy)
    assert main(["gen", "--model", str(gpt2_ckpt), "--out", str(tmp_path / "ok")]) == 0
    assert "native INFO line" not in capfd.readouterr().err
    assert not list((tmp_path / "ok").rglob("*.log"))

    def failing(*args, **kwargs):
        os.write(2, b"native ERROR: gradient for op Foo is not registered\n")
        raise RuntimeError("generate_artifacts failed")

    monkeypatch.setattr(artifacts, "generate_artifacts", failing)
    with pytest.raises(RuntimeError, match="(?s)generate_artifacts failed.*gradient for op Foo"):
        main(["gen", "--model", str(gpt2_ckpt), "--out", str(tmp_path / "b")])
    _nothing_left(tmp_path, tmp_path / "b")


def test_gguf_parsed_once_within_a_load(tmp_path):
    """Inside load_source's block every GGUFReader construction of one file returns the same parse (the
    real reader runs once); outside it the real class is back."""
    import gguf
    import numpy as np

    from artifacts_gen.source import gguf_parsed_once

    path = tmp_path / "tiny.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint32("test.n", 7)
    w.add_tensor("t", np.arange(4, dtype=np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()

    real = gguf.GGUFReader
    with gguf_parsed_once():
        from gguf import GGUFReader   # as transformers and read_spm_vocab import it: at call time

        a, b = GGUFReader(str(path)), gguf.GGUFReader(str(tmp_path / "." / "tiny.gguf"))
        assert a is b and isinstance(a, real) and int(a.fields["test.n"].parts[-1][0]) == 7
    assert gguf.GGUFReader is real and gguf.GGUFReader(str(path)) is not a


def test_gemma3_gate_proj_refused_and_all_linear_builds_without_it(tmp_path, capsys):
    """ORT 1.19 cannot build the gradient graph for LoRA on Gemma3's gate_proj: refused before export with
    the fix; all-linear leaves gate_proj out and builds (ORT's gradient builder really runs here)."""
    from ort_trainer.manifest import Manifest

    ckpt = make_tiny_checkpoint("gemma3", tmp_path / "ck")
    code, err = _gen(capsys, "--model", ckpt, "--out", tmp_path / "b", "--targets", "gate_proj,down_proj")
    assert code == 2 and "'gate_proj'" in err and "RemoveEdge" in err
    assert "--targets q_proj,k_proj,v_proj,o_proj,up_proj,down_proj" in err
    _nothing_left(tmp_path, tmp_path / "b")

    assert main(["gen", "--model", str(ckpt), "--out", str(tmp_path / "all"), "--targets", "all-linear",
                 "--seq-len", "32"]) == 0
    mods = set(Manifest.load(tmp_path / "all").lora.target_modules)
    assert mods == {"q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj"}
