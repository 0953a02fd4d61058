"""The web runner (android_runner/web, onnxruntime-web WASM in Node) against the Python device runner.

Same tiny bundle, same micro-batches (the Python data pipeline's order, written out pre-tokenized), same
settings: the per-step losses agree within 1e-5 relative and the final LoRA tensors closely; a run killed
with SIGKILL again and again and resumed each time ends where an uninterrupted run ends.

Node's dependencies come from the `node_web` fixture (tests/conftest.py): installed from package-lock.json when
absent; a failing npm fails these tests, it does not skip them.
"""
from __future__ import annotations

import json
import random
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from tests.bundle_helpers import build_tiny_bundle
from tests.conftest import WEB

CLI = WEB / "cli.mjs"
STEPS = 20
SETTINGS = dict(micro_batch=2, accum=2, lr=5e-3, warmup=5, schedule="cosine", clip=0.6, weight_decay=0.01, seed=3)


def instruction_records(n: int, seed: int) -> list[dict]:
    """Records of varied lengths: micro-batches carry padding and different label counts."""
    rng = random.Random(seed)
    words = "the a model phone battery token learns small weights data step loss rate of on with".split()
    return [{"instruction": " ".join(rng.choices(words, k=rng.randint(3, 12))),
             "output": " ".join(rng.choices(words, k=rng.randint(1, 30)))} for _ in range(n)]


def write_microbatches(bundle: Path, data: Path, out: Path, micro_batch: int, count: int, seed: int) -> Path:
    """The micro-batches the Python loop trains on, in its order, as the web runner's pre-tokenized JSON.
    Uses the loop's own data functions (whatever module they live in)."""
    from android_runner import loop
    from ort_trainer.bundle import open_bundle

    b = open_bundle(bundle, verify="none")
    tok = loop.TextTokenizer.from_dir(b.tokenizer_dir)
    examples, _ = loop.load_examples(str(data), tok, b.manifest.seq_len)
    order = loop.data_order(examples, seed, micro_batch)
    batches = []
    for mb in loop.step_batches(examples, order, count, tok.pad_id):
        batches.append({k: mb[k].tolist() for k in ("input_ids", "attention_mask", "labels")})
    out.write_text(json.dumps({"format": "pocketlora-microbatches/1", "micro_batch": micro_batch,
                               "micro_batches_per_epoch": order.steps_per_epoch(), "micro_batches": batches}))
    return out


def node_train(web: Path, bundle: Path, data: Path, run: Path, steps: int, save_every: int = 50,
               **settings) -> subprocess.Popen:
    s = {**SETTINGS, **settings}
    args = ["node", str(web / "cli.mjs"), "train", "--bundle", str(bundle), "--data", str(data), "--out", str(run),
            "--max-steps", str(steps), "--micro-batch", str(s["micro_batch"]), "--accum", str(s["accum"]),
            "--lr", repr(s["lr"]), "--warmup", str(s["warmup"]), "--schedule", s["schedule"],
            "--clip", repr(s["clip"] or 0), "--weight-decay", repr(s["weight_decay"]), "--seed", str(s["seed"]),
            "--save-every", str(save_every), "--threads", "1"]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen, timeout: float = 600) -> str:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"node exited {proc.returncode}:\n{out}\n{err}"
    return err


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _lines(path: Path) -> int:
    return sum(1 for line in path.read_text().splitlines() if line.strip())


def web_final_lora(run: Path, bundle: Path) -> tuple[int, dict[str, np.ndarray]]:
    """The newest web checkpoint, verified and read as `pocketlora export` reads it: (step, LoRA by ONNX name)."""
    from ort_trainer import checkpoint
    from ort_trainer.adapter import load_lora
    from ort_trainer.manifest import Manifest

    path, state = checkpoint.latest(run)
    return state["step"], load_lora(checkpoint.weights_file(path, state), Manifest.load(bundle))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("web")
    data = root / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in instruction_records(48, seed=1)))
    return root, data


def web_bundle(root: Path, family: str, quant: str = "none") -> Path:
    if quant != "none":
        root = root / quant
        root.mkdir(exist_ok=True)
    bundle = root / f"{family}-bundle"
    if not bundle.exists():
        build_tiny_bundle(family, root, quant=quant)      # `gen` writes the web runner's files into every bundle
    return bundle


@pytest.mark.parametrize("family, quant", [("gpt2", "none"), ("qwen2", "none"), ("gemma3", "none"),
                                           ("gpt2", "int8"), ("gemma3", "int4"),     # per-axis and blocked DQ
                                           pytest.param("qwen2", "int8", marks=pytest.mark.slow)])
