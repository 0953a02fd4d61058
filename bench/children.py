"""Child processes of the benches, both ends: each measured run is a process of its own.

Parent side: run_child runs one child to its end (sampling its RSS every 0.1 s, optionally inside a memory
cgroup) and run_worker does so for bench/_bench_worker.py; Lockstep keeps one worker per configuration alive and
lets them take turns one step at a time. Child side: a child prints its result as one line RESULT_TAG + JSON
(emit) and, in a lockstep, says READY once loaded and STEP_DONE after each step it was let take (wait_turn, done).
"""
from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from bench.common import REPO, tail

RESULT_TAG = "BENCH_RESULT "
READY, STEP_DONE = "READY", "STEP_DONE"
WORKER = "bench._bench_worker"          # run as python -m WORKER KIND SPEC_JSON
THREADS = 2                             # every measured process runs with 2 threads


# ------------------------------------------------------------------------------------ child side

def emit(result: dict) -> None:
    """The child's result, the one stdout line the parent reads."""
    print(RESULT_TAG + json.dumps(result), flush=True)


def parse_result(stdout: str) -> dict | None:
    """The last result line of a child's stdout, or None."""
    for line in reversed(stdout.splitlines()):
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG):])
    return None


def wait_turn(spec: dict) -> None:
    """In a lockstep: block until the parent lets this worker take its next step."""
    if spec.get("lockstep"):
        if not sys.stdin.readline():
            raise SystemExit("lockstep: parent closed stdin")


def done(spec: dict, what: str = STEP_DONE) -> None:
    """In a lockstep: tell the parent the step is done (or, with READY, that the worker is loaded)."""
    if spec.get("lockstep"):
        print(what, flush=True)


# ----------------------------------------------------------------------------------- parent side

class ChildResult:
    """A child run to its end: exit code, its result (None without a result line), wall seconds, ru_maxrss,
    the parent's RSS samples (peaks), its log, the cgroup's counters (with a cgroup or a timeout), CPU seconds."""

    def __init__(self, code, result, wall, maxrss, samples, log_path, cg=None, cpu_s=None):
        self.code, self.result, self.wall, self.maxrss = code, result, wall, maxrss
        self.samples, self.log_path, self.cgroup, self.cpu_s = samples, log_path, cg, cpu_s

    @property
    def ok(self) -> bool:
        return self.code == 0 and self.result is not None

    def peak_rss(self) -> int:
        return max(self.maxrss, self.samples.get("VmRSS", 0))

    def failure(self) -> str:
        """Why it failed: how it ended (an exit code, or the signal that killed it) and the end of its log."""
        if self.code < 0:
            how = f"killed by {signal.Signals(-self.code).name}"
        else:
            how = f"exit {self.code}" + ("" if self.code else ", no result line")
        return f"{how}; log: {tail(self.log_path)}"


def child_env(threads: int = THREADS) -> dict:
    env = dict(os.environ)
    for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "RAYON_NUM_THREADS"):
        env[k] = str(threads)
    env.setdefault("TOKENIZERS_PARALLELISM", "true")
    return env


