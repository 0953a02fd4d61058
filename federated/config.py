"""The settings of a federated run, declared once: the training settings of every device's local run
(TrainSettings, with defaults for a few local steps per round) and the federation's own."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from android_runner.gate import GateConfig
from android_runner.loop import RunError
from ort_trainer.settings import NAMES as TRAIN_NAMES, SettingsError, TrainSettings

from .aggregate import STRATEGIES, WEIGHTS

CONFIG = "federate.json"


class FederateError(RunError):
    pass


@dataclass(kw_only=True)
class FederateConfig(TrainSettings):
    bundle: str
    devices: int
    rounds: int
    local_steps: int = 4            # optimizer steps each participating device trains per round
    strategy: str = "fedavg"        # fedavg | ffa (aggregate.py)
    weight: str = "tokens"          # tokens: label tokens the device trained on this round; examples: its data size
    personalize_steps: int | None = None   # local fine-tuning after the rounds (None: local_steps; 0: none)
    qa_repeats: int = 1             # each training question written this many times into a device's train.jsonl
    private_facts: int = 0          # how many of its person's facts a device holds (spread over their kinds); 0: all
    battery: str = "none"           # every device's probe, unless `batteries` names its own
    batteries: dict = field(default_factory=dict)   # {"3": "replay:trace.csv", ...}: per-device probe
    round_s: float = 3600.0         # trace seconds between rounds: a replayed device is at (round - 1) * round_s
    trace_speed: float = 60.0       # how fast a replay runs inside a round (the loop's own gate)
    gate: dict = field(default_factory=lambda: asdict(GateConfig()))
    save_every: int = 50            # the device loop's checkpoint interval (steps) within a round
    dp_noise: float = 0.0           # central DP (privacy.py): noise multiplier; 0 = off
    dp_clip: float = 0.0            # central DP: each device's update clipped to this L2 norm
    dp_delta: float = 1e-5          # central DP: the delta at which epsilon is reported
    secagg: bool = False            # secure aggregation, Flower's SecAgg+ (secure.py): the server sees only sums
    secagg_shares: int = 0          # SecAgg+: each device's secrets are shared among this many (0: all devices)
    secagg_threshold: int = 0       # SecAgg+: shares that reconstruct a secret (0: a majority of the shares)
    secagg_clip: float = 1.0        # SecAgg+: every value sent lies in [-clip, clip]; a power of 2
    # Not part of the federation's definition: may change between resumes.
    threads: int = 1                # ORT threads per device
    device_cpus: float = 1.0        # CPUs one simulated device takes (the engine runs cores / this at once)
    keep_updates: bool = False      # also write every device's update and each round's global (DIR/updates/)
    round_timeout_s: float = 3600.0
    # Local runs of a few steps: no warmup, a constant rate.
    micro_batch: int = 4
    accum: int = 1
    lr: float = 1e-3
    warmup: int = 0
    schedule: str = "constant"

    FIXED = ("bundle", "devices", "rounds", "local_steps", "strategy", "weight", "personalize_steps", "qa_repeats",
             "private_facts",
             "battery", "batteries", "round_s", "trace_speed", "gate", "save_every", "dp_noise", "dp_clip", "dp_delta",
             "secagg", "secagg_shares", "secagg_threshold", "secagg_clip", *TRAIN_NAMES)

    # Defining settings added after runs existed: absent from an older run's federate.json and state hash, which
    # then means these values (so such a run still resumes).
    LATER = {"secagg": False, "secagg_shares": 0, "secagg_threshold": 0, "secagg_clip": 1.0, "private_facts": 0,
             "dp_noise": 0.0, "dp_clip": 0.0, "dp_delta": 1e-5}

    def fixed(self) -> dict:
        """The defining settings, as the server's state hash covers them (LATER ones only when not at their
        defaults)."""
        return {k: getattr(self, k) for k in self.FIXED if k not in self.LATER or getattr(self, k) != self.LATER[k]}

    @property
    def personalize(self) -> int:
        return self.local_steps if self.personalize_steps is None else self.personalize_steps

    def battery_of(self, device: int) -> str:
        return self.batteries.get(str(device), self.battery)

    def validate(self) -> "FederateConfig":
        try:
            super().validate()
        except SettingsError as e:
            raise FederateError(str(e)) from None
        for name in ("devices", "rounds", "local_steps"):
            if getattr(self, name) < 1:
                raise FederateError(f"--{name.replace('_', '-')} must be >= 1")
        if self.strategy not in STRATEGIES:
            raise FederateError(f"--strategy {self.strategy}: use one of {', '.join(STRATEGIES)}")
        if self.weight not in WEIGHTS:
            raise FederateError(f"--weight {self.weight}: use one of {', '.join(WEIGHTS)}")
        if self.strategy == "ffa" and self.weight_decay:
            raise FederateError("--strategy ffa freezes LoRA A; AdamW's weight decay would still shrink it: "
                                "use --weight-decay 0")
        if self.private_facts < 0:
            raise FederateError("--private-facts must be >= 0 (0: all of a person's facts)")
        if self.personalize < 0 or self.qa_repeats < 1 or self.save_every < 1:
            raise FederateError("--personalize-steps must be >= 0, --qa-repeats and --save-every >= 1")
        if not self.round_s > 0 or not self.trace_speed > 0:
            raise FederateError("--round-s and --trace-speed must be > 0")
        for key in self.batteries:
            if not key.isdigit() or not 0 <= int(key) < self.devices:
                raise FederateError(f"battery for device {key!r}: devices are 0..{self.devices - 1}")
        if self.dp_noise < 0 or (self.dp_noise > 0 and not self.dp_clip > 0) or not 0 < self.dp_delta < 1:
            raise FederateError("--dp-noise must be >= 0 (0: no DP); with DP, --dp-clip must be > 0 and "
                                "--dp-delta in (0, 1)")
        self._validate_secagg()
        GateConfig(**self.gate).validate()
        return self

    def _validate_secagg(self) -> None:
        if not self.secagg:
            if (self.secagg_shares, self.secagg_threshold, self.secagg_clip) != (0, 0, 1.0):
                raise FederateError("--secagg-shares, --secagg-threshold and --secagg-clip need --secagg")
            return
        from .secure import is_power_of_two, shares, threshold

        if self.dp_noise > 0:
            raise FederateError("--secagg with --dp-noise: the DP wrapper clips each device's update on the server, "
                                "which SecAgg+ never shows it; use one or the other")
        if self.weight != "tokens":
            raise FederateError("--secagg weighs devices by label tokens (SecAgg+ needs a bound on every weight): "
                                "use --weight tokens")
        if self.devices < 3:
            raise FederateError(f"--secagg needs at least 3 devices (SecAgg+ shares secrets among >= 3), not "
                                f"{self.devices}")
        n, t = shares(self), threshold(self)
        if not 3 <= n <= self.devices or (n < self.devices and n % 2 == 0):
            raise FederateError(f"--secagg-shares {n}: use an odd number from 3 to --devices, or --devices itself")
        if not 2 <= t < n:
            raise FederateError(f"--secagg-threshold {t}: use 2 to --secagg-shares - 1 ({n - 1})")
        if not is_power_of_two(self.secagg_clip):
            raise FederateError(f"--secagg-clip {self.secagg_clip:g}: use a power of 2 (e.g. 0.5, 1, 2, 8)")

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "FederateConfig":
        return cls(**json.loads(text))


def settle(out: Path, cfg: FederateConfig) -> tuple[FederateConfig, bool]:
    """A resumed run's recorded settings win; a different defining setting is refused. (True if resuming.)"""
    path = out / CONFIG
    if not path.exists():
        return cfg, False
    saved = json.loads(path.read_text())
    for name in FederateConfig.FIXED:
        was = saved.get(name, FederateConfig.LATER.get(name))
        if getattr(cfg, name) != was:
            raise FederateError(f"{out} was started with {name}={was!r}, not {getattr(cfg, name)!r}. "
                                "To resume, repeat the original settings; to change them, use a new --out.")
    return cfg, True
