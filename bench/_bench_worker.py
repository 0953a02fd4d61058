"""Child processes of bench/train_throughput.py (one measured run per process), started by bench/children.py.

    python -m bench._bench_worker setup SPEC_JSON   checkpoint + bundle for one shape (cached)
    python -m bench._bench_worker ort   SPEC_JSON   the device path: TrainSession + train_step
    python -m bench._bench_worker torch SPEC_JSON   PyTorch eager + PEFT (eval.reference.reference_train)
    python -m bench._bench_worker gemm  SPEC_JSON   GEMM throughput on the step's matmul shapes (bench/throughput/gemm.py)

Each prints one line "BENCH_RESULT {json}" on stdout (bench.children.emit); everything else goes to stderr.
The `ort` worker blocks torch/transformers/peft imports (as on the device, see
tests/test_device_imports.py), so its RSS is what a phone would see.
"""
from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path

from bench.children import READY, done, emit, wait_turn
from bench.common import CONFIGS, MODELS, REPO
from bench.throughput.config import VARIANT_SUFFIX

LM_LR = 2e-4


def _maxrss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for ln in f:
            k, _, v = ln.partition(":")
            if k in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
                out[k] = int(v.split()[0]) * 1024
    return out


def _log(*a) -> None:
    print(*a, file=sys.stderr, flush=True)


# Lockstep (bench.children.Lockstep): the parent keeps one process per configuration alive and lets them take
# turns, one step at a time: READY once loaded, then per step wait for a line on stdin (wait_turn), step, print
# STEP_DONE (done). Nothing else runs while a step is measured.


def _examples(spec: dict, ph: dict, tok, seq_len: int, cache: dict):
    """A phase's examples (its own "data", else the spec's), tokenized once per file."""
    from ort_trainer.records import load_examples

    path = ph.get("data", spec.get("data"))
    if path not in cache:
        cache[path] = load_examples(path, tok, seq_len)
    return cache[path]


# ----------------------------------------------------------------------------------------- setup

# Shrunk versions of the real configs for --quick (same families and vocabularies, so the same tokenizers
# fit, except Gemma3's 262,144 which shrinks to 50,304: still >= the GPT-2 tokenizer's 50,257 it is run with).
QUICK_OVERRIDES = {
    "gpt2-124m": dict(n_layer=2, n_embd=64, n_head=4),
    "gemma3-270m": dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                        num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16,
                        layer_types=["sliding_attention", "full_attention"], vocab_size=50304),
    "qwen2.5-0.5b": dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                         num_key_value_heads=2, max_window_layers=2),
}
# The GPT-2 fallback variant (VARIANT_SUFFIX, see bench/throughput/config.py): the real config but n_positions 512.


def artifacts_gen_hash() -> str:
    import hashlib

    h = hashlib.sha256()
    for p in sorted((REPO / "artifacts_gen").glob("*.py")):
        h.update(p.name.encode() + p.read_bytes())
    return h.hexdigest()


