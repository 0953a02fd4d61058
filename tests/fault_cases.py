"""The fault catalogue: every fault class `pocketlora` was tried against, with what it must answer.

Each case damages a copy of a tiny checkpoint, bundle, data file or run (or makes the disk full or read-only),
runs the CLI in this process, and checks: the exit code (2: the input, 3: the environment), that stderr ends in
one line `pocketlora VERB: error: ...` naming the file, that no traceback was printed, and what survived.
tests/test_faults.py runs the cases; `python -m tests.fault_cases` runs them all (slow ones too) and prints the
table of docs/FAULTS.md.

Full disks and read-only outputs are injected (`FullDisk`, `read_only`) so the cases run anywhere, without
root: Python's own writes fail as a full disk's do (part of the data written, then ENOSPC), and ORT's native
checkpoint writer raises the RuntimeError that ORT 1.19.2 raises on a full tmpfs (its text copied from one).
tests/test_faults.py also runs train and gen on a real small tmpfs where mounting is permitted.
"""
from __future__ import annotations

import builtins
import contextlib
import errno
import io
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ENOSPC_ORT = ("/onnxruntime_src/orttraining/orttraining/python/orttraining_pybind_state.cc:937 onnxruntime::python::"
              "addObjectMethodsForTraining(pybind11::module&)::<lambda(onnxruntime::training::api::CheckpointState*, "
              "const std::string&, bool)> [ONNXRuntimeError] : 1 : FAIL : checkpoint.cc:231 ToFile Failed to save "
              "checkpoint to file: {path}. error:No space left on device errno:28")


# -- fault injection ------------------------------------------------------------------------------------------

class FullDisk:
    """Writes under `root` succeed until `writes` of them were made, then every one fails with ENOSPC, part of
    its data written first, as on a full disk. A write is a file opened for writing (its first write call), or
    one write call on a file opened for appending (metrics.jsonl, a line each). `log` records (label, failed)."""

    def __init__(self, root: Path, writes: int):
        self.root, self.left, self.log = str(Path(root).resolve()), writes, []

    def take(self, label: str) -> bool:
        """True if this write fails."""
        self.left -= 1
        self.log.append((label, self.left < 0))
        return self.left < 0

    def under(self, path) -> bool:
        try:
            return str(Path(os.fsdecode(path)).resolve()).startswith(self.root)
        except (TypeError, ValueError):
            return False

    def install(self, monkeypatch) -> "FullDisk":
        from safetensors import numpy as st_numpy

        from ort_trainer.ort_training import CheckpointState

        real_open, disk = builtins.open, self

        def fake_open(file, mode="r", *args, **kwargs):
            f = real_open(file, mode, *args, **kwargs)
            if isinstance(mode, str) and any(c in mode for c in "wax+") and not isinstance(file, int) \
                    and disk.under(file):
                return _FailingWriter(f, disk, _label(file), appending="a" in mode)
            return f

        real_save = CheckpointState.save_checkpoint

        def save_checkpoint(state, path, include_optimizer_state=False):
            if disk.under(path) and disk.take(Path(path).name):
                with real_open(path, "wb") as f:
                    f.write(b"\0" * 100)              # ORT's partial file
                raise RuntimeError(ENOSPC_ORT.format(path=os.fspath(path)))
            return real_save(state, path, include_optimizer_state)

        real_save_file = st_numpy.save_file

        def save_file(tensors, filename, metadata=None):
            if disk.under(filename) and disk.take(Path(filename).name):
                from safetensors import SafetensorError

                raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
            return real_save_file(tensors, filename, metadata=metadata)

        monkeypatch.setattr(builtins, "open", fake_open)
        monkeypatch.setattr(io, "open", fake_open)
        monkeypatch.setattr(CheckpointState, "save_checkpoint", staticmethod(save_checkpoint))
        monkeypatch.setattr(st_numpy, "save_file", save_file)
        return self


def _label(path) -> str:
    """The file a write is for: write_atomic's temporary `.NAME.tmp-PID` is NAME's."""
    return re.sub(r"^\.(.*)\.tmp-\d+$", r"\1", Path(os.fsdecode(path)).name)


