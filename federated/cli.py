"""The `pocketlora federate` flags. Light on purpose: the CLI builds its parser from this on every call, so
nothing here imports Flower, Ray or onnxruntime."""
from __future__ import annotations

import argparse

from ort_trainer.settings import add_arguments as add_train_arguments, from_args as train_from_args

# Local runs of a few steps per round: no warmup, a constant rate (federated.config.FederateConfig).
TRAIN_DEFAULTS = {"micro_batch": 4, "accum": 1, "lr": 1e-3, "warmup": 0, "schedule": "constant"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--bundle", required=True)
    p.add_argument("--devices", type=int, required=True, help="virtual devices (one fictional person each)")
    p.add_argument("--rounds", type=int, required=True)
    p.add_argument("--out", required=True, help="run directory (rerunning the same command resumes)")
    p.add_argument("--strategy", default="fedavg", choices=["fedavg", "ffa"],
                   help="fedavg: average A and B; ffa: FFA-LoRA, A frozen at its init, only B trained and averaged")
    p.add_argument("--local-steps", type=int, default=4, help="optimizer steps per device per round (default 4)")
    p.add_argument("--weight", default="tokens", choices=["tokens", "examples"],
                   help="what a device's update counts for: the label tokens it trained on this round (default) or "
                        "the examples it holds")
    p.add_argument("--personalize-steps", type=int, default=None,
                   help="local fine-tuning of the global adapter after the rounds (default: --local-steps; 0: none)")
    p.add_argument("--private-facts", type=int, default=0,
                   help="how many of its person's facts each device holds, spread over their kinds (default 0: all)")
    p.add_argument("--qa-repeats", type=int, default=1, help="each training question this many times per device")
    p.add_argument("--battery", default="none", help="every device's probe: none|replay:TRACE.csv|auto|...")
    p.add_argument("--device-battery", action="append", default=[], metavar="N=SPEC",
                   help="device N's own probe, e.g. 3=replay:low.csv (repeatable)")
    p.add_argument("--round-s", type=float, default=3600.0,
                   help="trace seconds between rounds: a replayed device is at (round-1) x this (default 3600)")
    p.add_argument("--trace-speed", type=float, default=60.0, help="replay speed inside a round (default 60)")
    p.add_argument("--save-every", type=int, default=50)
    p.add_argument("--dp-noise", type=float, default=0.0,
                   help="central differential privacy (Flower's DP wrapper, server-side fixed clipping): the noise "
                        "multiplier; 0 (default): off. Epsilon is reported per round")
    p.add_argument("--dp-clip", type=float, default=0.0, help="with --dp-noise: each update's L2 clipping norm")
    p.add_argument("--dp-delta", type=float, default=1e-5, help="with --dp-noise: the delta of the reported epsilon")
    p.add_argument("--secagg", action="store_true",
                   help="secure aggregation (Flower's SecAgg+): the server learns only each round's weighted sum, "
                        "never one device's tensors or loss (each device's weight and gate decision stay visible)")
    p.add_argument("--secagg-shares", type=int, default=0,
                   help="with --secagg: devices each one's secrets are shared among (odd, >= 3; default 0: all)")
    p.add_argument("--secagg-threshold", type=int, default=0,
                   help="with --secagg: shares needed to reconstruct a secret (default 0: a majority of the shares; "
                        "a round survives shares - threshold devices dropping out)")
    p.add_argument("--secagg-clip", type=float, default=1.0,
                   help="with --secagg: every value sent must lie in [-clip, clip] (a power of 2, default 1); the "
                        "quantization step is 2 x clip / 2^22")
    p.add_argument("--threads", type=int, default=1, help="ORT threads per device (default 1)")
    p.add_argument("--device-cpus", type=float, default=1.0,
                   help="CPUs one virtual device takes; the engine runs cores / this devices at once (default 1)")
    p.add_argument("--keep-updates", action="store_true",
                   help="also keep every device's update and each round's global adapter in DIR/updates/ (with "
                        "--secagg the global only: the server never has a device's update)")
    add_train_arguments(p)
    p.set_defaults(**TRAIN_DEFAULTS)


def config_from_args(args: argparse.Namespace):
    from .config import FederateConfig, FederateError

    batteries = {}
    for item in args.device_battery:
        key, eq, spec = item.partition("=")
        if not eq or not key.strip().isdigit():
            raise FederateError(f"--device-battery {item!r}: use N=SPEC, e.g. 3=replay:trace.csv")
        batteries[str(int(key))] = spec
    return FederateConfig(
        **train_from_args(args), bundle=args.bundle, devices=args.devices, rounds=args.rounds,
        local_steps=args.local_steps, strategy=args.strategy, weight=args.weight,
        personalize_steps=args.personalize_steps, qa_repeats=args.qa_repeats,
        private_facts=args.private_facts, battery=args.battery,
        batteries=batteries, round_s=args.round_s, trace_speed=args.trace_speed, save_every=args.save_every,
        dp_noise=args.dp_noise, dp_clip=args.dp_clip, dp_delta=args.dp_delta, secagg=args.secagg,
        secagg_shares=args.secagg_shares, secagg_threshold=args.secagg_threshold, secagg_clip=args.secagg_clip,
        threads=args.threads, device_cpus=args.device_cpus, keep_updates=args.keep_updates)
