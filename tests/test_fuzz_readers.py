"""Fuzzing the two readers of the device's inputs (issue #31): the bundle reader (manifest + files) and the data
reader (.txt / .jsonl / .json). Random manifests, manifests with a field replaced by a random value, truncations
and byte flips of any file, random JSONL. The property: a clear one-line error of the reader's own kind
(BundleError, DataError: the CLI prints it and exits 2) or a correct load, never any other exception."""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ort_trainer import manifest as mf
from ort_trainer.bundle import BundleError, open_bundle
from ort_trainer.records import load_examples
from ort_trainer.tokenizer import DataError, TextTokenizer

FUZZ = settings(max_examples=60, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats(allow_nan=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)


# -- the bundle reader ------------------------------------------------------------------------------------------

FILES = {mf.TRAINING_MODEL: "training_model", mf.EVAL_MODEL: "eval_model", mf.OPTIMIZER_MODEL: "optimizer_model",
         mf.CHECKPOINT: "checkpoint", "weights-00001-of-00001.bin": "shard", "tokenizer/tokenizer.json": "tokenizer"}


@pytest.fixture(scope="module")
def bundle_dir(tmp_path_factory) -> Path:
    """A bundle's files (not real graphs: the reader checks the manifest and the bytes, ORT reads the graphs)."""
    d = tmp_path_factory.mktemp("bundle")
    files = []
    for k, (name, role) in enumerate(FILES.items()):
        (d / name).parent.mkdir(exist_ok=True)
        data = bytes(range(256)) * (k + 1)
        (d / name).write_bytes(data)
        files.append({"path": name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(), "role": role})
    man = {
        "family": "gpt2",
        "model": {"family": "gpt2", "architecture": "GPT2LMHeadModel", "num_layers": 2, "hidden_size": 64,
                  "vocab_size": 50257, "max_positions": 256, "tie_word_embeddings": True, "frozen_params": 100,
                  "source": "/ckpt"},
        "seq_len": 64, "traced_seq_len": 32, "opset": 17,
        "lora": {"r": 4, "alpha": 8.0, "dropout": 0.0, "targets": "attn", "target_modules": ["c_attn"],
                 "fan_in_fan_out": True},
        "optimizer": {"lr": 1e-3},
        "trainable": [{"onnx_name": "a.lora_A.weight", "peft_key": "a.lora_A.weight", "shape": [4, 64],
                       "transposed": False}],
        "inputs": [{"name": "input_ids", "dtype": "int64", "dims": ["batch", "seq"]}],
        "train_outputs": ["loss"], "eval_outputs": ["loss", "logits"],
        "loss": {}, "special_tokens": {}, "files": files, "tools": {}, "schema_version": mf.SCHEMA_VERSION,
    }
    (d / mf.MANIFEST_NAME).write_text(json.dumps(man, indent=1))
    open_bundle(d)                     # the pristine bundle loads
    return d


def _open(d: Path, verify: str):
    """open_bundle's answer: the Bundle, or its error. Anything else propagates (and fails the test)."""
    try:
        return open_bundle(d, verify=verify)
    except BundleError as exc:
        assert str(exc) and "\n" not in str(exc)
        return exc


@pytest.fixture
def copy(bundle_dir, tmp_path):
    def make() -> Path:
        d = tmp_path / "b"
        shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(bundle_dir, d)
        return d
    return make


@FUZZ
@given(value=json_values)
def test_random_manifest(copy, value):
    d = copy()
    (d / mf.MANIFEST_NAME).write_text(json.dumps(value))
    assert isinstance(_open(d, "hashes"), BundleError)


def _paths(obj, prefix=()):
    """Every path to a value in a JSON document."""
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, prefix + (i,))


@FUZZ
@given(data=st.data(), value=json_values)
def test_manifest_with_a_field_replaced_or_removed(copy, data, value):
    d = copy()
    man = json.loads((d / mf.MANIFEST_NAME).read_text())
    path = data.draw(st.sampled_from([p for p in _paths(man) if p]))
    parent = man
    for key in path[:-1]:
        parent = parent[key]
    if data.draw(st.booleans()):
        parent[path[-1]] = value
    elif isinstance(parent, dict):
        del parent[path[-1]]
    else:
        parent.pop(path[-1])
    (d / mf.MANIFEST_NAME).write_text(json.dumps(man))
    got = _open(d, data.draw(st.sampled_from(["hashes", "sizes"])))
    if not isinstance(got, BundleError):           # a correct load: what the manifest says, and files that verify
        assert got.manifest == mf.Manifest.from_dict(man)
        for entry in got.manifest.files:
            f = d / entry.path
            assert f.resolve().is_relative_to(d.resolve()) and f.stat().st_size == entry.bytes


