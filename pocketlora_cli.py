"""`pocketlora`: one command, one verb per stage of the flow. No logic lives here: each verb parses
its options and calls into the packages (workstation: artifacts_gen, eval; device: ort_trainer,
android_runner). Faults of the inputs print one line and exit 2, faults of the environment (full disk, read-only
output) one line and exit 3 (see main, docs/FAULTS.md)."""
from __future__ import annotations

import argparse
import sys

from ort_trainer.settings import add_arguments, from_args


def _gen(args) -> None:
    from artifacts_gen.build import build_bundle
    from artifacts_gen.export import LoraSettings

    result = build_bundle(
        args.model, args.out, gguf_file=args.gguf_file,
        lora=LoraSettings(r=args.lora_r, alpha=args.lora_alpha, dropout=args.lora_dropout,
                          targets=args.targets, seed=args.seed),
        seq_len=args.seq_len, shard_mb=args.shard_mb, head_chunks=args.head_chunks,
        head_min_rows=args.head_min_rows, head_vocab_cols=args.head_vocab_cols, quant=args.quant,
        quant_block=args.quant_block, quant_calib=args.quant_calib, quant_calib_tokens=args.quant_calib_tokens,
        force=args.force,
    )
    print(result.summary())


def _add_gen(sub) -> None:
    p = sub.add_parser("gen", help="workstation: build a training bundle from a local HF checkpoint or GGUF")
    p.add_argument("--model", required=True, help="checkpoint directory (config.json + safetensors + tokenizer) or a directory with a .gguf")
    p.add_argument("--out", required=True, help="bundle directory to create")
    p.add_argument("--gguf-file", default=None, help="which .gguf file in --model (if several)")
    p.add_argument("--lora-r", type=int, default=8)
    p.add_argument("--lora-alpha", type=float, default=16.0)
    p.add_argument("--lora-dropout", type=float, default=0.0)
    p.add_argument("--targets", default="attn", help="attn (q/k/v/o) | mlp-out (the MLP output projection: down_proj, GPT-2 mlp.c_proj) | all-linear | comma list of module names")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--shard-mb", type=int, default=256)
    p.add_argument("--head-chunks", type=int, default=None,
                   help="(default 8) the training graph computes the LM head and its gradient in up to this many row "
                        "slices of at least --head-min-rows labelled rows; each row slice re-reads the head weight")
    p.add_argument("--head-min-rows", type=int, default=None,
                   help="(default 1024) the least labelled rows per head row slice; fewer = less memory at large "
                        "micro-batches, one more pass over the head weight per extra slice (~115 ms for Gemma3's "
                        "671 MB)")
    p.add_argument("--head-vocab-cols", type=int, default=None,
                   help="(default 16384) within a row slice, the vocabulary is read in slices of at most this many "
                        "entries with an online softmax, so the head's largest tensor is [rows, this]")
    p.add_argument("--quant", default=None, help="the frozen weights in the bundle: none (float32) | int8 (linear "
                   "layers per column) | int4 (per block of --quant-block rows) | keep (a GGUF source's own blocks, "
                   "exactly); embedding and LM head int8 per row. Dequantized just in time while training. Default: "
                   "keep for a GGUF source, none otherwise")
    p.add_argument("--quant-block", type=int, default=32, help="int4's rows per scale block (default 32)")
    p.add_argument("--quant-calib", default=None, metavar="self|TEXT_FILE|none",
                   help="int4 only: how its codes are chosen. self (default): GPTQ on 8192 tokens the source model "
                        "samples itself, no data needed; TEXT_FILE: GPTQ on this text (plain UTF-8, like the data the "
                        "model will see); none: each block rounded to its nearest grid. Real Gemma3-270M perplexity "
                        "vs float32: docs/STATUS.md")
    p.add_argument("--quant-calib-tokens", type=int, default=None,
                   help="calibration tokens (default 8192 sampled, or up to 16384 read from TEXT_FILE)")
    p.add_argument("--seed", type=int, default=0, help="seed of PEFT's LoRA initialisation")
    p.add_argument("--force", action="store_true", help="replace an existing bundle in --out")
    p.set_defaults(func=_gen)


