"""The training settings are declared once (ort_trainer.settings) and every consumer takes them from there."""
from __future__ import annotations

from dataclasses import asdict, fields

import pytest

from ort_trainer.settings import NAMES, TrainSettings, from_args, to_argv
from pocketlora_cli import build_parser

NON_DEFAULT = TrainSettings(micro_batch=3, accum=5, lr=1.25e-3, warmup=7, schedule="linear", clip=None,
                            weight_decay=0.05, seed=11, group_by_length=True)


@pytest.mark.parametrize("verb", [["train", "--bundle", "b", "--data", "d", "--out", "o"],
                                  ["eval", "parity", "--bundle", "b", "--data", "d", "--out", "o"]])
def test_cli_defaults_and_round_trip(verb):
    parser = build_parser()
    assert TrainSettings(**from_args(parser.parse_args(verb))) == TrainSettings()
    assert TrainSettings(**from_args(parser.parse_args(verb + to_argv(NON_DEFAULT)))) == NON_DEFAULT
    # every field differs from its default in NON_DEFAULT, so the round trip covers each flag
    assert all(getattr(NON_DEFAULT, n) != getattr(TrainSettings(), n) for n in NAMES)


def test_consumers_extend_the_one_declaration():
    from android_runner.loop import RunConfig
    from eval.demo import Recipe
    from eval.parity import ParityConfig
    from eval.reference import TrainConfig

    base = {f.name for f in fields(TrainSettings)}
    for cls in (RunConfig, ParityConfig, TrainConfig, Recipe):
        assert issubclass(cls, TrainSettings)
        assert base <= {f.name for f in fields(cls)}
    run = RunConfig(bundle="b", data="d", max_steps=1, **asdict(NON_DEFAULT))
    assert run.train_settings() == NON_DEFAULT
    assert set(RunConfig.FIXED) >= base        # a resumed run refuses a change of any training setting


def test_invalid_settings_name_the_flag():
    with pytest.raises(ValueError, match="--accum must be >= 1"):
        TrainSettings(accum=0).validate()
    with pytest.raises(ValueError, match="--schedule step"):
        TrainSettings(schedule="step").validate()