def setup(spec: dict) -> dict:
    """Random-weight checkpoint (bench/gen_real_shapes.make_checkpoint) + bundle (build_bundle)."""
    from bench.gen_real_shapes import make_checkpoint, shard_mb_for

    name, base = spec["name"], spec["base"]          # name may be base + VARIANT_SUFFIX
    sub = Path(spec["subdir"])
    sub.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((CONFIGS / base / "config.json").read_text())
    if spec["quick"]:
        cfg.update(QUICK_OVERRIDES[base])
    if name.endswith(VARIANT_SUFFIX):
        cfg["n_positions"] = 512
    # make_checkpoint reads <configs>/<name>/config.json: point it at our (possibly shrunk or modified) copy of the
    # real config, with the base model's tokenizer.
    cfg_dir = sub / "configs" / name
    cfg_dir.mkdir(parents=True, exist_ok=True)
    text = json.dumps(cfg, indent=1)
    if not (cfg_dir / "config.json").is_file() or (cfg_dir / "config.json").read_text() != text:
        (cfg_dir / "config.json").write_text(text)
    t0 = time.time()
    info = make_checkpoint(name, sub, configs=sub / "configs", tokenizer=MODELS[base])
    ckpt_s = time.time() - t0
    ckpt = sub / f"{name}-ckpt"
    bundle = sub / f"{name}-bundle"
    stamp_file = sub / f"{name}-bundle.stamp"
    stamp = json.dumps({"ckpt": (sub / f"{name}-ckpt.stamp").read_text(), "lora": spec["lora"],
                        "seq_len": spec["seq_len"], "artifacts_gen": artifacts_gen_hash()})
    built = False
    build_s = 0.0
    if not (stamp_file.is_file() and stamp_file.read_text() == stamp and (bundle / "manifest.json").is_file()):
        from artifacts_gen.build import build_bundle
        from artifacts_gen.export import LoraSettings

        stamp_file.unlink(missing_ok=True)
        t0 = time.time()
        res = build_bundle(ckpt, bundle, lora=LoraSettings(**spec["lora"]), seq_len=spec["seq_len"],
                           shard_mb=shard_mb_for("auto", info["largest_tensor_bytes"]), force=True,
                           log=lambda *a: _log(*a))
        build_s = time.time() - t0
        _log(res.summary())
        stamp_file.write_text(stamp)
        built = True
    man = json.loads((bundle / "manifest.json").read_text())
    return {"name": name, "base": base, "ckpt": str(ckpt), "bundle": str(bundle), "config": cfg,
            "ckpt_info": info, "checkpoint_seconds": round(ckpt_s, 1), "bundle_built": built,
            "build_seconds": round(build_s, 1), "manifest_model": man["model"], "lora": man["lora"],
            "padding_free": man.get("padding_free", False),
            "shard_bytes": sum(f["bytes"] for f in man["files"] if f["role"] == "shard"),
            "trainable_params": sum(int(__import__("math").prod(t["shape"])) for t in man["trainable"])}


# --------------------------------------------------------------------------------------- common

def _batches(spec: dict, pad_id: int, examples, micro: int, accum: int):
    """The micro-batches android_runner/loop.py builds: DataOrder(n, seed, micro), accum of them per step."""
    from ort_trainer.batching import data_order, step_batches

    order = data_order(examples, spec.get("seed", 0), micro)
    while True:
        yield step_batches(examples, order, accum, pad_id)


def _shapes(micro_batches) -> list[list[int]]:
    """Per micro-batch: [B, L, real tokens, labelled tokens (shifted)]."""
    from ort_trainer.records import loss_token_count

    return [[int(mb["input_ids"].shape[0]), int(mb["input_ids"].shape[1]), int(mb["attention_mask"].sum()),
             loss_token_count(mb["labels"])] for mb in micro_batches]


# ------------------------------------------------------------------------------------------ ORT