def _as_on_device() -> None:
    """`train`, `export`, `federate`... run as on a phone, where torch is absent (ort_trainer/device_view.py)."""
    from ort_trainer.device_view import as_on_device

    as_on_device()


def _train(args) -> None:
    from dataclasses import asdict

    _as_on_device()

    from android_runner.gate import GateConfig
    from android_runner.loop import RunConfig, train


    gate = GateConfig(slow_below=args.slow_below, slow_factor=args.slow_factor, pause_below=args.pause_below,
                      resume_above=args.resume_above, max_temp=args.max_temp)
    cfg = RunConfig(
        **from_args(args), bundle=str(args.bundle), data=str(args.data), epochs=args.epochs,
        max_steps=args.max_steps, save_every=args.save_every, battery=args.battery, gate=asdict(gate),
        threads=args.threads, memory=args.memory, memory_budget=args.memory_budget,
    )
    train(cfg, args.out)


def _add_train(sub) -> None:
    p = sub.add_parser("train", help="device: train a bundle's LoRA on local data (running it again resumes)")
    p.add_argument("--bundle", required=True)
    p.add_argument("--data", required=True, help=".txt (packed into seq-len blocks), .jsonl or .json (instruction/chat records)")
    p.add_argument("--out", required=True, help="run directory (metrics, checkpoints, summary)")
    steps = p.add_mutually_exclusive_group()
    steps.add_argument("--epochs", type=int)
    steps.add_argument("--max-steps", type=int)
    add_arguments(p)
    p.add_argument("--save-every", type=int, default=50)
    p.add_argument("--battery", default="auto", help="auto|android-sysfs|dumpsys|termux|linux|replay:TRACE.csv|none")
    p.add_argument("--slow-below", type=float, default=60.0)
    p.add_argument("--slow-factor", type=float, default=0.5)
    p.add_argument("--pause-below", type=float, default=15.0)
    p.add_argument("--resume-above", type=float, default=30.0)
    p.add_argument("--max-temp", type=float, default=42.0)
    p.add_argument("--threads", type=int, default=0, help="ORT intra-op threads (0: ORT default)")
    p.add_argument("--memory", default="normal", choices=["normal", "low"],
                   help="low: frozen weights stay memory-mapped (no prepacked copies)")
    p.add_argument("--memory-budget", default=None, metavar="MIB|auto",
                   help="split the effective batch (micro-batch x accum) by measuring: the largest micro-batch whose "
                        "peak RSS fits this many MiB (or 2.8G; auto: 80%% of MemAvailable + own RSS, or of the "
                        "cgroup limit). Two worst-case passes at start; a resumed run keeps its first split")
    p.set_defaults(func=_train)


def _export(args) -> None:
    _as_on_device()
    from android_runner.chat import run_lora
    from ort_trainer.adapter import export_onnx, export_peft

    # --onnx copies the eval graph and every shard into the export: check them all, or a damaged byte goes along
    bundle, lora, step = run_lora(args.run, verify="hashes" if args.onnx else "sizes")
    if args.peft:
        print(f"PEFT adapter (step {step}): {export_peft(bundle.manifest, lora, args.peft)}")
    if args.onnx:
        print(f"ONNX model with the adapter baked in (step {step}): {export_onnx(bundle, lora, args.onnx)}")


def _add_export(sub) -> None:
    p = sub.add_parser("export", help="device: write the trained adapter as a PEFT directory and/or one ONNX model")
    p.add_argument("--run", required=True)
    p.add_argument("--peft", help="output directory: adapter_config.json + adapter_model.safetensors")
    p.add_argument("--onnx", help="output .onnx for plain onnxruntime (weights beside it in .onnx.data)")
    p.set_defaults(func=_export)


def _sampling(args):
    from ort_trainer.sampling import Sampling

    return Sampling(max_new_tokens=args.max_new_tokens, temperature=0.0 if args.greedy else args.temperature,
                    top_k=args.top_k, top_p=args.top_p, seed=args.seed)