class _FailingWriter:
    def __init__(self, f, disk: FullDisk, label: str, appending: bool):
        self._f, self._disk, self._label, self._appending, self._counted = f, disk, label, appending, False

    def write(self, data):
        if self._appending or not self._counted:
            self._counted = True
            if self._disk.take(self._label):
                self._f.write(data[: len(data) // 2])
                with contextlib.suppress(OSError):
                    self._f.flush()
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        elif self._disk.left < 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return self._f.write(data)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()

    def __iter__(self):
        return iter(self._f)

    def __getattr__(self, name):
        return getattr(self._f, name)


def read_only(monkeypatch, root: Path) -> None:
    """Creating anything under `root` fails with EROFS, as on a read-only mount."""
    import tempfile

    root = str(Path(root).resolve())
    real_open, real_mkdir, real_mkdtemp = builtins.open, os.mkdir, tempfile.mkdtemp

    def under(path) -> bool:
        return str(Path(os.fsdecode(path)).resolve()).startswith(root)

    def refuse(path):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fsdecode(path))

    def fake_open(file, mode="r", *args, **kwargs):
        if isinstance(mode, str) and any(c in mode for c in "wax+") and not isinstance(file, int) and under(file):
            refuse(file)
        return real_open(file, mode, *args, **kwargs)

    def fake_mkdir(path, *args, **kwargs):
        if under(path) and not os.path.isdir(path):
            refuse(path)
        return real_mkdir(path, *args, **kwargs)

    def fake_mkdtemp(suffix=None, prefix=None, dir=None):
        if dir is not None and under(dir):
            refuse(Path(dir) / f"{prefix or ''}XXXXXX")
        return real_mkdtemp(suffix, prefix, dir)

    monkeypatch.setattr(builtins, "open", fake_open)
    monkeypatch.setattr(io, "open", fake_open)
    monkeypatch.setattr(os, "mkdir", fake_mkdir)
    monkeypatch.setattr(tempfile, "mkdtemp", fake_mkdtemp)


# -- the world the cases damage copies of ------------------------------------------------------------------------

TRAIN = ["--micro-batch", "2", "--accum", "1", "--save-every", "2", "--battery", "none", "--threads", "1"]
STEPS = 4


@dataclass
class World:
    ckpt: Path        # tiny GPT-2 checkpoint directory (safetensors + tokenizer)
    bundle: Path      # its bundle
    data: Path        # a text file
    run: Path         # a finished run of STEPS steps (checkpoints at 2 and 4)


def make_world(root: Path) -> World:
    from pocketlora_cli import main
    from tests.bundle_helpers import build_tiny_bundle
    from tests.conftest import SHARED_DATA

    root.mkdir(parents=True, exist_ok=True)
    ckpt, bundle = build_tiny_bundle("gpt2", root)
    data = root / "train.txt"
    data.write_text("\n".join((SHARED_DATA / "wikitext2" / "valid.txt").read_text().splitlines()[:120]))
    run = root / "run"
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(train_argv(bundle, data, run)) == 0
    return World(ckpt, bundle, data, run)


def train_argv(bundle, data, out, steps: int = STEPS) -> list[str]:
    return ["train", "--bundle", str(bundle), "--data", str(data), "--out", str(out), "--max-steps", str(steps), *TRAIN]


class Ctx:
    """One case's scratch directory and copies of the world to damage."""

    def __init__(self, world: World, tmp: Path, monkeypatch):
        self.w, self.tmp, self.mp = world, tmp, monkeypatch
        self.notes: dict = {}

    def ckpt(self) -> Path:
        d = self.tmp / "ckpt"
        shutil.copytree(self.w.ckpt, d)
        return d

    def bundle(self) -> Path:
        d = self.tmp / "bundle"
        shutil.copytree(self.w.bundle, d)
        return d

    def data(self, text: str | bytes | None = None, name: str = "train.txt") -> Path:
        p = self.tmp / name
        if text is None:
            shutil.copy(self.w.data, p)
        elif isinstance(text, bytes):
            p.write_bytes(text)
        else:
            p.write_text(text)
        return p

    def run(self, bundle: Path | None = None, data: Path | None = None, drop_newest: bool = True) -> Path:
        """A copy of the finished run, pointing at `bundle` and `data`; without its newest checkpoint, so that a
        resume has steps to train."""
        r = self.tmp / "run"
        shutil.copytree(self.w.run, r)
        cfg = json.loads((r / "run.json").read_text())
        cfg.update(bundle=str(bundle or self.w.bundle), data=str(data or self.w.data))
        (r / "run.json").write_text(json.dumps(cfg))
        if drop_newest:
            shutil.rmtree(sorted((r / "checkpoints").glob("step-*"))[-1])
        return r


def truncate(path: Path, keep: float | int) -> None:
    b = path.read_bytes()
    path.write_bytes(b[: int(len(b) * keep) if isinstance(keep, float) else keep])


def flip(path: Path, at: int) -> None:
    b = bytearray(path.read_bytes())
    b[at % len(b)] ^= 0xFF
    path.write_bytes(bytes(b))


def edit_json(path: Path, **changes) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def gguf_file(d: Path, damage: Callable[[bytes], bytes]) -> None:
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(d / "m.gguf"), "llama")
    w.add_uint32("test.n", 7)
    w.add_tensor("t", np.arange(4096, dtype=np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    (d / "m.gguf").write_bytes(damage((d / "m.gguf").read_bytes()))


def latest_step(run: Path) -> int | None:
    from ort_trainer import checkpoint

    found = checkpoint.latest(run, warn=lambda *_: None)
    return found[1]["step"] if found else None


def nothing_beside(parent: Path, name: str) -> None:
    """No staging or partial directory of `name` is left in `parent`."""
    left = [p.name for p in parent.iterdir() if p.name.startswith(f".{name}.")]
    assert not left, left


# -- the cases ------------------------------------------------------------------------------------------------

@dataclass
class Case:
    verb: str
    fault: str
    setup: Callable[[Ctx], list[str]]      # damages copies, returns the argv
    code: int
    says: str                              # a part of the one-line message
    survived: str                          # what survived, for the table
    check: Callable[[Ctx], None] | None = None
    slow: bool = False                     # not in the default test run (the docs table runs it)


CASES: dict[str, Case] = {}


def case(name: str, verb: str, fault: str, code: int, says: str, survived: str, check=None, slow=False):
    def register(setup):
        CASES[name] = Case(verb, fault, setup, code, says, survived, check, slow)
        return setup
    return register


def _gen(ctx: Ctx, model: Path, *extra: str) -> list[str]:
    ctx.notes["out"] = ctx.tmp / "out"
    return ["gen", "--model", str(model), "--out", str(ctx.notes["out"]), "--seq-len", "32", *extra]


def _gen_left_nothing(ctx: Ctx) -> None:
    assert not ctx.notes["out"].exists()
    nothing_beside(ctx.tmp, "out")


GEN_NOTHING = "nothing written; the checkpoint untouched"


# gen: the checkpoint ------------------------------------------------------------------------------------------

@case("gen-no-model", "gen", "--model directory missing", 2, "not a directory", GEN_NOTHING, _gen_left_nothing)
def _(ctx):
    return _gen(ctx, ctx.tmp / "nope")


@case("gen-no-config", "gen", "config.json missing", 2, "no config.json", GEN_NOTHING, _gen_left_nothing)
def _(ctx):
    d = ctx.ckpt()
    (d / "config.json").unlink()
    return _gen(ctx, d)


@case("gen-config-truncated", "gen", "config.json truncated", 2, "config.json: not valid JSON", GEN_NOTHING,
      _gen_left_nothing)
def _(ctx):
    d = ctx.ckpt()
    truncate(d / "config.json", 0.5)
    return _gen(ctx, d)


@case("gen-config-list", "gen", "config.json not a JSON object", 2, "config.json: holds a JSON list", GEN_NOTHING,
      _gen_left_nothing)
def _(ctx):
    d = ctx.ckpt()
    (d / "config.json").write_text("[1, 2]")
    return _gen(ctx, d)


@case("gen-config-type", "gen", "config.json: a size field of the wrong type", 2,
      "hidden_size is 'wide', not a positive integer", GEN_NOTHING, _gen_left_nothing)
def _(ctx):
    d = ctx.ckpt()
    edit_json(d / "config.json", n_embd="wide")
    return _gen(ctx, d)


@case("gen-config-more-layers", "gen", "config.json describes more layers than the weights hold", 2,
      "lack 12 tensor(s) config.json needs", GEN_NOTHING + " (transformers would have initialised them at random)",
      _gen_left_nothing)
def _(ctx):
    d = ctx.ckpt()
    edit_json(d / "config.json", n_layer=3)
    return _gen(ctx, d)


@case("gen-config-width", "gen", "config.json of another width than the weights", 2,
      "do not have the shapes config.json describes", GEN_NOTHING, _gen_left_nothing)
def _(ctx):
    d = ctx.ckpt()
    edit_json(d / "config.json", n_embd=32)
    return _gen(ctx, d)


@case("gen-safetensors-truncated", "gen", "model.safetensors truncated (issue #31, 1)", 2,
      "model.safetensors: 6667172 bytes, its header describes 13334344 (truncated)", GEN_NOTHING, _gen_left_nothing)
def _(ctx):
    d = ctx.ckpt()
    truncate(d / "model.safetensors", 0.5)
    return _gen(ctx, d)


@case("gen-safetensors-empty", "gen", "model.safetensors empty", 2, "too short to be a safetensors file",
      GEN_NOTHING, _gen_left_nothing)
def _(ctx):
    d = ctx.ckpt()
    truncate(d / "model.safetensors", 0)
    return _gen(ctx, d)


@case("gen-safetensors-header-flip", "gen", "model.safetensors: a flipped byte in its header", 2,
      "its safetensors header is not valid JSON", GEN_NOTHING, _gen_left_nothing)
def _(ctx):
    d = ctx.ckpt()
    flip(d / "model.safetensors", 20)
    return _gen(ctx, d)


@case("gen-safetensors-random", "gen", "model.safetensors random bytes", 2, "truncated, or not a safetensors file",
      GEN_NOTHING, _gen_left_nothing)
def _(ctx):
    d = ctx.ckpt()
    (d / "model.safetensors").write_bytes(os.urandom(4096))
    return _gen(ctx, d)


@case("gen-index-missing-shard", "gen", "sharded checkpoint with a weight file missing", 2,
      "model-00002-of-00002.safetensors, which is not in", GEN_NOTHING, _gen_left_nothing)
def _(ctx):
    d = ctx.ckpt()
    (d / "model.safetensors").rename(d / "model-00001-of-00002.safetensors")
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "transformer.wte.weight": "model-00001-of-00002.safetensors",
        "transformer.h.1.ln_1.weight": "model-00002-of-00002.safetensors"}}))
    return _gen(ctx, d)