def run_ort(spec: dict) -> dict:
    from ort_trainer.device_view import as_on_device

    as_on_device()                       # as on the device: torch cannot be imported
    t_start = time.perf_counter()
    from ort_trainer.bundle import open_bundle
    from ort_trainer.tokenizer import TextTokenizer
    from ort_trainer.memory import trim_heap
    from ort_trainer.session import RuntimeOptions, TrainSession
    from ort_trainer.step import train_step
    from android_runner.metrics import reset_peak_rss, torch_in_process

    rss = {"start": _status()}
    bundle = open_bundle(spec["bundle"], verify="sizes")
    tok = TextTokenizer.from_dir(bundle.tokenizer_dir)
    data_cache: dict = {}
    for ph in spec["phases"]:
        examples, report = _examples(spec, ph, tok, bundle.manifest.seq_len, data_cache)
    pad_id = tok.pad_id
    del tok                                           # as android_runner/loop.py: the data is tokenized
    trim_heap()
    rss["after_data"] = _status()
    options = RuntimeOptions(threads=spec["threads"], memory=spec.get("memory", "normal"))
    if spec.get("profile"):
        import dataclasses

        @dataclasses.dataclass(frozen=True)
        class Profiled(RuntimeOptions):
            def session_options(self, **kwargs):
                so = super().session_options(**kwargs)
                so.enable_profiling = True
                so.profile_file_prefix = spec["profile"]
                return so

        options = Profiled(threads=spec["threads"], memory=spec.get("memory", "normal"))
        # The optimizer session is built from the training session's own options, so both profile into the file
        # prefix + start second; started within one second, the later overwrote the earlier's file (seen here:
        # a "profile" of the optimizer alone). Start the optimizer in the next second; session time is not measured.
        import ort_trainer.session as ts

        class LaterOptimizer(ts.Optimizer):
            def __init__(self, *args):
                time.sleep(1.05 - time.time() % 1.0)
                super().__init__(*args)

        ts.Optimizer = LaterOptimizer
    t0 = time.perf_counter()
    session = TrainSession(bundle, options=options)
    session_s = time.perf_counter() - t0
    rss["after_session"] = _status()
    fit = None
    if spec.get("memory_budget_mb"):                  # the runner's --memory-budget: it measures, then splits
        from android_runner.memory_fit import fit_session

        t0 = time.perf_counter()
        effective = spec["phases"][0]["micro"] * spec["phases"][0]["accum"]
        fit = fit_session(session, bundle.manifest.seq_len, effective, spec["memory_budget_mb"], log=_log,
                          anonymous=spec.get("memory") == "low")
        if fit.needs_new_session:                     # as the runner does (android_runner/loop.py)
            from ort_trainer.memory import trim_heap

            del session
            trim_heap()
            session = TrainSession(bundle, options=options)
        fit = {**fit.to_dict(), "seconds": round(time.perf_counter() - t0, 2)}
        spec["phases"] = [{**ph, "micro": fit["micro_batch"], "accum": fit["accum"]} for ph in spec["phases"]]
        rss["after_fit"] = _status()
    done(spec, READY)
    phases, initial = [], {k: v.copy() for k, v in session.lora().items()}
    for ph in spec["phases"]:                         # the pilot and lockstep runs have several
        session.set_lora(initial)                     # every phase starts from the bundle's LoRA (B = 0); AdamW's
                                                      # moments carry over (timing and step-1 loss need only weights)
        reset_peak_rss()                              # so each phase's VmHWM is its own (the first is clean)
        examples, report = _examples(spec, ph, None, bundle.manifest.seq_len, data_cache)   # cached above
        gen = _batches(spec, pad_id, examples, ph["micro"], ph["accum"])
        steps = []
        for i in range(ph["warmup"] + ph["steps"]):
            micro = next(gen)
            wait_turn(spec)
            t0, c0 = time.perf_counter(), time.process_time()
            r = train_step(session, micro, LM_LR)
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            steps.append({"i": i, "warmup": i < ph["warmup"], "seconds": r.seconds, "wall": wall, "loss": r.loss,
                          "cpu_s": cpu, "load1": os.getloadavg()[0],
                          "tokens": r.tokens, "label_tokens": r.label_tokens, "micro_shapes": _shapes(micro),
                          "rss": _status()["VmRSS"]})
            _log(f"ort {ph['micro']}x{ph['accum']} step {i}: {r.seconds:.2f} s loss {r.loss:.4f} "
                 f"rss {steps[-1]['rss'] / 2**20:.0f} MiB")
            done(spec)
        phases.append({"micro": ph["micro"], "accum": ph["accum"], "steps": steps, "hwm": _status()["VmHWM"],
                       "data": ph.get("data", spec.get("data")),
                       "examples": {"examples": report.examples, "tokens": report.tokens, "label_tokens": report.label_tokens}})
    rss["end"] = _status()
    del session
    return {"backend": "ort", "memory": spec.get("memory", "normal"), "phases": phases, "memory_fit": fit,
            "session_seconds": round(session_s, 2), "total_seconds": round(time.perf_counter() - t_start, 2),
            "data": {"examples": report.examples, "tokens": report.tokens, "label_tokens": report.label_tokens},
            "rss": rss, "self_maxrss": _maxrss(),
            "torch_loaded": torch_in_process()}


# ---------------------------------------------------------------------------------------- torch