def _generate(args) -> None:
    _as_on_device()
    from android_runner.chat import generate_texts, open_with_adapter, read_prompts

    texts = read_prompts(args.prompt, args.prompts_file)
    sampling = _sampling(args)
    sampling.check()
    decoder, tok, _ = open_with_adapter(args.bundle, args.run, args.peft, args.threads)
    generate_texts(decoder, tok, texts, sampling, args.raw, tuple(args.stop), args.json, args.batch_size)


def _chat(args) -> None:
    _as_on_device()
    from android_runner.chat import chat, open_with_adapter

    sampling = _sampling(args)
    sampling.check()
    decoder, tok, _ = open_with_adapter(args.bundle, args.run, args.peft, args.threads)
    chat(decoder, tok, sampling, tuple(args.stop))


def _add_decoding(p, max_new: int) -> None:
    from ort_trainer.sampling import Sampling

    d = Sampling()
    p.add_argument("--bundle", help="the bundle (default with --run: the bundle the run trained)")
    who = p.add_mutually_exclusive_group()
    who.add_argument("--run", help="apply this training run's latest adapter")
    who.add_argument("--peft", help="apply this PEFT LoRA directory (e.g. from `pocketlora export --peft`)")
    p.add_argument("--max-new-tokens", type=int, default=max_new)
    p.add_argument("--greedy", action="store_true", help="always the most likely token (no sampling)")
    p.add_argument("--temperature", type=float, default=d.temperature, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=d.top_k, help="sample among the k most likely (0: all)")
    p.add_argument("--top-p", type=float, default=d.top_p, help="... and within them the smallest set of this mass")
    p.add_argument("--seed", type=int, default=d.seed, help="the sampling seed: the same seed, the same text")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop when this text appears "
                   "(repeatable); the model's end-of-turn token always stops")
    p.add_argument("--threads", type=int, default=0, help="ORT intra-op threads (0: ORT default)")


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="device: generate text with the bundle's KV-cache decoder and an adapter")
    _add_decoding(p, 128)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    src.add_argument("--prompts-file", help="prompts, one per line (- for stdin)")
    p.add_argument("--raw", action="store_true", help="no chat template: the text as it is, after the tokenizer's "
                   "own special prefix")
    p.add_argument("--json", action="store_true", help='one line per prompt: {"token_ids": [...], "text": "..."}')
    p.add_argument("--batch-size", type=int, default=8, help="prompts decoded together")
    p.set_defaults(func=_generate)


def _add_chat(sub) -> None:
    p = sub.add_parser("chat", help="device: talk with the model (and its adapter) through the bundle's chat template")
    _add_decoding(p, 256)
    p.set_defaults(func=_chat)


def _web(args) -> None:
    from functools import partial

    from android_runner.web_server import make_server

    server = make_server(args.bundle, host=args.host, port=args.port, data_dir=args.data_dir,
                         log=None if args.quiet else partial(print, flush=True))
    host, port = server.server_address[:2]
    print(f"phone runner page for {args.bundle}: http://{host}:{port}/  (Ctrl-C stops)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


def _add_web(sub) -> None:
    p = sub.add_parser("web", help="device: serve the phone runner's page (training in the browser, WASM) for a bundle")
    p.add_argument("--bundle", required=True)
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default loopback). A phone: keep "
                   "loopback and run `adb reverse tcp:PORT tcp:PORT`, then open http://localhost:PORT there; the page "
                   "needs a secure context (localhost or https) for its storage and threads")
    p.add_argument("--quiet", action="store_true", help="no request log")
    p.add_argument("--data-dir", help="for tests and automation: also serve this directory at /data/, so that "
                                      "the page can be given ?data=/data/FILE (a person picks a local file instead)")
    p.set_defaults(func=_web)


def _setup(args) -> None:
    from android_runner.web_setup import setup

    setup()


