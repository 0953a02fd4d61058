"""Choosing the micro-batch from a memory budget (android_runner/memory_fit.py)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from android_runner.loop import RunConfig, RunError, train
from android_runner.memory_fit import MemoryBudgetError, Pass, choose_micro_batch, parse_budget, worst_case_batch
from android_runner.metrics import peak_rss_mb, reset_peak_rss
from ort_trainer import checkpoint
from ort_trainer.bundle import open_bundle
from ort_trainer.adapter import load_lora
from tests.bundle_helpers import build_tiny_bundle


class Device:
    """A fake device: peak MiB of a micro-batch of m sequences, and the anonymous memory the pass itself added
    (by default its sequences' part alone: peak(2) - peak(1) a sequence); records what it was asked to run."""

    def __init__(self, peak, growth=None):
        self.peak, self.ran = peak, []
        self.growth = growth if growth is not None else peak(2) - peak(1)

    def __call__(self, m):
        self.ran.append(m)
        return Pass(self.peak(m), self.growth * m)


def test_largest_fitting_split_is_chosen_and_nothing_larger_is_run():
    dev = Device(lambda m: 1000 + 100 * m)
    fit = choose_micro_batch(dev, 8, budget_mb=1450)
    assert (fit.micro_batch, fit.accum) == (4, 2)
    assert fit.per_sequence_mb == 100 and fit.predicted_mb[8] == 1800
    assert dev.ran == [1, 2, 4]                    # 8 was predicted over budget: never run
    assert choose_micro_batch(Device(lambda m: 1000 + 100 * m), 8, budget_mb=10_000).micro_batch == 8
    assert choose_micro_batch(Device(lambda m: 1000 + 100 * m), 8, budget_mb=1250).micro_batch == 2
    assert choose_micro_batch(Device(lambda m: 1000 + 100 * m), 6, budget_mb=1350).micro_batch == 3


def test_a_split_measured_over_budget_steps_down():
    dev = Device(lambda m: 1000 + 100 * m + (300 if m >= 4 else 0))   # grows faster than the first two predict
    fit = choose_micro_batch(dev, 8, budget_mb=1450)
    assert fit.micro_batch == 2 and dev.ran == [1, 2, 4]
    assert fit.measured_mb[4] == 1700


def test_two_sequences_are_not_run_when_they_could_exceed_the_budget():
    """A pass of 2 sequences is run only if it fits even at the first pass's peak plus all its growth (a bound:
    with the fixed part counted twice); else the device trains 1 sequence at a time and never goes over."""
    dev = Device(lambda m: 1000 + 100 * m, growth=300)       # 100 a sequence + 200 the pass's fixed part
    fit = choose_micro_batch(dev, 8, budget_mb=1350)
    assert dev.ran == [1] and (fit.micro_batch, fit.accum) == (1, 8)
    assert fit.bound_2_mb == 1400 and "2 not run: it could take up to 1,400" in fit.summary()
    dev = Device(lambda m: 1000 + 100 * m, growth=300)
    assert choose_micro_batch(dev, 8, budget_mb=1400).micro_batch == 4 and dev.ran == [1, 2, 4]
    dev = Device(lambda m: 1000 + 100 * m, growth=300)         # odd: no 2 to measure, so 3 is counted at the bound
    assert choose_micro_batch(dev, 3, budget_mb=1650).micro_batch == 1 and dev.ran == [1]
    dev = Device(lambda m: 1000 + 100 * m, growth=300)
    assert choose_micro_batch(dev, 3, budget_mb=1700).micro_batch == 3 and dev.ran == [1, 3]


def test_a_budget_below_one_sequence_is_a_clear_error():
    with pytest.raises(MemoryBudgetError, match="micro-batch 1 needs 1,100 MiB.*--memory low"):
        choose_micro_batch(Device(lambda m: 1000 + 100 * m), 8, budget_mb=900)


def test_budget_parsing():
    assert parse_budget("2800") == 2800 and parse_budget("2800M") == 2800 and parse_budget("2.5G") == 2560
    assert parse_budget("auto") == "auto"
    for bad in ("lots", "-1", "0"):
        with pytest.raises(MemoryBudgetError, match="--memory-budget"):
            parse_budget(bad)


def test_peak_reset_measures_a_later_smaller_peak():
    """The calibration relies on VmHWM being resettable: a big allocation, freed, then a small one; after the
    reset the peak mark must be far below the big allocation's."""
    big = np.ones(200 * 2**20 // 8)                # written, so resident
    peak_with_big = peak_rss_mb()
    del big
    assert reset_peak_rss(), "clear_refs is not writable here"
    small = np.ones(20 * 2**20 // 8)
    assert peak_rss_mb() < peak_with_big - 100, "the peak still holds the freed 200 MiB"
    del small


def test_unfaulted_pages_of_a_mapped_file_are_what_was_not_read(tmp_path):
    """A mapped 16 MiB file of which 4 MiB were read has 12 MiB still to come into RSS (as ORT maps the shards)."""
    from android_runner.metrics import file_mappings, unfaulted_mb

    path = tmp_path / "shard.bin"
    path.write_bytes(bytes(16 * 2**20))
    m = np.memmap(path, np.uint8, "r")
    assert unfaulted_mb([path]) == pytest.approx(16, abs=0.01)
    assert int(m[: 4 * 2**20 : 4096].sum()) == 0                     # one byte a page
    assert unfaulted_mb([path]) == pytest.approx(12, abs=0.5)        # (the kernel may map a few pages around)
    assert unfaulted_mb([tmp_path / "other.bin"]) == 0
    (mapping,) = file_mappings([path])
    assert mapping[1:3] == (0, 16 * 2**20)                         # (file offset, size)
    del m


def test_worst_case_batch_is_full_and_labelled():
    b = worst_case_batch(3, 16)
    assert b["input_ids"].shape == (3, 16) and b["attention_mask"].all() and (b["labels"] != -100).all()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, shared_data):
    root = tmp_path_factory.mktemp("fit")
    _, bundle = build_tiny_bundle("gpt2", root)
    data = root / "train.txt"
    data.write_text("\n".join((shared_data / "wikitext2" / "valid.txt").read_text().splitlines()[:120]))
    return bundle, data, root


def _cfg(bundle, data, **kw) -> RunConfig:
    base = dict(bundle=str(bundle), data=str(data), max_steps=6, micro_batch=1, accum=4, lr=5e-3, warmup=2,
                save_every=3, battery="none", threads=1)
    base.update(kw)
    return RunConfig(**base)


def _lora(run, bundle):
    path, state = checkpoint.latest(run)
    return state["step"], load_lora(path / checkpoint.ORT_FILE, open_bundle(bundle, verify="none").manifest)


def test_measuring_leaves_the_training_untouched_and_resume_keeps_the_split(tiny):
    """A run that measured its split trains exactly as a run given that split: the worst-case passes
    changed no weight, gradient or optimizer moment."""
    bundle, data, root = tiny
    logs = []
    s = train(_cfg(bundle, data, memory_budget="100G"), root / "fit", log=logs.append)
    assert s["finished"] and s["memory_fit"]["micro_batch"] == 4 and s["memory_fit"]["accum"] == 1
    assert sorted(s["memory_fit"]["measured_mb"]) == [1, 2, 4]
    assert s["memory_fit"]["start_mb"] > 0                 # the sessions' start, measured before the fit
    assert any("micro-batch 4 x accum 1" in line for line in logs)
    saved = json.loads((root / "fit" / "run.json").read_text())
    assert (saved["micro_batch"], saved["accum"]) == (4, 1)

    train(_cfg(bundle, data, micro_batch=4, accum=1), root / "given", log=lambda *_: None)
    step_a, a = _lora(root / "fit", bundle)
    step_b, b = _lora(root / "given", bundle)
    assert step_a == step_b == 6
    for name in b:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)

    logs.clear()                                   # resume with a larger max: the first split stays
    s2 = train(_cfg(bundle, data, memory_budget="1M"), root / "fit", log=logs.append)
    assert s2["memory_fit"] is None and any("keeping the split measured at the first start, 4 x 1" in x for x in logs)


def test_a_split_below_the_largest_pass_trains_in_a_new_session(tiny, monkeypatch):
    """ORT's arena keeps what its largest pass needed, so a run whose fit measured 2 sequences and chose 1 trains in
    a new session, started after the measured one is gone; it trains exactly as a run given that split."""
    import weakref

    import android_runner.loop as loop
    from android_runner.memory_fit import MemoryFit
    from android_runner.metrics import file_mappings

    bundle, data, root = tiny
    monkeypatch.setattr(loop, "fit_session", lambda *a, **k: MemoryFit(500, "given", 4, 1, 4, {1: 400, 2: 520}))
    sessions = []

    def on_session(session, from_checkpoint):
        shards = [session.bundle.file(f.path) for f in session.bundle.manifest.files_with_role("shard")]
        assert file_mappings(shards), "the probe would not see the shards ORT mapped"
        sessions.append((weakref.ref(session), [r() is not None for r, _ in sessions]))

    train(_cfg(bundle, data, memory_budget="500"), root / "refit", log=lambda *_: None, on_session=on_session)
    assert len(sessions) == 2 and sessions[1][1] == [False], "the measured session outlived the fit"
    train(_cfg(bundle, data), root / "plain", log=lambda *_: None)
    step_a, a = _lora(root / "refit", bundle)
    step_b, b = _lora(root / "plain", bundle)
    assert step_a == step_b == 6
    for name in b:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def test_a_budget_too_small_fails_before_anything_is_recorded(tiny):
    bundle, data, root = tiny
    with pytest.raises(RunError, match="even micro-batch 1 needs"):
        train(_cfg(bundle, data, memory_budget="1"), root / "small", log=lambda *_: None)
    assert not (root / "small" / "run.json").exists() and checkpoint.latest(root / "small") is None


def test_cgroup_limit_is_the_tightest_over_the_ancestors(tmp_path):
    from android_runner.memory_fit import cgroup_limit_mb

    proc = tmp_path / "cgroup"
    proc.write_text("4:memory:/apps/run\n1:cpu:/\n0::/user/app\n")
    fs = tmp_path / "fs"
    for rel, name, value in (("memory/apps/run", "memory.limit_in_bytes", str(2**63 - 4096)),   # v1 "no limit"
                             ("memory/apps", "memory.limit_in_bytes", str(3 * 2**30)),
                             ("user/app", "memory.max", "max"),
                             ("user", "memory.max", str(5 * 2**30))):
        (fs / rel).mkdir(parents=True, exist_ok=True)
        (fs / rel / name).write_text(value + "\n")
    assert cgroup_limit_mb(str(proc), str(fs)) == 3 * 1024
    (fs / "memory/apps/memory.limit_in_bytes").write_text(str(2**63 - 4096))
    assert cgroup_limit_mb(str(proc), str(fs)) == 5 * 1024
    (fs / "user/memory.max").write_text("max")
    assert cgroup_limit_mb(str(proc), str(fs)) is None


def test_auto_budget_reads_a_real_cgroup_limit(tmp_path):
    """A child moved into a cgroup-v1 memory group of 3 GiB sees 80% of it as its `auto` budget."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path("/sys/fs/cgroup/memory")
    group = root / f"pocketlora-test-{os.getpid()}"
    try:
        group.mkdir()
        (group / "memory.limit_in_bytes").write_text(str(3 * 2**30))
    except OSError as e:
        pytest.skip(f"no writable cgroup-v1 memory controller here ({e})")
    try:
        code = ("import os, sys; open(sys.argv[1] + '/cgroup.procs', 'w').write(str(os.getpid()));"
                "from android_runner.memory_fit import auto_budget_mb; b, why = auto_budget_mb(); print(b, why)")
        out = subprocess.run([sys.executable, "-c", code, str(group)], capture_output=True, text=True, check=True,
                             cwd=Path(__file__).resolve().parents[1]).stdout.split(maxsplit=1)
        assert float(out[0]) == pytest.approx(0.8 * 3072) and "cgroup memory limit" in out[1]
    finally:
        group.rmdir()


def test_low_mode_measures_anonymous_memory_only(tmp_path):
    """--memory low counts what the kernel cannot drop: a pass that touches 128 MiB of a mapped file and allocates
    96 MiB measures the 96 (plus the process's own anonymous memory), not the mapped file. In a fresh interpreter,
    so that no freed heap of earlier tests hides the 96 MiB."""
    import subprocess
    import sys
    from pathlib import Path

    path = tmp_path / "weights.bin"
    path.write_bytes(np.random.default_rng(0).bytes(128 * 2**20))
    code = f"""
import mmap, numpy as np
from android_runner.memory_fit import measure_pass

class FakeSession:                                        # as ORT: the weights stay mapped for the session's life
    def __init__(self):
        with open({str(path)!r}, "rb") as f:
            self.weights = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)

    def forward_backward(self, batch, scale):
        m = self.weights
        self.checksum = sum(m[i] for i in range(0, len(m), 4096))      # touch every page
        work = np.ones(96 * 2**20 // 8)                                  # activations
        del work

    def drop_grads(self):
        pass

def status(key):
    return next(int(line.split()[1]) / 1024 for line in open("/proc/self/status") if line.startswith(key + ":"))

session = FakeSession()
before = status("RssAnon")
total = measure_pass(session, 1, 4).peak_mb
anon = measure_pass(session, 1, 4, anonymous=True).peak_mb
print(before, total, anon)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[1]).stdout.split()
    before, total, anon = map(float, out)
    assert anon == pytest.approx(before + 96, abs=40), (before, total, anon)
    assert total - anon > 100, (total, anon)              # the mapped file is counted only in `total`


def test_a_checkpoint_save_is_counted_in_every_measured_peak():
    """The loop saves checkpoints after steps, on top of what the passes left in ORT's arena: a run peaked there
    (GPT-2 int4: 361 MiB in the pass, 376 at the final save). A fake session whose save takes 96 MiB for a moment:
    the fit's measured peak is the pass's plus those 96. In a fresh interpreter, so that no freed heap of earlier
    tests hides them."""
    import subprocess
    import sys
    from pathlib import Path

    code = """
import types, numpy as np
from android_runner.memory_fit import fit_session, measure_pass

class FakeSession:
    bundle = types.SimpleNamespace(manifest=types.SimpleNamespace(files_with_role=lambda role: []))
    work_dir = None
    saved = []

    def forward_backward(self, batch, scale):
        work = np.ones(32 * 2**20 // 8)                   # activations
        del work

    def drop_grads(self):
        pass

    def save(self, path):                                 # ORT serializing the weights and moments
        buf = np.ones(96 * 2**20 // 8)
        path.write_bytes(b"x")
        self.saved.append(path)
        del buf

session = FakeSession()
alone = measure_pass(session, 1, 4).peak_mb
fit = fit_session(session, 4, 1, 100000, log=lambda *_: None)
print(alone, fit.measured_mb[1], fit.save_mb, int(session.saved[0].exists()))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[1]).stdout.split()
    alone, measured, save, left = map(float, out)
    assert save == pytest.approx(96, abs=30), out
    assert measured >= alone + 66, out
    assert not left, "the probe's scratch checkpoint was left behind"