def test_web_matches_python_runner(family, quant, tiny, node_web):
    """Also on quantized bundles (issue 29): the WASM build runs the gated DequantizeLinear nodes too."""
    from android_runner.loop import RunConfig, train
    from ort_trainer import checkpoint
    from ort_trainer.adapter import load_lora
    from ort_trainer.manifest import Manifest

    root, data = tiny
    bundle = web_bundle(root, family, quant)
    family = f"{family}-{quant}"
    py_run, web_run = root / f"{family}-py", root / f"{family}-web"
    train(RunConfig(bundle=str(bundle), data=str(data), max_steps=STEPS, battery="none", threads=1, save_every=50,
                    **SETTINGS), py_run, log=lambda *_: None, progress=False)
    mbs = write_microbatches(bundle, data, root / f"{family}-mb.json", SETTINGS["micro_batch"],
                             STEPS * SETTINGS["accum"], SETTINGS["seed"])
    finish(node_train(node_web, bundle, mbs, web_run, STEPS))
    raw_run = root / f"{family}-web-raw"        # the training file itself, through the JS data pipeline
    finish(node_train(node_web, bundle, data, raw_run, STEPS))

    py, web = metrics(py_run), metrics(web_run)
    raw = metrics(raw_run)
    assert [m["label_tokens"] for m in raw] == [m["label_tokens"] for m in py]
    assert [m["loss"] for m in raw] == [m["loss"] for m in web]     # the same micro-batches as Python's
    assert [m["step"] for m in web] == list(range(1, STEPS + 1))
    assert [m["label_tokens"] for m in web] == [m["label_tokens"] for m in py]
    assert [m["tokens"] for m in web] == [m["tokens"] for m in py]
    # The same schedule; the optimizer gets it as float32 (V8's cos may differ from libm's in a double's last bit).
    assert np.array_equal(np.float32([m["lr"] for m in web]), np.float32([m["lr"] for m in py]))
    assert any(m["grad_norm"] > SETTINGS["clip"] for m in py), "clipping never engaged: the test would not cover it"
    rel = [abs(w["loss"] - p["loss"]) / abs(p["loss"]) for w, p in zip(web, py)]
    print(f"{family}: max rel loss diff {max(rel):.2e} (step {int(np.argmax(rel)) + 1}); "
          f"loss {py[0]['loss']:.4f} -> {py[-1]['loss']:.4f}")
    assert max(rel) < 1e-5, rel

    man = Manifest.load(bundle)
    path, state = checkpoint.latest(py_run)
    py_lora = load_lora(checkpoint.weights_file(path, state), man)
    step, web_lora = web_final_lora(web_run, bundle)
    assert step == state["step"] == STEPS and set(web_lora) == set(py_lora)
    raw_state = json.loads(sorted((raw_run / "checkpoints").glob("step-*"))[-1].joinpath("state.json").read_text())
    assert raw_state["data"] == state["data"]       # the data position is Python's DataOrder state
    worst = max(float(np.abs(web_lora[n] - py_lora[n]).max() / (np.abs(py_lora[n]).max() + 1e-12)) for n in py_lora)
    print(f"{family}: max rel LoRA diff after {STEPS} steps {worst:.2e}")
    assert worst < 1e-4


def test_web_resume_after_sigkill_is_exact(tiny, node_web):
    """SIGKILL at random moments, resume each time: the final LoRA and moments equal an uninterrupted run's."""
    from safetensors.numpy import load_file

    root, data = tiny
    bundle = web_bundle(root, "gpt2")
    steps = 48
    mbs = write_microbatches(bundle, data, root / "resume-mb.json", SETTINGS["micro_batch"], steps * SETTINGS["accum"],
                             SETTINGS["seed"])
    straight, killed = root / "resume-straight", root / "resume-killed"
    finish(node_train(node_web, bundle, mbs, straight, steps, save_every=3))

    rng = random.Random(0)
    kills = 0
    for _ in range(60):
        proc = node_train(node_web, bundle, mbs, killed, steps, save_every=3)
        # Kill once this process has logged a step (start-up takes seconds), a random moment later:
        # mid-step, mid-checkpoint, mid-metrics line.
        before = len(metrics(killed)) if (killed / "metrics.jsonl").exists() else 0
        deadline = time.time() + 120
        while proc.poll() is None and time.time() < deadline:
            if (killed / "metrics.jsonl").exists() and _lines(killed / "metrics.jsonl") > before:
                time.sleep(rng.uniform(0.0, 0.4))
                break
            time.sleep(0.02)
        if proc.poll() is None:
            saved = any((killed / "checkpoints").glob("step-*"))
            proc.send_signal(signal.SIGKILL)
            proc.communicate()
            kills += saved           # a kill before the first checkpoint would test nothing: not counted
            continue
        out, err = proc.communicate()
        assert proc.returncode == 0, err
        if json.loads((killed / "summary.json").read_text())["finished"]:
            break
    else:
        pytest.fail("the killed run never finished")
    assert kills >= 10, f"only {kills} kills landed after a checkpoint; the test did not test resuming enough"

    a = sorted((straight / "checkpoints").glob("step-*"))[-1]
    b = sorted((killed / "checkpoints").glob("step-*"))[-1]
    ta = load_file(str(a / "web_state.safetensors"))
    tb = load_file(str(b / "web_state.safetensors"))
    assert a.name == b.name and set(ta) == set(tb)
    worst = max(float(np.abs(ta[k] - tb[k]).max()) for k in ta)
    print(f"resume: {kills} kills, max |diff| of LoRA + moments {worst:.1e}")
    assert worst <= 1e-6
    assert [m["step"] for m in metrics(killed)] == list(range(1, steps + 1))
    ma, mb = metrics(straight), metrics(killed)
    assert [m["loss"] for m in ma] == [m["loss"] for m in mb]


def test_web_sigterm_checkpoints_and_exits_0(tiny, node_web):
    root, data = tiny
    bundle = web_bundle(root, "gpt2")
    mbs = write_microbatches(bundle, data, root / "term-mb.json", SETTINGS["micro_batch"], 400 * SETTINGS["accum"],
                             SETTINGS["seed"])
    run = root / "term"
    proc = node_train(node_web, bundle, mbs, run, 400, save_every=1000)
    deadline = time.time() + 60
    while time.time() < deadline and not ((run / "metrics.jsonl").exists() and metrics(run)):
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    finish(proc, timeout=60)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["stopped_by"] == "SIGTERM" and not summary["finished"]
    step, _ = web_final_lora(run, bundle)
    assert step == summary["step"] == len(metrics(run)) >= 1
