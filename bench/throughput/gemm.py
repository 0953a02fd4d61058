"""The GEMM reference worker's measurement (run in a child by bench/_bench_worker.py, kind "gemm"): float32 GEMM
throughput on the step's own frozen-weight matmul shapes, on numpy, torch and ORT, as the training session runs them.
bench/throughput/flops.py turns its samples into the reference a step's compute efficiency is measured against."""
from __future__ import annotations

import sys
import time

from bench.children import READY, STEP_DONE, done


def _log(*a) -> None:
    print(*a, file=sys.stderr, flush=True)


ORT_PAUSE_S = 0.05       # before each ORT sample: the previous ORT session's threads stop spinning
SHORT_PASS_S = 0.1       # a sample whose pass takes less is preceded by an untimed pass


def run_gemm(spec: dict) -> dict:
    """float32 GEMM throughput on the step's frozen-weight matmul shapes, as the training session runs them.

    Per shape [M, K, N, trans_b] two products, each half of a step's FLOPs on that weight: forward x·W and
    backward dX = dY·Wᵀ (the LM head, a [N, K] vocabulary slice used transposed: x·Wᵀ and dZ·W), each on
    numpy (OpenBLAS) and on ORT (MatMul / Gemm) with prepacking disabled, because ORT's training API refuses
    it (`Module` sets `session.disable_prepacking=1`: "Prepacking is not supported for training scenarios").
    One sample = one pass over copies of the weight filling >= `cold_bytes` (64 MiB, twice the L3), each
    copy used once: weights come from memory, as in a pass over the model. The weights are the ORT graphs'
    inputs (bound once, no copy) with a symbolic M, so one session and one set of copies serve every M.
    ORT's threads spin between nodes as in the training session; each ORT sample waits ORT_PAUSE_S first
    (the previous session's pool still spins), and a pass shorter than SHORT_PASS_S is timed after an
    untimed one, so neither the wake-up nor another pool's spinning is charged to the reference.

    With `lockstep` the parent lets this worker take turns with the training workers: per turn it takes
    samples for `turn_seconds`, round-robin over all products, so the reference and the steps see the
    machine in the same minutes. Without it, `passes` rounds over all products. Result: every sample."""
    import numpy as np
    import onnxruntime as ort
    from onnx import TensorProto, helper

    threads = spec["threads"]
    libs = tuple(spec["libs"])                           # the parent's GEMM_LIBS
    if "torch" in libs:
        import torch
        torch.set_num_threads(threads)
    cold_bytes = spec.get("cold_bytes", 64 << 20)
    rng = np.random.default_rng(0)
    t_start = time.perf_counter()

    def session(k_in, copies, t):
        """`copies` products of one x [M, k_in] with w0..w{c-1} (used transposed if t), all graph inputs."""
        nodes = [helper.make_node("Gemm", ["x", f"w{i}"], [f"y{i}"], transB=1) if t
                 else helper.make_node("MatMul", ["x", f"w{i}"], [f"y{i}"]) for i in range(copies)]
        inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["m", k_in])]
        graph = helper.make_graph(nodes, "mm", inputs, [helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, None)
                                                        for i in range(copies)])
        graph.input.extend(helper.make_tensor_value_info(f"w{i}", TensorProto.FLOAT, None) for i in range(copies))
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
        so.log_severity_level = 3
        so.add_session_config_entry("session.disable_prepacking", "1")
        return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])

    # one set of weight copies per (K, N, trans_b); x and dY per M
    weights, products = {}, []
    for m, k, n, trans_b in spec["shapes"]:
        key = (k, n, bool(trans_b))
        if key not in weights:
            w_shape = (n, k) if trans_b else (k, n)
            nbytes = 4 * k * n
            copies = max(1, min(64, -(-cold_bytes // nbytes)))
            weights[key] = [rng.standard_normal(w_shape, dtype=np.float32) * 0.02 for _ in range(copies)]
        ws = weights[key]
        for direction in ("fwd", "bwd"):
            # forward: x [M, K] times W (or W^T for the head, stored [N, K]); backward: dY [M, N] times W^T (head: W)
            t = (trans_b and direction == "fwd") or (not trans_b and direction == "bwd")
            x = rng.standard_normal((m, k if direction == "fwd" else n), dtype=np.float32)
            for lib in libs:
                products.append({"m": m, "k": k, "n": n, "trans_b": bool(trans_b), "direction": direction, "lib": lib,
                                 "copies": len(ws), "gflop": 2.0 * m * k * n * len(ws) / 1e9, "x": x, "t": t,
                                 "key": key, "samples": []})
    sessions = {}
    for p in products:
        if p["lib"] == "numpy":
            ws, x, t = weights[p["key"]], p["x"], p["t"]
            p["fn"] = (lambda ws=ws, x=x, t=t: [x @ (w.T if t else w) for w in ws])
        elif p["lib"] == "torch":
            tws, tx, t = [torch.from_numpy(w) for w in weights[p["key"]]], torch.from_numpy(p["x"]), p["t"]
            p["fn"] = (lambda ws=tws, x=tx, t=t: [torch.mm(x, w.T if t else w) for w in ws])
        else:
            skey = (p["key"], p["direction"])
            if skey not in sessions:
                ws = weights[p["key"]]
                sess = session(p["x"].shape[1], len(ws), p["t"])
                sessions[skey] = (sess, [ort.OrtValue.ortvalue_from_numpy(w) for w in ws])
            sess, wvals = sessions[skey]
            io = sess.io_binding()
            io.bind_ortvalue_input("x", ort.OrtValue.ortvalue_from_numpy(p["x"]))
            for i, wv in enumerate(wvals):
                io.bind_ortvalue_input(f"w{i}", wv)
            for i in range(len(wvals)):
                io.bind_output(f"y{i}")
            p["fn"] = (lambda sess=sess, io=io: sess.run_with_iobinding(io))
        t0 = time.perf_counter()
        p["fn"]()                                                  # warm-up, not timed
        p["last"] = time.perf_counter() - t0
    # numpy products first, then torch, then ORT: the library changes three times per round, with a pause for
    # the previous one's threads to stop spinning (OpenBLAS and OpenMP busy-wait after a call)
    products.sort(key=lambda p: libs.index(p["lib"]))

    def sample(p):
        if p["lib"] == "ort":
            # Its threads spin between nodes, as the training session's do; but the previous session's pool
            # spins for a while after its run and would take a core from this one (measured at M = 128: 65-75
            # GFLOP/s round-robin without this pause, 120-136 with it or with the same session repeated).
            time.sleep(ORT_PAUSE_S)
        if p["last"] < SHORT_PASS_S:
            p["fn"]()        # untimed: a short pass would carry the threads' wake-up and cold buffers
        t0 = time.perf_counter()
        p["fn"]()
        dt = p["last"] = time.perf_counter() - t0
        p["samples"].append([round(t0 - t_start, 3), p["gflop"] / dt])

    cursor, last_lib = 0, None

    def take(deadline):
        nonlocal cursor, last_lib
        while True:
            p = products[cursor % len(products)]
            if p["lib"] != last_lib:
                time.sleep(0.2)
                last_lib = p["lib"]
            sample(p)
            cursor += 1
            if time.perf_counter() >= deadline:
                return

    if spec.get("lockstep"):
        _log(f"gemm: {len(products)} products, {len(sessions)} ORT sessions, ready")
        done(spec, READY)
        while sys.stdin.readline():
            take(time.perf_counter() + spec["turn_seconds"])
            time.sleep(0.2)                 # the next worker starts on quiet cores
            last_lib = None
            print(STEP_DONE, flush=True)
        for p in products:                  # a lockstep too short to reach every product (--quick)
            if not p["samples"]:
                sample(p)
    else:
        for _ in range(spec.get("passes", 1) * len(products)):
            take(0.0)
    out = []
    for p in products:
        rates = [r for _, r in p["samples"]]
        if rates:
            _log(f"gemm {p['m']}x{p['k']}x{p['n']} {p['direction']} {p['lib']}: {len(rates)} samples, median "
                 f"{float(np.median(rates)):.1f} GFLOP/s")
        out.append({k: p[k] for k in ("m", "k", "n", "trans_b", "direction", "lib", "copies", "gflop", "samples")})
    return {"threads": threads, "numpy_version": np.__version__, "ort_version": ort.__version__,
            "torch_version": torch.__version__ if "torch" in libs else None, "libs": list(libs), "products": out,
            "cold_bytes": cold_bytes, "ort_spinning": True, "ort_pause_s": ORT_PAUSE_S, "short_pass_s": SHORT_PASS_S,
            "seconds": round(time.perf_counter() - t_start, 1)}
