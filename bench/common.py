"""What every bench shares: where things are, the host's fingerprint, the time stamp and logging.

No heavy imports: the bench parents import this, and so do the children before they load anything.
"""
from __future__ import annotations

import datetime as dt
import os
import platform
import time
from pathlib import Path

from ort_trainer.versions import tool_versions

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"                      # read-only real data beside the repository
CONFIGS = SHARED / "data" / "configs"                # real model configs: CONFIGS/<name>/config.json
TOKENIZERS = SHARED / "data" / "tokenizers"
RUNS = REPO / "docs" / "bench" / "runs"              # the dated run files (bench/runs.py)
DEFAULT_WORKDIR = Path("/tmp/pocketlora-bench")      # checkpoints, bundles, logs, quick runs

# Real model name -> tokenizer directory under TOKENIZERS. Gemma3's own SentencePiece tokenizer is not in
# ../shared; the GPT-2 fast tokenizer stands in (with random weights any tokenizer whose vocabulary fits works).
MODELS = {
    "gpt2-124m": "gpt2",
    "gemma3-270m": "gpt2",
    "qwen2.5-0.5b": "qwen2.5",
}
SHAPES = tuple(MODELS)
LORA = dict(r=8, alpha=16, targets="attn")            # what every bench trains: the generator's defaults
SEQ_LEN = 128
# the speed and memory benches build int4 with plain rounding: the codes' values change neither, and int4's default
# (GPTQ on text the model samples itself) would add minutes to each build
SPEED_INT4_CODES = ["--quant-calib", "none"]


def utc_now() -> str:
    """The time stamp of a run, as every run JSON records it ("date") and bench/runs.py names the run by."""
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def tail(path: Path, n: int = 15, skip: tuple[str, ...] = ()) -> str:
    """The last `n` non-empty lines of a log (carriage-return progress bars split into lines), leaving out
    those that contain any of `skip`."""
    text = path.read_text(errors="replace").replace("\r", "\n")
    lines = [ln for ln in text.splitlines() if ln.strip() and not any(s in ln for s in skip)]
    return "\n".join(lines[-n:])


def machine() -> dict:
    """This host as a run records it (run JSON "machine"); fingerprint() makes it one line."""
    meminfo = {ln.split(":")[0]: int(ln.split()[1]) * 1024 for ln in Path("/proc/meminfo").read_text().splitlines()}
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()

    def field(key: str) -> str:          # its value on the first processor, "" where absent
        return next((ln.split(":", 1)[1].strip() for ln in cpuinfo if ln.split(":", 1)[0].strip() == key), "")

    cpu = field("model name") or platform.processor() or "unknown"
    flags = set(field("flags").split())
    # The VM names every Intel host "Intel(R) Xeon(R) Processor"; family-model-stepping tells them apart
    # (seen here: models 167 and 207, with and without AMX), and runs on different hosts are no before/after.
    cpu_id = "-".join(v for v in (field("cpu family"), field("model"), field("stepping")) if v)
    return {
        "nproc": len(os.sched_getaffinity(0)),
        "ram_bytes": meminfo.get("MemTotal", 0),
        "swap_bytes": meminfo.get("SwapTotal", 0),
        "cpu_model": cpu,
        "cpu_id": cpu_id,
        "simd": [f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16") if f in flags],
        "python": platform.python_version(),
        "kernel": platform.release(),
        "versions": tool_versions(),
    }


def fingerprint(m: dict) -> str:
    """One line naming the host of a run: CPU and family-model-stepping, SIMD flags, CPUs, RAM, kernel.

    Runs before 2026-12-01 10:24 UTC recorded neither SIMD flags nor family-model-stepping; all of them ran on
    the AMD EPYC host with AVX2/FMA and no AVX-512 (as their reports say)."""
    cpu = " ".join(v for v in (m.get("cpu_model") or "unknown CPU", m.get("cpu_id")) if v)
    simd = ("SIMD " + " ".join(m["simd"])) if "simd" in m else "AVX2/FMA, no AVX-512"
    return f"{cpu}; {simd}; {m['nproc']} CPUs, {m['ram_bytes'] / 2**30:.1f} GiB RAM; Linux {m.get('kernel', '?')}"


def mib(n) -> str:
    """Bytes as whole MiB with thousands separators, as the reports write them."""
    return f"{n / 2**20:,.0f}"