@case("gen-no-weights", "gen", "no weight files", 2, "config.json but no weights", GEN_NOTHING, _gen_left_nothing)
def _(ctx):
    d = ctx.ckpt()
    (d / "model.safetensors").unlink()
    return _gen(ctx, d)


@case("gen-tokenizer-truncated", "gen", "tokenizer.json truncated", 2, "tokenizer.json: not a readable tokenizer",
      GEN_NOTHING, _gen_left_nothing)
def _(ctx):
    d = ctx.ckpt()
    truncate(d / "tokenizer.json", 0.5)
    return _gen(ctx, d)


@case("gen-tokenizer-structure", "gen", "tokenizer.json valid JSON of the wrong structure", 2,
      "tokenizer.json: not a readable tokenizer", GEN_NOTHING, _gen_left_nothing)
def _(ctx):
    d = ctx.ckpt()
    (d / "tokenizer.json").write_text('{"model": 7}')
    return _gen(ctx, d)


@case("gen-tokenizer-config", "gen", "tokenizer_config.json truncated", 2, "tokenizer_config.json: not valid JSON",
      GEN_NOTHING, _gen_left_nothing)
def _(ctx):
    d = ctx.ckpt()
    truncate(d / "tokenizer_config.json", 0.5)
    return _gen(ctx, d)


