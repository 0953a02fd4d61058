"""Which tensors are alive at the peak of one training step, from ORT's own execution order.

    python -m bench.memory_timeline BUNDLE [--micro 8] [--workload lm|sft] [--top 20]

One forward/backward of the bundle's training graph with ORT's profiler on, in the session options the
device uses (ort_trainer.session.RuntimeOptions: no buffer reuse, denormals flushed). The profile gives the
order in which ORT ran the nodes and the shape of every output; the optimized graph ORT wrote gives who reads
what. Replaying that order, a tensor is born when its node runs and dies after its last reader runs (outputs
of Reshape, Squeeze, Unsqueeze, Flatten and Identity share their input's buffer, as ORT's CPU kernels do).
The replay's peak is a lower bound of what the arena must hold: it leaves out kernels' scratch space and
the arena's fragmentation. Frozen weights are not counted (they are file-backed).
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx

from bench.throughput.profile import kernel_events, profile_events
from ort_trainer import manifest as mf
from ort_trainer.ort_training import CheckpointState, Module
from ort_trainer.session import RuntimeOptions

ALIASES = {"Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity"}
BYTES = {"float": 4, "int64": 8, "int32": 4, "bool": 1, "float16": 2, "double": 8, "int8": 1, "uint8": 1, "int16": 2,
         "uint16": 2, "uint32": 4, "uint64": 8}


def profile_step(bundle: Path, micro: int, workload: str, work: Path, seq: int = 128) -> tuple[list, onnx.GraphProto]:
    """Run one step; -> ((node name, kernel event) in execution order, the graph ORT optimized)."""
    # Every node needs a name: the profile names events by node name, and some rewrites leave names empty.
    model = onnx.load(str(bundle / mf.TRAINING_MODEL), load_external_data=False)
    for k, n in enumerate(model.graph.node):
        n.name = n.name or f"unnamed_{k}_{n.op_type}"
    named = bundle / f"_timeline_{os.getpid()}.onnx"     # beside its external data
    onnx.save(model, str(named))
    so = RuntimeOptions(threads=2).session_options(training=True)
    so.enable_profiling = True
    so.profile_file_prefix = str(work / "profile")
    so.optimized_model_filepath = str(work / "optimized.onnx")
    try:
        module = Module(str(named), CheckpointState.load_checkpoint(str(bundle / mf.CHECKPOINT)), None, "cpu", so)
    finally:
        named.unlink()
    module.train()
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 5000, (micro, seq)).astype(np.int64)
    mask, labels = np.ones((micro, seq), np.int64), ids.copy()
    if workload == "sft":           # a prompt of 60 tokens, an answer of 40, then padding
        mask[:, 100:] = 0
        labels[:, :60] = labels[:, 100:] = -100
    module(ids, mask, labels, np.asarray(1.0 / micro, np.float32))
    del module                      # writes the profile
    events = kernel_events(profile_events(next(work.glob("profile*.json")).read_text()))
    return events, onnx.load(str(work / "optimized.onnx"), load_external_data=False).graph


def replay(events: list, graph: onnx.GraphProto) -> dict:
    nodes = {n.name: n for n in graph.node}
    order = [name for name, _ in events]
    size = {}
    for name, e in events:
        node = nodes.get(name)
        for out, shape in zip(node.output if node else [], e["args"].get("output_type_shape", [])):
            (dtype, dims), = shape.items()
            size[out] = int(np.prod(dims, dtype=np.int64)) * BYTES.get(dtype, 4)
    producer = {o: n for n in graph.node for o in n.output}

    def buffer(t):
        while t in producer and producer[t].op_type in ALIASES and producer[t].input:
            t = producer[t].input[0]
        return t
    at = {name: k for k, name in enumerate(order)}
    last = collections.defaultdict(int)
    for n in graph.node:
        for x in n.input:
            if x and n.name in at:
                last[buffer(x)] = max(last[buffer(x)], at[n.name])
    for o in graph.output:
        last[buffer(o.name)] = len(order)
    dies = collections.defaultdict(list)
    for t, k in last.items():
        dies[k].append(t)
    live, now, peak = {}, 0, (0, 0, {})
    for k, name in enumerate(order):
        for out in nodes[name].output if name in nodes else []:
            if out and buffer(out) == out and out in size and out not in live:
                live[out] = size[out]
                now += size[out]
        if now > peak[0]:
            peak = (now, k, dict(live))
        for t in dies[k]:
            now -= live.pop(t, 0)
    groups = collections.defaultdict(lambda: [0, 0, ""])
    for t, nbytes in peak[2].items():
        g = groups[re.sub(r"(layers|h)\.\d+", r"\1.N", t)]
        g[0] += 1
        g[1] += nbytes
        g[2] = producer[t].op_type if t in producer else ""
    return {"peak_bytes": peak[0], "at_node": order[peak[1]], "nodes": len(order),
            "groups": sorted(([k, *v] for k, v in groups.items()), key=lambda g: -g[2])}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--workload", choices=("lm", "sft"), default="lm")
    ap.add_argument("--top", type=int, default=20)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as work:
        events, graph = profile_step(args.bundle, args.micro, args.workload, Path(work))
    r = replay(events, graph)
    print(f"{args.bundle.name}, micro-batch {args.micro}, {args.workload}: {r['nodes']} nodes run; tensors alive at the "
          f"peak {r['peak_bytes'] / 2**20:,.0f} MiB, at {r['at_node']}")
    print("    MiB  tensors  op  tensor name (layers.N: summed over layers)")
    for name, count, nbytes, op in r["groups"][: args.top]:
        print(f"{nbytes / 2**20:7.1f}  x{count:<4d}  {op}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
