"""ORT 1.19's dequantization kernels at 1 and 2 threads: what a quantized base pays per weight element, per pass.

One weight of Qwen2.5-0.5B's MLP ([4864, 896], the largest; random codes) is dequantized to float32 in each of the
forms below, inside a graph whose only input is a small activation the dequantization is gated on (as in the bundles:
artifacts_gen.recompute.gate_nodes), so it runs on every call and nothing is constant-folded. Time: the dequantizing
nodes' own kernel time from ORT's profiler (the gate and the ReduceSum that consumes the weight are not counted),
median over REPS calls, in ns per weight element; at intra-op threads 1 and 2 (the bundles train on 2).

    python -m bench.dequant_kernels [--reps 21]
    python -m bench.dequant_kernels --rerender [--run JSON]

The run is written whole as docs/bench/runs/<date>-dequant-kernels.{md,json} (bench/runs.py).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from artifacts_gen.quantize import int4_tensor
from artifacts_gen.recompute import gate_nodes
from bench import runs
from bench.common import log
from bench.dequant_kernels_render import render_report

WHAT = "dequant-kernels"
SHAPE = (4864, 896)           # [out, in]: Qwen2.5-0.5B's gate/up projections
BLOCK = 32
THREADS = (1, 2)
REPS = 21


def _forms(rng: np.random.Generator) -> dict[str, tuple[str, list, list]]:
    """name -> (what it is, initializers, nodes computing "w" from gated inputs)."""
    n, k = SHAPE
    nb = k // BLOCK
    codes = rng.integers(0, 16, (n, k)).astype(np.int8)
    scales = rng.random((n, nb)).astype(np.float32)
    q8 = rng.integers(-127, 128, (k, n)).astype(np.int8)
    s8 = rng.random(n).astype(np.float32)
    f = numpy_helper.from_array
    dq = helper.make_node

    def blocked(*inputs):
        return [dq("DequantizeLinear", ["q", "g/x", *inputs], ["w"], name="dq", axis=1, block_size=BLOCK)]

    return {
        "uint4-blocked-zp8": ("uint4 codes, a scale per block of 32, zero point 8: the bundles' int4 / Q4_K form",
                              [int4_tensor(codes, "q", unsigned=True), f(scales, "s"),
                               int4_tensor(np.full((n, nb), 8, np.int8), "zp", unsigned=True)],
                              gate_nodes("s", "x", "g/", "zero") + blocked("zp")),
        "uint4-blocked": ("the same without the zero point", [int4_tensor(codes, "q", unsigned=True), f(scales, "s")],
                          gate_nodes("s", "x", "g/", "zero") + blocked()),
        "int4-blocked": ("centred codes C - 8 stored signed, no zero point", [int4_tensor(codes - 8, "q"), f(scales, "s")],
                         gate_nodes("s", "x", "g/", "zero") + blocked()),
        "int8-per-column": ("int8 [in, out], a scale per output: the bundles' int8 form", [f(q8, "q"), f(s8, "s")],
                            gate_nodes("s", "x", "g/", "zero") + [dq("DequantizeLinear", ["q", "g/x"], ["w"], name="dq",
                                                                     axis=1)]),
        "int8-cast-mul": ("the same as a Cast to float32 and a Mul by the scales", [f(q8, "q"), f(s8, "s")],
                          gate_nodes("q", "x", "g/", "zero") + [dq("Cast", ["g/x"], ["c"], name="dq_cast",
                                                                   to=TensorProto.FLOAT),
                                                                dq("Mul", ["c", "s"], ["w"], name="dq_mul")]),
        "uint8-per-tensor": ("uint8 codes, one scale and zero point (reference: ORT's vectorized path)",
                             [f(codes.astype(np.uint8), "q"), f(np.float32(0.01), "s"), f(np.uint8(8), "zp")],
                             gate_nodes("q", "x", "g/", "zero") + [dq("DequantizeLinear", ["g/x", "s", "zp"], ["w"],
                                                                      name="dq")]),
    }


def _kernel_ns(model_bytes: bytes, threads: int, reps: int, work: Path) -> float:
    """Median kernel time per call of the nodes named dq*, in ns per weight element."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads = threads, 1
    so.enable_profiling = True
    so.profile_file_prefix = str(work / f"dq-{threads}")
    sess = ort.InferenceSession(model_bytes, so, providers=["CPUExecutionProvider"])
    x = np.ones(3, np.float32)
    for _ in range(reps + 1):
        sess.run(None, {"x": x})
    per_call: dict[int, float] = {}
    calls = -1
    for e in json.loads(Path(sess.end_profiling()).read_text()):
        if e.get("cat") == "Session" and e.get("name") == "model_run":
            calls += 1
        elif e.get("cat") == "Node" and e["name"].startswith("dq") and e["name"].endswith("_kernel_time"):
            per_call[calls + 1] = per_call.get(calls + 1, 0.0) + e["dur"]
    times = [v for c, v in sorted(per_call.items())][1:]          # the first call allocates
    return statistics.median(times) * 1e3 / (SHAPE[0] * SHAPE[1])


def main(argv=None) -> int:
    import onnxruntime as ort

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=REPS)
    args = runs.parse(ap, argv, WHAT, render_report)
    if args is None:
        return 0
    payload = {**runs.start(WHAT, "bench.dequant_kernels", argv), "onnxruntime": ort.__version__,
               "shape": list(SHAPE), "block": BLOCK, "reps": args.reps, "forms": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (what, inits, nodes) in _forms(np.random.default_rng(0)).items():
            inits = inits + [numpy_helper.from_array(np.asarray(0, np.int64), "zero")]
            nodes = nodes + [helper.make_node("ReduceSum", ["w"], ["y"], name="sum", keepdims=0)]
            graph = helper.make_graph(nodes, name, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"])],
                                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])], inits)
            model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
            ns = {t: _kernel_ns(model.SerializeToString(), t, args.reps, Path(tmp)) for t in THREADS}
            payload["forms"][name] = {"what": what, "ns_per_element": {str(t): v for t, v in ns.items()}}
            log(f"{name}: " + ", ".join(f"{t} thread(s) {v:.2f} ns" for t, v in ns.items()))
    runs.finish(payload, WHAT, render_report, args.workdir / "dequant_kernels", no_doc=args.no_doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