@case("gen-no-tokenizer", "gen", "no tokenizer files", 2, "no tokenizer files", GEN_NOTHING, _gen_left_nothing)
def _(ctx):
    d = ctx.ckpt()
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "special_tokens_map.json"):
        (d / name).unlink(missing_ok=True)
    return _gen(ctx, d)


@case("gen-gguf-truncated", "gen", "GGUF file truncated", 2, "m.gguf: not a readable GGUF file", GEN_NOTHING,
      _gen_left_nothing)
def _(ctx):
    (ctx.tmp / "g").mkdir()
    gguf_file(ctx.tmp / "g", lambda b: b[: len(b) // 2])
    return _gen(ctx, ctx.tmp / "g")


@case("gen-gguf-random", "gen", "GGUF file of random bytes", 2, "GGUF magic invalid", GEN_NOTHING, _gen_left_nothing)
def _(ctx):
    (ctx.tmp / "g").mkdir()
    gguf_file(ctx.tmp / "g", lambda b: os.urandom(4096))
    return _gen(ctx, ctx.tmp / "g")


@case("gen-unsupported", "gen", "an unsupported architecture", 2, "is not supported", GEN_NOTHING, _gen_left_nothing)
def _(ctx):
    d = ctx.ckpt()
    edit_json(d / "config.json", architectures=["BertForMaskedLM"], model_type="bert")
    return _gen(ctx, d)


def _identical_check(ctx: Ctx) -> None:
    from ort_trainer.bundle import open_bundle

    open_bundle(ctx.notes["out"])     # complete, every hash verifies


@case("gen-identical-tensors", "gen", "frozen tensors of identical values: a freshly initialised GPT-2, every "
      "LayerNorm weight all ones (issue #31, 3)", 0, "", "builds: each equal tensor stays its own initializer "
      "(LoRA gradients match autograd: tests/test_faults.py)", _identical_check, slow=True)
def _(ctx):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.tiny_models import tiny_config

    d = ctx.tmp / "fresh"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config("gpt2")).save_pretrained(d)
    AutoTokenizer.from_pretrained(ctx.w.ckpt).save_pretrained(d)
    return _gen(ctx, d)


# gen: the environment ------------------------------------------------------------------------------------------

def _gen_env_check(ctx: Ctx) -> None:
    out = ctx.notes["out"]
    if ctx.notes.get("old"):
        from ort_trainer.bundle import open_bundle

        assert open_bundle(out).manifest.lora.r == 4         # the old bundle, whole
    else:
        assert not out.exists()
    nothing_beside(out.parent, out.name)


@case("gen-full-disk-shards", "gen", "disk full while the shards are written", 3,
      "no space left on the device writing", "--out as it was; the staging directory removed", _gen_env_check,
      slow=True)
def _(ctx):
    argv = _gen(ctx, ctx.w.ckpt)
    import artifacts_gen.build as build

    real = build.write_shards

    def write_shards(*args, **kwargs):
        FullDisk(ctx.tmp, 0).install(ctx.mp)
        return real(*args, **kwargs)
    ctx.mp.setattr(build, "write_shards", write_shards)
    return argv


@case("gen-full-disk-ort", "gen", "disk full while ORT writes the training artifacts (its native errno)", 3,
      "no space left on the device writing", "--out as it was; the staging directory removed", _gen_env_check,
      slow=True)
def _(ctx):
    argv = _gen(ctx, ctx.w.ckpt)
    from onnxruntime.training import artifacts

    def generate_artifacts(*args, **kwargs):
        raise RuntimeError(ENOSPC_ORT.format(path="checkpoint"))
    ctx.mp.setattr(artifacts, "generate_artifacts", generate_artifacts)
    return argv


@case("gen-full-disk-force", "gen", "disk full at the last write (manifest) of a --force rebuild", 3,
      "no space left on the device writing", "the old bundle in --out, whole", _gen_env_check, slow=True)
def _(ctx):
    argv = _gen(ctx, ctx.w.ckpt, "--force", "--lora-r", "2")
    shutil.copytree(ctx.w.bundle, ctx.notes["out"])
    ctx.notes["old"] = True
    from ort_trainer import manifest

    real = manifest.Manifest.save

    def save(self, bundle_dir):
        FullDisk(ctx.tmp, 0).install(ctx.mp)
        return real(self, bundle_dir)
    ctx.mp.setattr(manifest.Manifest, "save", save)
    return argv


@case("gen-read-only", "gen", "--out on a read-only file system", 3, "read-only file system",
      "nothing written", _gen_env_check)
def _(ctx):
    argv = _gen(ctx, ctx.w.ckpt)
    read_only(ctx.mp, ctx.tmp)
    return argv


# train: bundle, data, run -------------------------------------------------------------------------------------

def _no_run(ctx: Ctx) -> None:
    out = ctx.notes.get("out")
    assert out is None or not (out / "checkpoints").exists()


def _train_fresh(ctx: Ctx, bundle=None, data=None) -> list[str]:
    ctx.notes["out"] = ctx.tmp / "out"
    return train_argv(bundle or ctx.w.bundle, data or ctx.w.data, ctx.notes["out"])


def _resume(ctx: Ctx, bundle=None, data=None) -> list[str]:
    r = ctx.run(bundle, data)
    ctx.notes["run"] = r
    ctx.notes["before"] = sorted(p.name for p in (r / "checkpoints").iterdir())
    return train_argv(bundle or ctx.w.bundle, data or ctx.w.data, r)


def _run_kept(ctx: Ctx) -> None:
    r = ctx.notes["run"]
    assert sorted(p.name for p in (r / "checkpoints").iterdir()) == ctx.notes["before"]
    assert latest_step(r) == 2


RUN_KEPT = "the run's checkpoints untouched (a rerun once fixed resumes)"
NO_RUN = "nothing trained, nothing written"


@case("train-no-bundle", "train", "--bundle missing", 2, "no such bundle directory", NO_RUN, _no_run)
def _(ctx):
    return _train_fresh(ctx, bundle=ctx.tmp / "nope")


@case("train-no-manifest", "train", "manifest.json missing", 2, "manifest.json: no manifest", NO_RUN, _no_run)
def _(ctx):
    b = ctx.bundle()
    (b / "manifest.json").unlink()
    return _train_fresh(ctx, bundle=b)


@case("train-manifest-truncated", "train", "manifest.json truncated", 2, "manifest.json: not valid JSON", NO_RUN,
      _no_run)
def _(ctx):
    b = ctx.bundle()
    truncate(b / "manifest.json", 0.5)
    return _train_fresh(ctx, bundle=b)


@case("train-manifest-types", "train", "manifest.json with a field of the wrong type", 2,
      "trainable is 5, not of type list[Trainable]", NO_RUN, _no_run)
def _(ctx):
    b = ctx.bundle()
    edit_json(b / "manifest.json", trainable=5)
    return _train_fresh(ctx, bundle=b)


@case("train-shard-truncated", "train", "weight shard truncated", 2, "the manifest says", NO_RUN, _no_run)
def _(ctx):
    b = ctx.bundle()
    truncate(next(b.glob("weights-*")), 0.5)
    return _train_fresh(ctx, bundle=b)


@case("train-shard-flip", "train", "weight shard: one flipped byte (first start)", 2,
      "sha256 does not match the manifest", NO_RUN, _no_run)
def _(ctx):
    b = ctx.bundle()
    flip(next(b.glob("weights-*")), 12345)
    return _train_fresh(ctx, bundle=b)


@case("train-graph-flip-resume", "train", "training graph: one flipped byte, found on resume", 2,
      "training_model.onnx: sha256 does not match", RUN_KEPT, _run_kept)
def _(ctx):
    b = ctx.bundle()
    flip(b / "training_model.onnx", 100)
    return _resume(ctx, bundle=b)


@case("train-graph-random-resume", "train", "training graph overwritten with random bytes, found on resume", 2,
      "training_model.onnx: sha256 does not match", RUN_KEPT, _run_kept)
def _(ctx):
    b = ctx.bundle()
    f = b / "training_model.onnx"
    f.write_bytes(os.urandom(f.stat().st_size))
    return _resume(ctx, bundle=b)


@case("train-tokenizer-flip-resume", "train", "bundle's tokenizer.json: one flipped byte, found on resume", 2,
      "tokenizer.json: sha256 does not match", RUN_KEPT, _run_kept)
def _(ctx):
    b = ctx.bundle()
    flip(b / "tokenizer" / "tokenizer.json", 10)
    return _resume(ctx, bundle=b)


@case("train-no-data", "train", "--data missing", 2, "train.txt: file not found", NO_RUN, _no_run)
def _(ctx):
    return _train_fresh(ctx, data=ctx.tmp / "train.txt")


@case("train-data-empty", "train", "--data empty", 2, "the file has no text", NO_RUN, _no_run)
def _(ctx):
    return _train_fresh(ctx, data=ctx.data(""))


@case("train-data-binary", "train", "--data random bytes (not UTF-8)", 2, "not valid UTF-8", NO_RUN, _no_run)
def _(ctx):
    return _train_fresh(ctx, data=ctx.data(os.urandom(5000)))


@case("train-jsonl-bad-line", "train", "--data .jsonl with a broken line", 2, "t.jsonl line 2: invalid JSON", NO_RUN,
      _no_run)
def _(ctx):
    return _train_fresh(ctx, data=ctx.data('{"text": "hello there"}\n{"text": \n', "t.jsonl"))


@case("train-run-json-truncated", "train", "the run's run.json truncated (resume)", 2, "run.json: damaged",
      RUN_KEPT, _run_kept)
def _(ctx):
    argv = _resume(ctx)
    truncate(ctx.notes["run"] / "run.json", 0.5)
    return argv


@case("train-run-json-list", "train", "the run's run.json not an object (resume)", 2, "run.json: damaged (a JSON list",
      RUN_KEPT, _run_kept)
def _(ctx):
    argv = _resume(ctx)
    (ctx.notes["run"] / "run.json").write_text("[]")
    return argv


@case("train-run-json-types", "train", "the run's run.json with a value of the wrong type (resume)", 2,
      "run.json: damaged", RUN_KEPT, _run_kept)
def _(ctx):
    argv = _resume(ctx)
    edit_json(ctx.notes["run"] / "run.json", micro_batch="two")
    return argv


@case("train-out-is-file", "train", "--out is a file", 2, "exists and is not a directory", "the file untouched")
def _(ctx):
    (ctx.tmp / "f").write_text("mine")
    ctx.notes["file"] = ctx.tmp / "f"
    return train_argv(ctx.w.bundle, ctx.w.data, ctx.tmp / "f")


@case("train-changed-settings", "train", "resume with other training settings", 2, "was started with lr=",
      RUN_KEPT, _run_kept)
def _(ctx):
    return _resume(ctx) + ["--lr", "1e-3"]


def _resumed_to_the_end(ctx: Ctx) -> None:
    assert latest_step(ctx.notes["run"]) == STEPS


@case("train-all-checkpoints-damaged", "train", "every checkpoint of the run truncated", 0, "",
      "warns for each, trains again from step 0 to the end", _resumed_to_the_end)
def _(ctx):
    argv = _resume(ctx)
    for p in (ctx.notes["run"] / "checkpoints").glob("step-*"):
        truncate(p / "ort_checkpoint", 0.5)
    return argv


@case("train-metrics-garbage", "train", "the run's metrics.jsonl overwritten with random bytes", 0, "",
      "resumes; the log is rewritten up to the checkpoint", _resumed_to_the_end)
def _(ctx):
    argv = _resume(ctx)
    (ctx.notes["run"] / "metrics.jsonl").write_bytes(os.urandom(3000))
    return argv


# train: the environment ----------------------------------------------------------------------------------------

def _full_disk_train(nth: int):
    def setup(ctx):
        argv = _resume(ctx)
        ctx.notes["disk"] = FullDisk(ctx.tmp, nth).install(ctx.mp)
        return argv
    return setup


def _full_disk_kept(label: str):
    def check(ctx):
        from ort_trainer import checkpoint

        failed = [name for name, bad in ctx.notes["disk"].log if bad]
        assert failed and failed[0] == label, ctx.notes["disk"].log
        r = ctx.notes["run"]
        assert latest_step(r) >= 2 and all(checkpoint.verify(p) for p in (r / "checkpoints").glob("step-*"))
        assert not list((r / "checkpoints").glob(".tmp-*")) and not list(r.glob(".*.tmp-*"))
    return check


# The writes of a resume from step 2 to 4 (save-every 2), in order: metrics.jsonl rewritten to the checkpoint,
# a line for step 3, a line for step 4, checkpoint 4 (ORT's file, then state.json), summary.json.
for _nth, _file, _what in [(0, "metrics.jsonl", "metrics.jsonl rewritten on resume"),
                            (1, "metrics.jsonl", "a metrics.jsonl line"),
                            (3, "ort_checkpoint", "the ORT checkpoint (issue #31, 2)"),
                            (4, "state.json", "a checkpoint's state.json"),
                            (5, "summary.json", "summary.json")]:
    case(f"train-full-disk-{_nth}", "train", f"disk full writing {_what}", 3, "no space left on the device writing",
         "every saved checkpoint verifies, no partial file is left; freeing space and rerunning ends equal to an "
         "uninterrupted run (tests/test_faults.py)", _full_disk_kept(_file))(_full_disk_train(_nth))


@case("train-full-disk-run-json", "train", "disk full writing run.json (first start)", 3,
      "no space left on the device writing", "nothing but the empty run directory", _no_run)
def _(ctx):
    argv = _train_fresh(ctx)
    FullDisk(ctx.tmp, 0).install(ctx.mp)
    return argv


@case("train-read-only", "train", "--out on a read-only file system", 3, "read-only file system", NO_RUN, _no_run)
def _(ctx):
    argv = _train_fresh(ctx)
    read_only(ctx.mp, ctx.tmp)
    return argv


# export ----------------------------------------------------------------------------------------------------------

def _export(ctx: Ctx, run: Path, *what: str) -> list[str]:
    return ["export", "--run", str(run), *what]


EXPORT_KEPT = "the run untouched; no partial export"


def _no_export(ctx: Ctx) -> None:
    for name in ("peft", "m.onnx", "m.onnx.data"):
        p = ctx.tmp / name
        assert not p.exists() or (p.is_dir() and not list(p.iterdir())) or p.read_text() == "mine"
    nothing_beside(ctx.tmp, "m.onnx")


@case("export-no-run", "export", "--run missing", 2, "not a training run", EXPORT_KEPT, _no_export)
def _(ctx):
    return _export(ctx, ctx.tmp / "nope", "--peft", str(ctx.tmp / "peft"))


@case("export-no-checkpoint", "export", "a run without a checkpoint", 2, "no checkpoint yet", EXPORT_KEPT, _no_export)
def _(ctx):
    r = ctx.run()
    shutil.rmtree(r / "checkpoints")
    return _export(ctx, r, "--peft", str(ctx.tmp / "peft"))


@case("export-bundle-gone", "export", "the run's bundle moved away", 2, "no such bundle directory", EXPORT_KEPT,
      _no_export)
def _(ctx):
    return _export(ctx, ctx.run(bundle=ctx.tmp / "moved"), "--peft", str(ctx.tmp / "peft"))


@case("export-run-json", "export", "the run's run.json truncated", 2, "run.json: damaged", EXPORT_KEPT, _no_export)
def _(ctx):
    r = ctx.run()
    truncate(r / "run.json", 0.3)
    return _export(ctx, r, "--peft", str(ctx.tmp / "peft"))


@case("export-checkpoints-damaged", "export", "every checkpoint of the run damaged", 2, "no checkpoint yet",
      EXPORT_KEPT, _no_export)
def _(ctx):
    r = ctx.run()
    for p in (r / "checkpoints").glob("step-*"):
        flip(p / "ort_checkpoint", 50)
    return _export(ctx, r, "--peft", str(ctx.tmp / "peft"))


@case("export-eval-graph-flip", "export", "--onnx from a bundle whose eval graph has a flipped byte", 2,
      "eval_model.onnx: sha256 does not match", EXPORT_KEPT, _no_export)
def _(ctx):
    b = ctx.bundle()
    flip(b / "eval_model.onnx", 100)
    return _export(ctx, ctx.run(bundle=b), "--onnx", str(ctx.tmp / "m.onnx"))


@case("export-peft-is-file", "export", "--peft is a file", 2, "exists and is not a directory", "the file untouched",
      _no_export)
def _(ctx):
    (ctx.tmp / "peft").write_text("mine")
    return _export(ctx, ctx.run(), "--peft", str(ctx.tmp / "peft"))


def _export_full(*what: str):
    def setup(ctx):
        argv = _export(ctx, ctx.run(), *[w.format(tmp=ctx.tmp) for w in what])
        FullDisk(ctx.tmp, 0).install(ctx.mp)
        return argv
    return setup


case("export-full-disk-peft", "export", "disk full writing the PEFT adapter", 3, "no space left on the device writing",
     EXPORT_KEPT, _no_export)(_export_full("--peft", "{tmp}/peft"))
case("export-full-disk-onnx", "export", "disk full writing the ONNX model", 3, "no space left on the device writing",
     EXPORT_KEPT, _no_export)(_export_full("--onnx", "{tmp}/m.onnx"))


@case("export-read-only", "export", "--onnx into a read-only file system", 3, "read-only file system", EXPORT_KEPT,
      _no_export)
def _(ctx):
    argv = _export(ctx, ctx.run(), "--onnx", str(ctx.tmp / "m.onnx"))
    read_only(ctx.mp, ctx.tmp)
    return argv


# eval ------------------------------------------------------------------------------------------------------------

def _ppl(ctx: Ctx, bundle=None, data=None, *extra: str) -> list[str]:
    return ["eval", "ppl", "--bundle", str(bundle or ctx.w.bundle), "--data", str(data or ctx.w.data),
            "--max-tokens", "200", *extra]


EVAL_NOTHING = "nothing written"


@case("eval-no-bundle", "eval", "--bundle missing", 2, "no such bundle directory", EVAL_NOTHING)
def _(ctx):
    return _ppl(ctx, bundle=ctx.tmp / "nope")


@case("eval-no-data", "eval", "--data missing", 2, "nope.txt: file not found", EVAL_NOTHING)
def _(ctx):
    return _ppl(ctx, data=ctx.tmp / "nope.txt")


@case("eval-data-binary", "eval", "--data random bytes", 2, "not valid UTF-8", EVAL_NOTHING)
def _(ctx):
    return _ppl(ctx, data=ctx.data(os.urandom(3000)))


@case("eval-graph-random", "eval", "eval graph overwritten with random bytes", 2,
      "eval_model.onnx: sha256 does not match", EVAL_NOTHING)
def _(ctx):
    b = ctx.bundle()
    f = b / "eval_model.onnx"
    f.write_bytes(os.urandom(f.stat().st_size))
    return _ppl(ctx, bundle=b)


@case("eval-tokenizer-flip", "eval", "bundle's tokenizer.json: one flipped byte", 2,
      "tokenizer.json: sha256 does not match", EVAL_NOTHING)
def _(ctx):
    b = ctx.bundle()
    flip(b / "tokenizer" / "tokenizer.json", 10)
    return _ppl(ctx, bundle=b)


@case("eval-peft-random", "eval", "--peft adapter_model.safetensors of random bytes", 2,
      "adapter_model.safetensors: not a readable safetensors file", EVAL_NOTHING)
def _(ctx):
    p = ctx.tmp / "peft"
    p.mkdir()
    (p / "adapter_model.safetensors").write_bytes(os.urandom(500))
    return _ppl(ctx, None, None, "--peft", str(p))


@case("eval-peft-config", "eval", "--peft adapter_config.json damaged", 2, "adapter_config.json: not valid JSON",
      EVAL_NOTHING)
def _(ctx):
    p = ctx.tmp / "peft"
    p.mkdir()
    (p / "adapter_model.safetensors").write_bytes(b"")
    (p / "adapter_config.json").write_text("{oops")
    return _ppl(ctx, None, None, "--peft", str(p))


@case("eval-mmlu-missing", "eval", "MMLU directory without csv files", 2, "no MMLU csv files", EVAL_NOTHING)
def _(ctx):
    return ["eval", "mmlu", "--bundle", str(ctx.w.bundle), "--data", str(ctx.tmp / "nommlu"), "--limit", "1"]


def _no_report(ctx: Ctx) -> None:
    assert not (ctx.tmp / "r.json").exists() and not list(ctx.tmp.glob(".r.json*"))


@case("eval-full-disk", "eval", "disk full writing the --out report", 3, "no space left on the device writing",
      "no partial report", _no_report)
def _(ctx):
    argv = _ppl(ctx, None, None, "--out", str(ctx.tmp / "r.json"))
    FullDisk(ctx.tmp, 0).install(ctx.mp)
    return argv


# demo ------------------------------------------------------------------------------------------------------------

@case("demo-damaged-model", "demo", "--model with a truncated model.safetensors", 2,
      "model.safetensors: 6667172 bytes", "the workdir's data; no bundle")
def _(ctx):
    d = ctx.ckpt()
    truncate(d / "model.safetensors", 0.5)
    return ["demo", "--model", str(d), "--workdir", str(ctx.tmp / "demo"), "--steps", "2"]


@case("demo-read-only", "demo", "--workdir on a read-only file system", 3, "read-only file system", "nothing written")
def _(ctx):
    read_only(ctx.mp, ctx.tmp)
    return ["demo", "--model", str(ctx.w.ckpt), "--workdir", str(ctx.tmp / "demo"), "--steps", "2"]


# -- running a case ------------------------------------------------------------------------------------------------

@dataclass
class Outcome:
    code: int | str
    line: str          # the last line on stderr
    stderr: str


def run_case(name: str, world: World, tmp: Path, monkeypatch) -> Outcome:
    from pocketlora_cli import main

    c = CASES[name]
    ctx = Ctx(world, tmp, monkeypatch)
    argv = c.setup(ctx)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(argv)
    monkeypatch.undo()                        # the checks read and write as usual
    lines = [line for line in err.getvalue().splitlines() if line.strip()]
    out = Outcome(code, lines[-1] if lines else "", err.getvalue())
    assert code == c.code, (name, code, out.stderr[-2000:])
    assert "Traceback" not in out.stderr
    if c.code:
        assert out.line.startswith(f"pocketlora {c.verb}: error: ") and c.says in out.line, (name, out.line)
    if c.check:
        c.check(ctx)
    return out


def table(results: dict[str, Outcome], world_root: Path) -> str:
    """docs/FAULTS.md's table: one row per case, the message as printed (scratch paths shortened)."""
    rows = ["| # | command | fault | exit | message (one line on stderr) | what survived |",
            "|---|---|---|---|---|---|"]
    for k, (name, r) in enumerate(results.items(), 1):
        c = CASES[name]
        msg = re.sub(r"…/case-\d+", "…", r.line.replace(str(world_root), "…")).replace("|", "\\|") if c.code \
            else "(none: it works)"
        rows.append(f"| {k} | {c.verb} | {c.fault} | {r.code} | {msg} | {c.survived} |")
    return "\n".join(rows)


if __name__ == "__main__":      # python -m tests.fault_cases [OUT.md]: run every case, print the table
    import sys
    import tempfile

    import pytest

    import torch as _torch  # noqa: F401  (first: a train case must not hide torch from gen cases: _as_on_device)

    root = Path(tempfile.mkdtemp(prefix="faults-"))
    world = make_world(root / "world")
    results = {}
    for i, name in enumerate(CASES):
        mp = pytest.MonkeyPatch()
        tmp = root / f"case-{i:02d}"
        tmp.mkdir()
        try:
            results[name] = run_case(name, world, tmp, mp)
        finally:
            mp.undo()
        print(f"{name}: {results[name].code} {results[name].line[:160]}", file=sys.stderr, flush=True)
    text = table(results, root)
    print(text)
    if len(sys.argv) > 1:
        Path(sys.argv[1]).write_text(text + "\n")
    shutil.rmtree(root, ignore_errors=True)
