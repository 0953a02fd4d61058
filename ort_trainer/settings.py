"""The settings that define a training run, declared once.

`TrainSettings` is what makes two runs the same training: the device loop's run config, the parity
job's config and the PyTorch reference's config extend it, and the command line takes its flags and
defaults from it (`add_arguments`, `from_args`; `to_argv` turns settings back into those flags).
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field, fields

from .schedule import SCHEDULES


class SettingsError(ValueError):
    pass


def _help(text: str) -> dict:
    return {"help": text}


@dataclass(kw_only=True)
class TrainSettings:
    micro_batch: int = field(default=1, metadata=_help("sequences per forward/backward pass"))
    accum: int = field(default=8, metadata=_help("micro-batches per optimizer step (effective batch = "
                                                 "micro-batch x accum)"))
    lr: float = field(default=2e-4, metadata=_help("peak learning rate"))
    warmup: int = field(default=10, metadata=_help("optimizer steps of linear warmup"))
    schedule: str = field(default="cosine", metadata=_help("learning-rate curve after warmup"))
    clip: float | None = field(default=1.0, metadata=_help("max global grad norm; 0 disables"))
    weight_decay: float = field(default=0.0, metadata=_help("AdamW's decoupled weight decay"))
    seed: int = field(default=0, metadata=_help("data order"))
    group_by_length: bool = field(default=False, metadata=_help(
        "micro-batches of examples of similar length (less padding; for mixed short/long data)"))

    def validate(self) -> None:
        for name in ("micro_batch", "accum"):
            if getattr(self, name) < 1:
                raise SettingsError(f"--{name.replace('_', '-')} must be >= 1")
        if self.schedule not in SCHEDULES:
            raise SettingsError(f"--schedule {self.schedule}: use one of {', '.join(SCHEDULES)}")
        if self.lr <= 0:
            raise SettingsError("--lr must be > 0")

    def train_settings(self) -> TrainSettings:
        """Only the training settings of this (possibly extended) config."""
        return TrainSettings(**{name: getattr(self, name) for name in NAMES})


NAMES = tuple(f.name for f in fields(TrainSettings))


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per setting, with the dataclass's defaults and help."""
    for f in fields(TrainSettings):
        kw: dict = {"help": f.metadata["help"]}
        if f.type == "bool":
            kw["action"] = "store_true"
        else:
            kw["default"] = f.default
            kw["type"] = {"int": int, "str": str}.get(f.type, float)
            if f.name == "schedule":
                kw["choices"] = list(SCHEDULES)
            kw["help"] += " (default %(default)s)"
        parser.add_argument(_flag(f.name), **kw)


def from_args(args: argparse.Namespace) -> dict:
    """The settings parsed by `add_arguments`, as keyword arguments (--clip 0 -> None)."""
    out = {name: getattr(args, name) for name in NAMES}
    out["clip"] = out["clip"] if out["clip"] and out["clip"] > 0 else None
    return out


def to_argv(settings: TrainSettings) -> list[str]:
    """The command-line flags that give these settings (the inverse of `from_args`)."""
    argv = []
    for name in NAMES:
        value = getattr(settings, name)
        if isinstance(value, bool):
            argv += [_flag(name)] if value else []
        else:
            argv += [_flag(name), str(0 if value is None else value)]
    return argv