def read_status(pid: int) -> dict[str, int]:
    """VmRSS, RssAnon and RssFile of a process, in bytes ({} once it is gone)."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for ln in f:
                k, _, v = ln.partition(":")
                if k in ("VmRSS", "RssAnon", "RssFile"):
                    out[k] = int(v.split()[0]) * 1024
    except (OSError, ValueError):
        pass
    return out


def run_worker(kind: str, spec: dict, log_path: Path, timeout: float, cgroup: Path | None = None,
               wrap: list[str] | None = None) -> ChildResult:
    """One bench/_bench_worker.py process of `kind` (setup, ort, torch, gemm) run to its end, with 2 threads.

    With `cgroup`, the worker starts blocked on stdin (nothing imported yet), is moved into the cgroup, then released."""
    if cgroup is not None:
        spec = {**spec, "wait_stdin": True}
    return run_child([WORKER, kind, json.dumps(spec)], log_path, timeout, cgroup, wrap, child_env())


def run_child(module_args: list[str], log_path: Path, timeout: float | None, cgroup: Path | None = None,
              wrap: list[str] | None = None, env: dict | None = None) -> ChildResult:
    """Run `python -m MODULE ARGS...` in the repository; stderr to log_path; sample VmRSS (and the cgroup's
    usage) every 0.1 s; wait4 for ru_maxrss. Killed after `timeout` seconds (None: never).

    With `cgroup`, the child must wait for a line on stdin before it imports anything: it is moved into the
    cgroup, then released. `wrap` prefixes the command (systemd-run)."""
    return run_command([*(wrap or []), sys.executable, "-m", *module_args], log_path, timeout, cgroup, env)


def run_command(cmd: list[str], log_path: Path, timeout: float | None, cgroup: Path | None = None,
                env: dict | None = None) -> ChildResult:
    """run_child for any command (e.g. node): the same sampling, timeout and cgroup handling."""
    t0 = time.time()
    out_chunks: list[str] = []
    with open(log_path, "w") as logf:
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE if cgroup is not None else subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=logf, text=True, cwd=REPO, env=env)
        reader = threading.Thread(target=lambda: out_chunks.append(proc.stdout.read()), daemon=True)
        reader.start()
        cg_info: dict = {}
        if cgroup is not None:
            (cgroup / "cgroup.procs").write_text(str(proc.pid))
            cg_info["moved"] = any(ln.split(":", 2)[1:] == ["memory", f"/{cgroup.name}"]
                                  for ln in Path(f"/proc/{proc.pid}/cgroup").read_text().splitlines())
            proc.stdin.write("go\n")
            proc.stdin.close()
        peak: dict[str, int] = {}
        status = usage = None
        killed = False
        while True:
            pid, st, ru = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                status, usage = st, ru
                break
            for k, v in read_status(proc.pid).items():
                peak[k] = max(peak.get(k, 0), v)
            if cgroup is not None:
                try:
                    u = int((cgroup / "memory.usage_in_bytes").read_text())
                    peak["cgroup_usage"] = max(peak.get("cgroup_usage", 0), u)
                    stat = dict(ln.split() for ln in (cgroup / "memory.stat").read_text().splitlines())
                    for k in ("rss", "cache", "mapped_file"):
                        peak[f"cgroup_{k}"] = max(peak.get(f"cgroup_{k}", 0), int(stat.get(k, 0)))
                except (OSError, ValueError):
                    pass
            if timeout is not None and time.time() - t0 > timeout and not killed:
                os.kill(proc.pid, signal.SIGKILL)      # our own child, by its pid
                killed = True
            time.sleep(0.1)
        reader.join(timeout=10)
        proc.returncode = os.waitstatus_to_exitcode(status)
    if cgroup is not None:
        for k in ("memory.max_usage_in_bytes", "memory.failcnt", "memory.limit_in_bytes"):
            try:
                cg_info[k] = int((cgroup / k).read_text())
            except (OSError, ValueError):
                pass
        try:
            cg_info["oom_control"] = (cgroup / "memory.oom_control").read_text().split("\n")
        except OSError:
            pass
    if killed:
        cg_info["timed_out_after_s"] = timeout
    return ChildResult(proc.returncode, parse_result("".join(out_chunks)), time.time() - t0, usage.ru_maxrss * 1024,
                       peak, log_path, cg_info if (cgroup is not None or killed) else None,
                       cpu_s=round(usage.ru_utime + usage.ru_stime, 2))


class Lockstep:
    """One long-lived worker per configuration, taking turns one step at a time (A B C A B C ...).

    Each `slots` entry is (name, [keys], n): the listed workers run their next phase together, n steps (warm-up
    included), step by step in the listed order; a worker's phases are the slots it appears in, in order. Startup (imports, data,
    session or model) overlaps across workers and is not measured; steps never overlap. Per worker and
    phase the parent samples VmRSS / RssAnon / RssFile every 0.1 s; the worker reports the phase's VmHWM
    (reset at the phase's start) and every step; wait4 gives each worker's ru_maxrss."""

    def __init__(self, workers: dict[str, tuple[str, dict]], slots: list[tuple[str, list[str], int]], sub: Path,
                 tag: str, timeout: float):
        self.slots, self.timeout = slots, timeout
        self.procs, self.lines, self.logs, self.files = {}, {}, {}, []
        self.phase = {k: None for k in workers}           # the slot a worker is in (for the RSS samples)
        self.samples: dict[tuple[str, str], dict[str, int]] = {}
        self.failed: dict[str, str] = {}
        for key, (kind, spec) in workers.items():
            log_path = sub / f"{tag}-{key}.log"
            f = open(log_path, "w")
            self.files.append(f)
            proc = subprocess.Popen([sys.executable, "-m", WORKER, kind, json.dumps({**spec, "lockstep": True})],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=f, text=True, cwd=REPO,
                                    env=child_env(), bufsize=1)
            q: "queue.Queue[str | None]" = queue.Queue()

            def pump(stream=proc.stdout, q=q):
                for line in stream:
                    q.put(line.rstrip("\n"))
                q.put(None)

            threading.Thread(target=pump, daemon=True).start()
            self.procs[key], self.lines[key], self.logs[key] = proc, q, log_path
        self.result_lines: dict[str, str] = {}
        self._stop = threading.Event()
        self._sampler = threading.Thread(target=self._sample, daemon=True)
        self._sampler.start()

    def _sample(self) -> None:
        while not self._stop.is_set():
            for key, proc in self.procs.items():
                slot = self.phase[key]
                if slot is not None:             # not proc.poll(): that would reap it before wait4
                    peak = self.samples.setdefault((key, slot), {})
                    for k, v in read_status(proc.pid).items():
                        peak[k] = max(peak.get(k, 0), v)
            time.sleep(0.1)

    def _expect(self, key: str, what: str) -> bool:
        """Read the worker's stdout up to the line `what`; False (and the worker marked failed) if it dies."""
        deadline = time.time() + self.timeout
        while True:
            try:
                line = self.lines[key].get(timeout=max(1.0, deadline - time.time()))
            except queue.Empty:
                line = None
                self.procs[key].kill()
            if line is None:
                self.failed.setdefault(key, f"exited or timed out waiting for {what}:\n{tail(self.logs[key])}")
                return False
            if line.startswith(RESULT_TAG):
                self.result_lines[key] = line
            if line == what:
                return True

    def run(self, on_step=None) -> None:
        for key in self.procs:                    # all load at once; measured steps start when all are ready
            self._expect(key, READY)
        for slot, keys, n in self.slots:
            keys = [k for k in keys if k not in self.failed]
            for k in keys:
                self.phase[k] = slot
            for i in range(n):
                for k in keys:
                    if k in self.failed:
                        continue
                    self.procs[k].stdin.write("step\n")
                    self.procs[k].stdin.flush()
                    if self._expect(k, STEP_DONE) and on_step:
                        on_step(slot, k, i)

    def finish(self) -> dict[str, dict]:
        """Close stdin, collect each worker's result and ru_maxrss."""
        out = {}
        for key, proc in self.procs.items():
            try:
                proc.stdin.close()
            except OSError:
                pass
            if key not in self.failed:            # drain to the result line and EOF
                self._expect(key, "\0never")       # returns at EOF (result line kept); kills a hung worker
                if key in self.result_lines:          # EOF after the result is the normal end, not a failure
                    self.failed.pop(key, None)
            _, status, ru = os.wait4(proc.pid, 0)
            code = proc.returncode = os.waitstatus_to_exitcode(status)
            line = self.result_lines.get(key)
            out[key] = {"code": code, "result": parse_result(line) if line else None,
                        "ru_maxrss": ru.ru_maxrss * 1024, "cpu_s": round(ru.ru_utime + ru.ru_stime, 2),
                        "log_tail": None if (code == 0 and line) else tail(self.logs[key])}
        self._stop.set()
        for f in self.files:
            f.close()
        return out