@FUZZ
@given(data=st.data())
def test_truncated_or_flipped_file(copy, data):
    d = copy()
    name = data.draw(st.sampled_from([mf.MANIFEST_NAME, *FILES]))
    raw = bytearray((d / name).read_bytes())
    if data.draw(st.booleans()):
        raw = raw[: data.draw(st.integers(0, len(raw) - 1))]
    else:
        for at in data.draw(st.lists(st.integers(0, len(raw) - 1), min_size=1, max_size=3, unique=True)):
            raw[at] ^= data.draw(st.integers(1, 255))
    (d / name).write_bytes(bytes(raw))
    verify = data.draw(st.sampled_from(["hashes", "sizes"]))
    got = _open(d, verify)
    if name != mf.MANIFEST_NAME and not (verify == "sizes" and FILES[name] == "shard" and len(raw) == 256 * 5):
        assert isinstance(got, BundleError) and name in str(got)      # a damaged file is named
    # A damaged manifest may still parse (a flipped letter in a string): then it loads, and says so.


# -- the data reader ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tok(shared_data, tmp_path_factory):
    import transformers

    d = tmp_path_factory.mktemp("qwen_tok")     # has a chat template: chat records are read too
    transformers.AutoTokenizer.from_pretrained(str(shared_data / "tokenizers" / "qwen2.5")).save_pretrained(str(d))
    return TextTokenizer.from_dir(d)


def _load(path: Path, tok, seq_len: int):
    try:
        return load_examples(path, tok, seq_len)
    except DataError as exc:
        assert str(exc) and "\n" not in str(exc)
        return exc


def _valid(examples, report, seq_len: int, vocab: int) -> None:
    assert report.examples == len(examples) > 0
    for ex in examples:
        assert ex.input_ids.dtype == np.int64 and ex.labels.dtype == np.int64
        assert 1 <= len(ex.input_ids) == len(ex.labels) <= seq_len
        assert ((ex.input_ids >= 0) & (ex.input_ids < vocab)).all()
        assert ((ex.labels == -100) | (ex.labels == ex.input_ids)).all()


text_st = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=40)
record_st = st.one_of(
    json_values,
    st.fixed_dictionaries({"text": text_st}),
    st.fixed_dictionaries({"instruction": text_st, "output": text_st}, optional={"input": text_st}),
    st.fixed_dictionaries({"messages": st.lists(st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant", "tool", "other"]), "content": text_st}),
        max_size=4)}),
    st.dictionaries(st.sampled_from(["text", "instruction", "input", "output", "messages", "role"]), json_values,
                    max_size=3))


@FUZZ
@given(records=st.lists(record_st, max_size=6), seq_len=st.sampled_from([2, 3, 16, 64]), data=st.data())
def test_random_jsonl(tok, tmp_path, records, seq_len, data):
    lines = [json.dumps(r) for r in records]
    if lines and data.draw(st.booleans()):                        # and some damage
        k = data.draw(st.integers(0, len(lines) - 1))
        lines[k] = lines[k][: data.draw(st.integers(0, len(lines[k])))]
    p = tmp_path / "d.jsonl"
    p.write_text("\n".join(lines) + data.draw(st.sampled_from(["", "\n", "\n\n"])), encoding="utf-8")
    got = _load(p, tok, seq_len)
    if not isinstance(got, DataError):
        _valid(*got, seq_len, tok.tok.get_vocab_size())


@FUZZ
@given(records=st.lists(record_st, max_size=5), seq_len=st.sampled_from([2, 16, 64]))
def test_random_json_list(tok, tmp_path, records, seq_len):
    p = tmp_path / "d.json"
    p.write_text(json.dumps(records), encoding="utf-8")
    got = _load(p, tok, seq_len)
    if not isinstance(got, DataError):
        _valid(*got, seq_len, tok.tok.get_vocab_size())


@FUZZ
@given(raw=st.binary(max_size=300), ext=st.sampled_from([".txt", ".jsonl", ".json"]), seq_len=st.sampled_from([2, 8]))
def test_random_bytes(tok, tmp_path, raw, ext, seq_len):
    p = tmp_path / f"d{ext}"
    p.write_bytes(raw)
    got = _load(p, tok, seq_len)
    if not isinstance(got, DataError):
        _valid(*got, seq_len, tok.tok.get_vocab_size())


@FUZZ
@given(data=st.data())
def test_truncated_or_flipped_data_file(tok, tmp_path, data):
    good = [{"instruction": "Name a color.", "output": "Blue."}, {"text": "Plain text for the model."},
            {"messages": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}]}]
    raw = bytearray("".join(json.dumps(r) + "\n" for r in good).encode())
    if data.draw(st.booleans()):
        raw = raw[: data.draw(st.integers(0, len(raw)))]
    else:
        for at in data.draw(st.lists(st.integers(0, len(raw) - 1), min_size=1, max_size=3, unique=True)):
            raw[at] ^= data.draw(st.integers(1, 255))
    p = tmp_path / "d.jsonl"
    p.write_bytes(bytes(raw))
    got = _load(p, tok, 64)
    if not isinstance(got, DataError):
        _valid(*got, 64, tok.tok.get_vocab_size())