def run_torch(spec: dict) -> dict:
    t_start = time.perf_counter()
    import torch

    torch.set_num_threads(spec["threads"])
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass
    from transformers import AutoModelForCausalLM

    from eval.reference import TrainConfig, make_peft_model, reference_train
    from ort_trainer.tokenizer import TextTokenizer
    from ort_trainer.memory import trim_heap
    from android_runner.metrics import reset_peak_rss

    rss = {"start": _status()}
    man = json.loads((Path(spec["bundle"]) / "manifest.json").read_text())
    tok = TextTokenizer.from_dir(Path(spec["bundle"]) / "tokenizer")    # the very same examples as ORT
    data_cache: dict = {}
    for ph in spec["phases"]:
        examples, report = _examples(spec, ph, tok, man["seq_len"], data_cache)
    pad_id = tok.pad_id
    del tok                                           # as the ORT worker does
    trim_heap()
    rss["after_data"] = _status()
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(spec["ckpt"], dtype=torch.float32)
    attn = model.config._attn_implementation
    lora = man["lora"]
    peft_model = make_peft_model(model, r=lora["r"], alpha=lora["alpha"], dropout=lora["dropout"],
                                 target_modules=lora["target_modules"], fan_in_fan_out=lora["fan_in_fan_out"])
    load_s = time.perf_counter() - t0
    rss["after_model"] = _status()
    done(spec, READY)
    phases, peak_mb = [], 0.0
    initial = {n: p.detach().clone() for n, p in peft_model.named_parameters() if p.requires_grad}
    for ph in spec["phases"]:
        with torch.no_grad():                         # every phase starts from PEFT's initial LoRA (B = 0)
            for n, p in peft_model.named_parameters():
                if n in initial:
                    p.copy_(initial[n])
        reset_peak_rss()
        examples, report = _examples(spec, ph, None, man["seq_len"], data_cache)     # cached above
        total = ph["warmup"] + ph["steps"]
        gen = _batches(spec, pad_id, examples, ph["micro"], ph["accum"])
        steps: list[dict] = []

        def step_iter():
            for i in range(total):
                micro = next(gen)
                wait_turn(spec)
                steps.append({"i": i, "warmup": i < ph["warmup"], "micro_shapes": _shapes(micro),
                              "tokens": int(sum(int(m["attention_mask"].sum()) for m in micro)),
                              "label_tokens": sum(s[3] for s in _shapes(micro)), "t0": time.perf_counter(),
                              "c0": time.process_time()})
                yield micro

        def progress(step, total_steps, loss):
            s = steps[step - 1]
            s["seconds"] = time.perf_counter() - s.pop("t0")
            s["cpu_s"] = time.process_time() - s.pop("c0")
            s["load1"] = os.getloadavg()[0]
            s["wall"] = s["seconds"]
            s["loss"] = loss
            s["rss"] = _status()["VmRSS"]
            _log(f"torch {ph['micro']}x{ph['accum']} step {step - 1}: {s['seconds']:.2f} s loss {loss:.4f} "
                 f"rss {s['rss'] / 2**20:.0f} MiB")
            done(spec)

        cfg = TrainConfig(lr=LM_LR, warmup=0, schedule="constant", total_steps=total, clip=1.0)
        run = reference_train(peft_model, step_iter(), cfg, progress=progress)
        peak_mb = max(peak_mb, run.peak_rss_mb)
        phases.append({"micro": ph["micro"], "accum": ph["accum"], "steps": steps, "hwm": _status()["VmHWM"],
                       "data": ph.get("data", spec.get("data")),
                       "examples": {"examples": report.examples, "tokens": report.tokens, "label_tokens": report.label_tokens}})
    rss["end"] = _status()
    return {"backend": "torch", "attn_implementation": attn, "torch_threads": torch.get_num_threads(),
            "phases": phases,
            "load_seconds": round(load_s, 2), "total_seconds": round(time.perf_counter() - t_start, 2),
            "data": {"examples": report.examples, "tokens": report.tokens, "label_tokens": report.label_tokens},
            "rss": rss, "self_maxrss": _maxrss(), "reference_peak_rss_mb": peak_mb}


def main() -> int:
    kind, spec = sys.argv[1], json.loads(sys.argv[2])
    if spec.get("wait_stdin"):
        sys.stdin.readline()        # the parent moves us into a cgroup first; nothing loaded yet
    if kind == "gemm":
        from bench.throughput.gemm import run_gemm as fn
    else:
        fn = {"setup": setup, "ort": run_ort, "torch": run_torch}[kind]
    emit(fn(spec))
    return 0


if __name__ == "__main__":
    sys.exit(main())