def _add_setup(sub) -> None:
    p = sub.add_parser("setup", help="install the phone runner's npm packages (and Chromium, for its page tests)")
    p.set_defaults(func=_setup)


def _demo(args) -> None:
    from dataclasses import replace

    from eval.demo import Recipe, run_demo

    recipe = Recipe() if args.steps is None else replace(Recipe(), steps=args.steps)
    run_demo(args.workdir, model=args.model, recipe=recipe)


def _add_demo(sub) -> None:
    p = sub.add_parser("demo", help="end to end: personalize the real Gemma3-270M on private wearable records")
    p.add_argument("--workdir", default="pocketlora-demo", help="where data, bundle, run and report go")
    p.add_argument("--steps", type=int, default=None, help="training steps (default: the tuned recipe's)")
    p.add_argument("--model", default=None, help="another checkpoint (HF dir or GGUF dir) instead of the embedded default")
    p.set_defaults(func=_demo)


def _eval_ppl(args) -> None:
    from eval.verbs import print_ppl, run_ppl, write_json

    result = run_ppl(args.bundle, args.data, run=args.run, peft=args.peft, seq_len=args.seq_len, stride=args.stride,
                     max_tokens=args.max_tokens, backend=args.backend, threads=args.threads,
                     batch_size=args.batch_size, bos_per_window=args.bos_per_window)
    print_ppl(result)
    write_json(result, args.out)


def _eval_mmlu(args) -> None:
    from eval.verbs import print_mmlu, run_mmlu, write_json

    result = run_mmlu(args.bundle, args.data, run=args.run, peft=args.peft, shots=args.shots,
                      subjects=args.subjects, split=args.split, limit=args.limit, backend=args.backend,
                      threads=args.threads, max_len=args.max_len, batch_size=args.batch_size,
                      predictions=args.predictions)
    print_mmlu(result)
    write_json(result, args.out)


def _eval_decode(args) -> None:
    from eval.decode_parity import PROMPTS, print_decode_parity, run_decode_parity
    from eval.verbs import write_json

    result = run_decode_parity(args.bundle, run=args.run, peft=args.peft, prompts=tuple(args.prompt or PROMPTS),
                               new=args.new, threads=args.threads)
    print_decode_parity(result)
    write_json(result, args.out)


def _eval_parity(args) -> None:
    from eval.verbs import print_parity
    from eval.parity import ParityConfig, run_parity

    if args.lockstep:
        from eval.lockstep import print_lockstep, run_lockstep

        print_lockstep(run_lockstep(ParityConfig(**from_args(args), bundle=args.bundle, data=args.data, out=args.out,
                                                 steps=args.steps, threads=args.threads),
                                    float64_every=args.float64_every), args.out)
        return
    report = run_parity(ParityConfig(
        **from_args(args), bundle=args.bundle, data=args.data, out=args.out, steps=args.steps,
        heldout=args.heldout, ppl_seq_len=args.seq_len, ppl_stride=args.stride,
        heldout_max_tokens=args.max_tokens, mmlu_data=args.mmlu_data, mmlu_subjects=args.mmlu_subjects,
        mmlu_limit=args.mmlu_limit, mmlu_split=args.mmlu_split, shots=args.shots, threads=args.threads,
        isolate=not args.in_process, force=args.force, floor=args.floor,
    ))
    print_parity(report, args.out)


