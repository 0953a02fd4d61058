"""`pocketlora`: one command, one verb per stage of the flow. No logic lives here: each verb parses
its options and calls into the packages (workstation: artifacts_gen, eval; device: ort_trainer,
android_runner). Known, user-fixable errors print one line and exit 2."""
from __future__ import annotations

import argparse
import sys


def _gen(args) -> None:
    from artifacts_gen.build import build_bundle
    from artifacts_gen.export import LoraSettings

    result = build_bundle(
        args.model, args.out, gguf_file=args.gguf_file,
        lora=LoraSettings(r=args.lora_r, alpha=args.lora_alpha, dropout=args.lora_dropout,
                          targets=args.targets, seed=args.seed),
        seq_len=args.seq_len, shard_mb=args.shard_mb, force=args.force,
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
    p.add_argument("--targets", default="attn", help="attn | all-linear | comma list of module names")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--shard-mb", type=int, default=256)
    p.add_argument("--seed", type=int, default=0, help="seed of PEFT's LoRA initialisation")
    p.add_argument("--force", action="store_true", help="replace an existing bundle in --out")
    p.set_defaults(func=_gen)


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
        from ort_trainer.data import DataError

        errors.append(DataError)
    except ImportError:
        pass
    return tuple(errors)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pocketlora", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="verb", required=True)
    _add_gen(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except _user_errors() as exc:
        print(f"pocketlora {args.verb}: error: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"pocketlora {args.verb}: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
