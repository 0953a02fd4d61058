"""Benchmark bundle generation (artifacts_gen.build_bundle) at the true shapes of real models.

For each real config in ../shared/data/configs/<name>/config.json this script
  1. (setup, not timed) builds a random-weight float32 model of exactly that shape, perturbs every
     parameter slightly (HF's init gives identical all-ones norm weights, which the ONNX exporter would
     deduplicate), and saves it as a HF checkpoint directory with a fast tokenizer;
  2. converts it in a separate child process (`--one NAME`), so the peak RSS is that conversion's
     alone, and records wall time, peak RSS, bundle size, shard count, checkpoint size and the
     trainable / frozen parameter counts read back from the bundle's manifest.json;
  3. writes the run, whole: docs/bench/runs/<date>-gen-real-shapes.md (bench/gen_real_shapes_render.py) and its
     raw results beside it (<same stem>.json).

    python -m bench.gen_real_shapes [--models gpt2-124m,gemma3-270m,qwen2.5-0.5b]
                                    [--workdir /tmp/pocketlora-bench] [--keep] [--shard-mb auto|N]

Checkpoints and bundles are deleted at the end unless --keep (they are GBs); the per-model
conversion logs stay in the workdir. --no-doc writes the run into the workdir instead of docs/.
Nothing is downloaded: configs and tokenizers come from ../shared.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import resource
import shutil
import sys
import time
from pathlib import Path

from bench import runs
from bench.children import emit, run_child
from bench.common import (CONFIGS, DEFAULT_WORKDIR, LORA, MODELS, REPO, RUNS, SEQ_LEN, SHAPES, TOKENIZERS, machine,
                          tail, utc_now)
from bench.gen_real_shapes_render import STAGE_LABELS, gb, mb, render_report

WHAT = "gen-real-shapes"         # run files: docs/bench/runs/<date>-gen-real-shapes.{md,json}
CHILD = "bench.gen_real_shapes"  # this module, run as a child: --make-ckpt NAME, --one NAME
# What is benchmarked: the generator's defaults (bench/common.py) except shard size (see shard_mb_for).
DEFAULT_SHARD_MB = 256
SEED = 0
STAMP_VERSION = 1
TAIL_SKIP = ("writing shards", "[I:onnxruntime:", "[W:onnxruntime:")     # log lines a failure's tail leaves out


# --------------------------------------------------------------------------------------------- setup

def _ckpt_dir(workdir: Path, name: str) -> Path:
    return workdir / f"{name}-ckpt"


def _bundle_dir(workdir: Path, name: str) -> Path:
    return workdir / f"{name}-bundle"


def _stamp(config: Path, tok_dir: Path) -> str:
    cfg = config.read_bytes()
    tok = b"".join(p.name.encode() + p.read_bytes() for p in sorted(tok_dir.iterdir()) if p.is_file())
    return json.dumps({"v": STAMP_VERSION, "seed": SEED, "config": hashlib.sha256(cfg).hexdigest(),
                       "tokenizer": hashlib.sha256(tok).hexdigest()})


def make_checkpoint(name: str, workdir: Path, configs: Path = CONFIGS, tokenizer: str | None = None) -> dict:
    """Random-weight checkpoint of the shape configs/<name>/config.json (+ the tokenizer TOKENIZERS/<tokenizer>,
    by default the model's own, MODELS[name]). Reused if already built identically."""
    tokenizer = tokenizer or MODELS[name]
    ckpt = _ckpt_dir(workdir, name)
    stamp_file = workdir / f"{name}-ckpt.stamp"
    stamp = _stamp(configs / name / "config.json", TOKENIZERS / tokenizer)
    if stamp_file.is_file() and stamp_file.read_text() == stamp and ckpt.is_dir():
        return {**json.loads((workdir / f"{name}-ckpt.info.json").read_text()), "reused": True}

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    t0 = time.time()
    if ckpt.exists():
        shutil.rmtree(ckpt)
    stamp_file.unlink(missing_ok=True)
    torch.manual_seed(SEED)
    cfg = AutoConfig.from_pretrained(configs / name, local_files_only=True)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():          # tied weights appear once
            p.add_(torch.randn_like(p) * 0.01)
    n_params = sum(p.numel() for p in model.parameters())
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    arch = type(model).__name__
    model.save_pretrained(ckpt, safe_serialization=True)
    del model
    AutoTokenizer.from_pretrained(TOKENIZERS / tokenizer, local_files_only=True).save_pretrained(ckpt)
    info = {
        "architecture": arch,
        "params": n_params,
        "largest_tensor_bytes": largest,
        "checkpoint_bytes": sum(p.stat().st_size for p in ckpt.rglob("*") if p.is_file()),
        "tokenizer": tokenizer,
        "setup_seconds": round(time.time() - t0, 1),
    }
    (workdir / f"{name}-ckpt.info.json").write_text(json.dumps(info, indent=1))
    stamp_file.write_text(stamp)
    return info


# --------------------------------------------------------------------------------------------- child

def _maxrss_bytes(who=resource.RUSAGE_SELF) -> int:
    return resource.getrusage(who).ru_maxrss * 1024      # Linux reports KiB


def _dir_bytes(path: Path) -> tuple[int, int]:
    """(sum of file sizes, allocated bytes on disk)."""
    size = alloc = 0
    for p in path.rglob("*"):
        if p.is_file():
            st = p.stat()
            size += st.st_size
            alloc += st.st_blocks * 512
    return size, alloc


def convert_one(name: str, workdir: Path, shard_mb: int) -> dict:
    """Runs in the child: build the bundle, then read everything back from disk."""
    rss_start = _maxrss_bytes()
    from artifacts_gen.build import build_bundle
    from artifacts_gen.export import LoraSettings

    rss_imports = _maxrss_bytes()
    ckpt, bundle = _ckpt_dir(workdir, name), _bundle_dir(workdir, name)
    if bundle.exists():
        shutil.rmtree(bundle)

    stages = []
    t0 = time.time()

    def log(*args):
        msg = " ".join(str(a) for a in args)
        now = time.time() - t0
        if msg.startswith("[") and "/" in msg[:6]:
            stages.append({"stage": msg.strip(), "t_start": round(now, 2), "peak_rss_before": _maxrss_bytes()})
        print(f"[{now:7.1f}s rss-peak {_maxrss_bytes() / 2**30:5.2f} GiB] {msg}", file=sys.stderr, flush=True)

    result = build_bundle(ckpt, bundle, lora=LoraSettings(**LORA), seq_len=SEQ_LEN, shard_mb=shard_mb, log=log)
    total = time.time() - t0
    peak = max(_maxrss_bytes(), _maxrss_bytes(resource.RUSAGE_CHILDREN))
    for i, s in enumerate(stages):
        end = stages[i + 1]["t_start"] if i + 1 < len(stages) else total
        s["seconds"] = round(end - s["t_start"], 2)
        s["peak_rss_after"] = stages[i + 1]["peak_rss_before"] if i + 1 < len(stages) else peak
    print(result.summary(), file=sys.stderr, flush=True)

    manifest = json.loads((bundle / "manifest.json").read_text())
    files = manifest["files"]
    trainable = sum(math.prod(t["shape"]) for t in manifest["trainable"])
    ckpt_path = bundle / "checkpoint"
    ckpt_bytes = _dir_bytes(ckpt_path)[0] if ckpt_path.is_dir() else ckpt_path.stat().st_size
    shards = sorted(p for p in bundle.iterdir() if p.name.startswith("weights-"))
    size, alloc = _dir_bytes(bundle)
    return {
        "name": name,
        "ok": True,
        "family": manifest["family"],
        "architecture": manifest["model"]["architecture"],
        "num_layers": manifest["model"]["num_layers"],
        "hidden_size": manifest["model"]["hidden_size"],
        "vocab_size": manifest["model"]["vocab_size"],
        "tie_word_embeddings": manifest["model"]["tie_word_embeddings"],
        "frozen_params": manifest["model"]["frozen_params"],
        "trainable_params": trainable,
        "trainable_tensors": len(manifest["trainable"]),
        "lora": {k: manifest["lora"][k] for k in ("r", "alpha", "targets", "target_modules")},
        "seq_len": manifest["seq_len"],
        "traced_seq_len": manifest["traced_seq_len"],
        "opset": manifest["opset"],
        "shard_mb": shard_mb,
        "build_seconds": round(result.seconds, 2),
        "bundle_bytes": size,
        "bundle_bytes_allocated": alloc,
        "bundle_bytes_manifest": result.bundle_bytes,
        "shard_files": len(shards),
        "shard_bytes": sum(p.stat().st_size for p in shards),
        "checkpoint_bytes": ckpt_bytes,
        "training_model_bytes": (bundle / "training_model.onnx").stat().st_size,
        "eval_model_bytes": (bundle / "eval_model.onnx").stat().st_size,
        "optimizer_model_bytes": (bundle / "optimizer_model.onnx").stat().st_size,
        "tokenizer_bytes": sum(f["bytes"] for f in files if f["role"] == "tokenizer"),
        "rss_at_start": rss_start,
        "rss_after_imports": rss_imports,
        "child_self_peak_rss": peak,
        "stages": stages,
    }


# -------------------------------------------------------------------------------------------- parent

def shard_mb_for(requested: str, largest_tensor_bytes: int) -> int:
    """A tensor never straddles two shard files, so a shard must hold the largest tensor (the embedding:
    640 MiB for Gemma3-270M, 519 MiB for Qwen2.5-0.5B). 'auto' = the 256 MB default, raised just enough."""
    need = largest_tensor_bytes // 2**20 + 1
    if requested == "auto":
        return max(DEFAULT_SHARD_MB, need)
    return int(requested)


def _stage_reached(path: Path) -> str:
    import re

    found = re.findall(r"\] (\[\d/5\])", path.read_text(errors="replace"))
    return STAGE_LABELS.get(found[-1], found[-1]) if found else "before [1/5]"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(SHAPES),
                    help=f"comma-separated, from: {', '.join(MODELS)} (default: all)")
    ap.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR)
    ap.add_argument("--keep", action="store_true", help="keep the checkpoints and bundles in the workdir")
    ap.add_argument("--shard-mb", default="auto",
                    help="shard size; 'auto' = 256, raised to fit the largest tensor (default: auto)")
    ap.add_argument("--no-doc", action="store_true",
                    help="write the run into the workdir, not docs/bench/runs/ (with --render-only: print it)")
    ap.add_argument("--render-only", action="store_true",
                    help="re-render a run's report from its JSON (--run, default the newest in docs/bench/runs/) "
                         "without converting anything")
    ap.add_argument("--run", type=Path, help="with --render-only: the run's JSON")
    ap.add_argument("--one", metavar="NAME", help=argparse.SUPPRESS)            # child: convert one model
    ap.add_argument("--make-ckpt", metavar="NAME", help=argparse.SUPPRESS)      # child: setup one checkpoint
    ap.add_argument("--child-shard-mb", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    workdir = args.workdir.absolute()

    if args.make_ckpt:
        emit(make_checkpoint(args.make_ckpt, workdir))
        return 0
    if args.one:
        emit(convert_one(args.one, workdir, args.child_shard_mb))
        return 0

    if args.render_only:
        raw_json = args.run or runs.latest(RUNS, WHAT)
        raw = json.loads(raw_json.read_text())
        report = render_report(raw.pop("results"), raw, raw_json.stem)
        print(report) if args.no_doc else runs.write(raw_json.parent, raw_json.stem, report)
        return 0

    names = [n.strip() for n in args.models.split(",") if n.strip()]
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        ap.error(f"--models: unknown {', '.join(unknown)}; known: {', '.join(MODELS)}")
    missing = [n for n in names if not (CONFIGS / n / "config.json").is_file()]
    if missing:
        ap.error(f"no config.json for {', '.join(missing)} under {CONFIGS}")
    workdir.mkdir(parents=True, exist_ok=True)

    command = "python -m bench.gen_real_shapes"
    if names != list(SHAPES):
        command += f" --models {','.join(names)}"
    if args.shard_mb != "auto":
        command += f" --shard-mb {args.shard_mb}"
    info = {
        "date": utc_now(),
        "command": command,
        "machine": machine(),
        "settings": {"lora": LORA, "seq_len": SEQ_LEN, "shard_mb": args.shard_mb, "seed": SEED},
    }
    results = []
    for name in names:
        print(f"== {name}: checkpoint (setup, not timed)", flush=True)
        setup = run_child([CHILD, "--make-ckpt", name, "--workdir", str(workdir)],
                          workdir / f"{name}-setup.log", timeout=None)
        ckpt = setup.result
        if not setup.ok:
            print(tail(setup.log_path, 40, TAIL_SKIP), file=sys.stderr)
            results.append({"name": name, "ok": False, "error_summary": f"checkpoint setup failed (exit {setup.code})",
                            "log": tail(setup.log_path, 40, TAIL_SKIP)})
            continue
        shard_mb = shard_mb_for(args.shard_mb, ckpt["largest_tensor_bytes"])
        print(f"   {ckpt['params'] / 1e6:.1f} M params, checkpoint {mb(ckpt['checkpoint_bytes'])} MiB, "
              f"largest tensor {mb(ckpt['largest_tensor_bytes'])} MiB -> --shard-mb {shard_mb} "
              f"({'reused' if ckpt.get('reused') else f'setup {setup.wall:.0f} s'})", flush=True)
        print(f"== {name}: converting in a child process (log: {workdir / f'{name}-convert.log'})", flush=True)
        log_path = workdir / f"{name}-convert.log"
        load_before = os.getloadavg()[0]
        c = run_child([CHILD, "--one", name, "--workdir", str(workdir), "--child-shard-mb", str(shard_mb)],
                      log_path, timeout=None)
        code, res, wall, rss = c.code, c.result, c.wall, c.maxrss
        load = {"loadavg_1min_before": round(load_before, 2), "loadavg_1min_after": round(os.getloadavg()[0], 2)}
        if not c.ok:
            log_tail = tail(log_path, 40, TAIL_SKIP)
            last = next((ln for ln in reversed(log_tail.splitlines()) if ln.strip()), f"exit {code}")
            print(f"   FAILED (exit {code}) after {wall:.0f} s, peak RSS {gb(rss)} GiB:\n{log_tail}", file=sys.stderr)
            results.append({"name": name, "ok": False, "exit_code": code, "wall_seconds": round(wall, 1),
                            "peak_rss_bytes": rss, "shard_mb": shard_mb, "failed_in": _stage_reached(log_path),
                            "error_summary": last[:300], "log": log_tail, "source_checkpoint": ckpt, **load})
            continue
        res.update(wall_seconds=round(wall, 1), peak_rss_bytes=rss, source_checkpoint=ckpt, **load)
        results.append(res)
        print(f"   ok: build {res['build_seconds']:.0f} s (wall {wall:.0f} s), peak RSS {gb(rss)} GiB, "
              f"bundle {mb(res['bundle_bytes'])} MiB in {res['shard_files']} shard(s), "
              f"checkpoint {res['checkpoint_bytes'] / 1024:.0f} KiB, trainable {res['trainable_params']:,}, "
              f"frozen {res['frozen_params']:,}", flush=True)

    if not args.keep:
        for name in names:
            for p in (_bundle_dir(workdir, name), _ckpt_dir(workdir, name)):
                shutil.rmtree(p, ignore_errors=True)
            for suffix in ("-ckpt.stamp", "-ckpt.info.json"):
                (workdir / f"{name}{suffix}").unlink(missing_ok=True)

    run = runs.stem(info["date"], WHAT)
    written = runs.write(workdir if args.no_doc else RUNS, run, render_report(results, info, run),
                         {**info, "results": results})
    print("wrote " + ", ".join(str(p.relative_to(REPO) if p.is_relative_to(REPO) else p) for p in written))
    return 0 if all(r.get("ok") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