def _add_eval(sub) -> None:
    p = sub.add_parser("eval", help="workstation: perplexity, MMLU, and ORT-vs-PyTorch training parity reports")
    verbs = p.add_subparsers(dest="eval_verb", required=True)

    def weights_and_backend(q) -> None:
        q.add_argument("--bundle", required=True)
        w = q.add_mutually_exclusive_group()
        w.add_argument("--run", help="LoRA from a training run's latest checkpoint (the --out of `pocketlora train`)")
        w.add_argument("--peft", help="LoRA from a PEFT adapter directory (adapter_model.safetensors)")
        q.add_argument("--backend", default="ort", choices=["ort", "torch"],
                       help="ort: the bundle's eval graph; torch: the source model + PEFT (workstation)")
        q.add_argument("--threads", type=int, default=0, help="ORT / torch threads (0: library default)")
        q.add_argument("--batch-size", type=int, default=8, help="windows or prompts per forward")
        q.add_argument("--out", help="also write the result as JSON to this file")

    q = verbs.add_parser("ppl", help="sliding-window perplexity of a text file (no --run/--peft: the base model)")
    weights_and_backend(q)
    q.add_argument("--data", required=True, help="text file, tokenized with the bundle tokenizer")
    q.add_argument("--seq-len", type=int, default=None, help="window length (default: the bundle's seq_len)")
    q.add_argument("--stride", type=int, default=None, help="window step (default: min(128, seq-len))")
    q.add_argument("--max-tokens", type=int, default=None, help="score only the first N tokens of the file")
    q.add_argument("--bos-per-window", action="store_true",
                   help="start every window with the tokenizer's BOS (for models always trained with one, e.g. "
                        "Gemma); default: HF's definition, BOS once at the start of the file")
    q.set_defaults(func=_eval_ppl)

    q = verbs.add_parser("mmlu", help="k-shot MMLU accuracy from next-token logits over ' A'..' D'")
    weights_and_backend(q)
    q.add_argument("--data", required=True, help="MMLU data directory with dev/, val/, test/ csv files")
    q.add_argument("--shots", type=int, default=5, choices=[0, 5])
    q.add_argument("--subjects", nargs="+", default=None, help="default: every subject found")
    q.add_argument("--split", default="test", choices=["test", "val"])
    q.add_argument("--limit", type=int, default=None, help="first N questions per subject")
    q.add_argument("--max-len", type=int, default=None, help="prompt token budget (default: min(2048, positions - 1))")
    q.add_argument("--predictions", action="store_true", help="include per-question predictions in --out")
    q.set_defaults(func=_eval_mmlu)

    q = verbs.add_parser("decode", help="the bundle's KV-cache decoder vs transformers generate() + PEFT: greedy "
                                        "tokens and per-step logits")
    q.add_argument("--bundle", required=True)
    w = q.add_mutually_exclusive_group()
    w.add_argument("--run", help="LoRA from a training run's latest checkpoint")
    w.add_argument("--peft", help="LoRA from a PEFT adapter directory")
    q.add_argument("--prompt", action="append", help="a prompt (repeatable; default: three fixed ones)")
    q.add_argument("--new", type=int, default=64, help="greedy tokens per prompt (default 64)")
    q.add_argument("--threads", type=int, default=0)
    q.add_argument("--out", help="also write the result as JSON to this file")
    q.set_defaults(func=_eval_decode)

    q = verbs.add_parser("parity", help="train with the device runner (ORT) and with PyTorch + PEFT on the same "
                                        "batches, then compare losses, weights, perplexity and MMLU")
    q.add_argument("--bundle", required=True)
    q.add_argument("--data", required=True, help="training file (as for `pocketlora train`)")
    q.add_argument("--out", required=True, help="report directory (report.md, report.json, plots, both runs)")
    q.add_argument("--steps", type=int, default=200)
    add_arguments(q)
    q.add_argument("--heldout", help="text file for the held-out perplexity check")
    q.add_argument("--seq-len", type=int, default=None, help="perplexity window (default: the bundle's seq_len)")
    q.add_argument("--stride", type=int, default=None, help="perplexity stride (default: min(128, seq-len))")
    q.add_argument("--max-tokens", type=int, default=None, help="score only the first N held-out tokens")
    q.add_argument("--mmlu-data", help="MMLU data directory; enables the MMLU comparison")
    q.add_argument("--mmlu-subjects", nargs="+", default=None)
    q.add_argument("--mmlu-limit", type=int, default=None, help="first N questions per subject")
    q.add_argument("--mmlu-split", default="test", choices=["test", "val"])
    q.add_argument("--shots", type=int, default=5, choices=[0, 5])
    q.add_argument("--threads", type=int, default=0, help="ORT / torch threads for training (0: library default)")
    q.add_argument("--in-process", action="store_true",
                   help="train both sides in this process instead of one subprocess each (faster start; peak RSS "
                        "is then not per side)")
    q.add_argument("--force", action="store_true", help="replace ort_run/ and torch_run/ left in --out")
    q.add_argument("--floor", action="store_true",
                   help="also train ORT with the same steps split into other micro-batches: the loss-curve check "
                        "then passes when ORT vs PyTorch drifts <= 1.5x as far as ORT from itself")
    q.add_argument("--lockstep", action="store_true",
                   help="instead: compare each step from the same adapter and optimizer state (loss, gradients, "
                        "update; eval/lockstep.py), writing OUT/lockstep.md")
    q.add_argument("--float64-every", type=int, default=0, metavar="N",
                   help="with --lockstep: also run step 1, every Nth step and every outlier step in float64 "
                        "PyTorch, to show each side's own float32 error (default 0: off)")
    q.set_defaults(func=_eval_parity)


