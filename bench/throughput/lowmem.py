"""The low-memory run: Qwen2.5-0.5B's device path with RuntimeOptions(memory="low") under a hard memory limit of
60% of its fp32 weight bytes (a cgroup-v1 memory cgroup, else systemd-run), plain and with --memory-budget auto;
its normal-mode comparison is the lockstep's lean phase."""
from __future__ import annotations

import os
import re
import statistics
from pathlib import Path

from bench.children import THREADS, ChildResult, run_worker
from bench.common import log, tail
from bench.throughput.config import CGROUP, CGROUP_ROOT, EFFECTIVE_BATCH, LOWMEM_FRACTION, LOWMEM_STEPS
from bench.throughput.summary import measured


def _evict_page_cache(paths: list[Path]) -> None:
    """Drop these files' clean pages from the page cache (only these files), so that in the memory
    cgroup their pages are charged to it when the child faults them in (cgroup v1 charges a page to
    the cgroup that first brings it in)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _reset_cgroup_counters() -> None:
    """Zero the cgroup's high-water mark and limit-hit count, so the next child's are its own."""
    for k in ("memory.max_usage_in_bytes", "memory.failcnt"):
        try:
            (CGROUP / k).write_text("0")
        except OSError:
            pass


def lowmem_run(setup: dict, data: Path, workdir: Path, quick: bool, timeout: float, lean: dict | None) -> dict:
    """memory=low at micro-batch 1 x accum 8 under the limit, then the same with --memory-budget auto; `lean`: the
    normal-mode comparison already measured (else it runs here, without a limit)."""
    fp32_bytes = setup["manifest_model"]["frozen_params"] * 4
    limit = int(LOWMEM_FRACTION * fp32_bytes)
    note = None
    if quick:   # tiny weights: the interpreter alone exceeds 60% of them; exercise the mechanism anyway
        limit += 512 * 2**20
        note = "quick mode: limit = 60% of the tiny model's fp32 weights + 512 MiB for the interpreter"
    warm, steps = LOWMEM_STEPS
    spec = {"bundle": setup["bundle"], "data": str(data), "threads": THREADS, "seed": 0,
            "phases": [{"micro": 1, "accum": EFFECTIVE_BATCH, "warmup": warm, "steps": steps}]}
    out: dict = {"shape": setup["name"], "workload": "lm", "micro": 1, "accum": EFFECTIVE_BATCH, "warmup": warm,
                 "steps": steps, "fp32_weight_bytes": fp32_bytes, "limit_bytes": limit, "note": note}
    shards = [Path(setup["bundle"]) / f for f in os.listdir(setup["bundle"]) if f.startswith("weights-")]

    if lean:     # the same setting, normal mode, no limit: ort-8x1's lean phase in the lockstep
        out["normal"] = {**lean, "source": "the lockstep's lean phase (ort-8x1 process, before its other phases)"}
    else:
        log(f"low-memory: normal mode, same config ({setup['name']}, lm, 1x{EFFECTIVE_BATCH}), no limit")
        out["normal"] = _lowmem_summary(run_worker("ort", {**spec, "memory": "normal"}, workdir / "lowmem-normal.log",
                                                   timeout))

    mechanism = None
    if CGROUP_ROOT.is_dir():
        try:
            CGROUP.mkdir(exist_ok=True)
            (CGROUP / "memory.limit_in_bytes").write_text(str(limit))
            _reset_cgroup_counters()
            mechanism = "cgroup-v1"
        except OSError as e:
            out["cgroup_error"] = f"{type(e).__name__}: {e}"
    else:
        out["cgroup_error"] = f"{CGROUP_ROOT} does not exist (no cgroup v1 memory controller)"
    _evict_page_cache(shards)
    log(f"low-memory: memory=low under a {limit / 2**20:.0f} MiB limit via {mechanism or 'systemd-run'}")
    if mechanism:
        low = run_worker("ort", {**spec, "memory": "low"}, workdir / "lowmem-low.log", timeout, cgroup=CGROUP)
        # the same, with the runner's --memory-budget auto: it reads the cgroup's limit and, in low mode,
        # splits the batch by anonymous memory (android_runner/memory_fit.py)
        _reset_cgroup_counters()
        _evict_page_cache(shards)
        log("low-memory: the same cap, with --memory-budget auto")
        out["low_fit"] = _lowmem_summary(run_worker("ort", {**spec, "memory": "low", "memory_budget_mb": "auto"},
                                                    workdir / "lowmem-low-fit.log", timeout, cgroup=CGROUP))
        try:
            CGROUP.rmdir()
        except OSError as e:
            out["cgroup_rmdir_error"] = str(e)
    else:
        mechanism = "systemd-run"
        low = run_worker("ort", {**spec, "memory": "low"}, workdir / "lowmem-low.log", timeout,
                         wrap=["systemd-run", "--scope", "--quiet", "-p", f"MemoryMax={limit}"])
    out["mechanism"] = mechanism
    out["low"] = _lowmem_summary(low)
    return out


def _lowmem_summary(c: ChildResult) -> dict:
    s = {"completed": c.ok, "exit_code": c.code, "wall_s": round(c.wall, 1), "peak_rss": c.peak_rss(),
         "ru_maxrss": c.maxrss, "sampled": c.samples, "cgroup": c.cgroup}
    if c.ok:
        m = measured(c.result)
        s["step_seconds"] = [x["seconds"] for x in m]
        s["median_step_s"] = statistics.median(s["step_seconds"])
        s["rss_stages"] = c.result.get("rss")
        s["session_seconds"] = c.result.get("session_seconds")
        s["memory_fit"] = c.result.get("memory_fit")
    else:
        s["log_tail"] = tail(c.log_path)
        s["steps_done"] = re.findall(r"step (\d+): ([\d.]+) s", c.log_path.read_text(errors="replace"))
    return s