def _federate(args) -> None:
    _as_on_device()      # the server and the devices need no torch either
    from federated.cli import config_from_args
    from federated.run import federate

    federate(config_from_args(args), args.out)


def _add_federate(sub) -> None:
    from federated.cli import add_arguments

    p = sub.add_parser("federate", help="simulation: federated LoRA personalization over N virtual devices (Flower)")
    add_arguments(p)
    p.set_defaults(func=_federate)


def _user_errors() -> tuple[type[BaseException], ...]:
    """Errors whose message already names the problem and the fix."""
    errors: list[type[BaseException]] = [FileExistsError, FileNotFoundError]
    from ort_trainer.bundle import BundleError
    from ort_trainer.manifest import ManifestError

    errors += [BundleError, ManifestError]
    try:
        from artifacts_gen.export import ExportError
        from artifacts_gen.families import UnsupportedModel
        from artifacts_gen.source import SourceError

        errors += [SourceError, UnsupportedModel, ExportError]
    except ImportError:   # a device install has no workstation extras
        pass
    try:
        from ort_trainer.tokenizer import DataError

        from android_runner.loop import RunError

        errors += [DataError, RunError]
    except ImportError:
        pass
    from android_runner.web_server import WebServerError
    from android_runner.web_setup import SetupError

    errors += [WebServerError, SetupError]
    return tuple(errors)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pocketlora", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="verb", required=True)
    _add_gen(sub)
    _add_train(sub)
    _add_export(sub)
    _add_generate(sub)
    _add_chat(sub)
    _add_demo(sub)
    _add_web(sub)
    _add_setup(sub)
    _add_eval(sub)
    _add_federate(sub)
    return parser


# What a rerun does after a fault of the environment (exit 3), by verb.
RERUN = {
    "gen": "The --out is as it was: {fix} and run the same command again",
    "train": "Nothing saved is lost: {fix} and run the same command again to resume",
    "export": "The run is untouched: {fix} and run the same command again",
    "eval": "{Fix} and run the same command again",
    "demo": "{Fix} and run the same command again: finished stages are reused",
}


def main(argv: list[str] | None = None) -> int:
    """0 done; 2 a fault of the inputs or options (the message names the file and the fix); 3 a fault of the
    environment (full disk, read-only or unwritable output: fix it and rerun). Anything else is a bug and
    keeps its traceback. See ort_trainer/faults.py and docs/FAULTS.md."""
    from ort_trainer.faults import StageFailed, environment_fault, fix_hint

    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except _user_errors() as exc:
        print(f"pocketlora {args.verb}: error: {exc}", file=sys.stderr)
        return 2
    except StageFailed as exc:
        print(f"pocketlora {args.verb}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except ValueError as exc:
        print(f"pocketlora {args.verb}: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        fault = environment_fault(exc)
        if fault is None:
            raise
        fix = fix_hint(exc)
        rerun = RERUN.get(args.verb, RERUN["eval"]).format(fix=fix, Fix=fix.capitalize())
        print(f"pocketlora {args.verb}: error: {fault}. {rerun}.", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
