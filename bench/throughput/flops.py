"""FLOPs of one training step, counted as its matmuls execute them, and the GEMM reference: what the step's
frozen-weight matmuls would take at the GEMM rates the reference worker measured (bench/throughput/gemm.py)."""
from __future__ import annotations

import math
import statistics

from bench.common import LORA
from bench.throughput.config import GEMM_LIBS, GEMM_M, HEAD_M


def model_dims(cfg: dict) -> dict:
    """Per-layer linear shapes (K, N, LoRA-adapted), attention width and head for the three families."""
    from artifacts_gen.head_loss import vocab_slice_width     # the bench's bundles use the default slices
    mt = cfg["model_type"]
    if mt == "gpt2":
        h = cfg["n_embd"]
        inner = cfg.get("n_inner") or 4 * h
        lin = [("attn.c_attn", h, 3 * h, True), ("attn.c_proj", h, h, True),
               ("mlp.c_fc", h, inner, False), ("mlp.c_proj", inner, h, False)]
        return dict(hidden=h, layers=cfg["n_layer"], heads=cfg["n_head"], head_dim=h // cfg["n_head"],
                    vocab=cfg["vocab_size"], head_cols=vocab_slice_width(cfg["vocab_size"]), linear=lin)
    h = cfg["hidden_size"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or h // nh
    inner = cfg["intermediate_size"]
    lin = [("q_proj", h, nh * hd, True), ("k_proj", h, nkv * hd, True), ("v_proj", h, nkv * hd, True),
           ("o_proj", nh * hd, h, True), ("gate_proj", h, inner, False), ("up_proj", h, inner, False),
           ("down_proj", inner, h, False)]
    return dict(hidden=h, layers=cfg["num_hidden_layers"], heads=nh, head_dim=hd, vocab=cfg["vocab_size"],
                head_cols=vocab_slice_width(cfg["vocab_size"]), linear=lin)


def _body_rows(b: int, length: int, real: int, rows_at: str) -> int:
    """Rows a micro-batch gives the body's linear layers: its real tokens in a padding-free graph, else B*L."""
    return real if rows_at == "real" else b * length


def step_flops(dims: dict, micro_shapes: list[list[int]], head_at: str, r: int = LORA["r"],
               rows_at: str = "padded") -> dict:
    """FLOPs of one optimizer step (all micro-batches), counted as the matmuls execute them.

    Per micro-batch of B sequences padded to L (P = B*L positions, padding included: it is computed;
    rows_at "real": P = the real tokens, for a padding-free graph, whose per-token layers skip padding):
      forward   body linear 2*P*sum(K*N)*layers; LoRA 2*P*r*(K+N) per adapted linear; attention scores
                QK^T and AV 4*B*L^2*heads*head_dim per layer (full square: both backends compute it);
                LM head 2*Ph*H*V with Ph = labelled positions (ORT gathers them before the head) or
                all P positions (PyTorch computes full logits).
      backward  activation gradients of every frozen linear and of the head ~ the same as their forward;
                attention scores 2x forward (both operands are activations); LoRA: activation grads +
                weight grads, 2x its forward. No weight gradients of frozen weights.
    """
    out = dict(body=0.0, lora=0.0, attn=0.0, head=0.0)
    lin_params = sum(k * n for _, k, n, _ in dims["linear"]) * dims["layers"]
    lora_params = sum(r * (k + n) for _, k, n, lo in dims["linear"] if lo) * dims["layers"]
    for b, length, real, labelled in micro_shapes:
        p = _body_rows(b, length, real, rows_at)
        out["body"] += 2 * (2.0 * p * lin_params)
        out["lora"] += 3 * (2.0 * p * lora_params)
        out["attn"] += 3 * (4.0 * b * length * length * dims["heads"] * dims["head_dim"] * dims["layers"])
        ph = labelled if head_at == "labelled" else p
        out["head"] += 2 * (2.0 * ph * dims["hidden"] * dims["vocab"])
    out["total"] = sum(out.values())
    return out


def gemm_shapes(dims: dict) -> list[list]:
    """[M, K, N, trans_b]: the distinct frozen-weight matmuls of a step at M = GEMM_M rows; the LM head
    as the training graph runs it, one vocabulary slice ([N, K] weight, used transposed) at a time, at HEAD_M."""
    kn = sorted({(k, n) for _, k, n, _ in dims["linear"]})
    shapes = [[m, k, n, False] for m in GEMM_M for k, n in kn]
    shapes += [[m, dims["hidden"], dims["head_cols"], True] for m in HEAD_M]
    return shapes


def gemm_records(products: list[dict]) -> list[dict]:
    """The GEMM worker's samples -> one record per shape [M, K, N, trans_b]: `asrun_{fwd,bwd}_{numpy,ort}` =
    the median GFLOP/s of its samples (and their min/max), `n_samples`, `cold_copies`."""
    recs: dict[tuple, dict] = {}
    for p in products:
        key = (p["m"], p["k"], p["n"], p["trans_b"])
        r = recs.setdefault(key, {"m": p["m"], "k": p["k"], "n": p["n"], "trans_b": p["trans_b"],
                                  "cold_copies": p["copies"], "n_samples": 0})
        rates = [x for _, x in p["samples"]] or [float("nan")]
        field = f"asrun_{p['direction']}_{p['lib']}"
        r[field] = statistics.median(rates)
        r[field + "_range"] = [min(rates), max(rates)]
        r["n_samples"] += len(p["samples"])
    return list(recs.values())


def gemm_libs(gemm: list[dict]) -> list[str]:
    """The libraries a run's GEMM records measured as run (torch.mm since 2026-12-02 19:35 UTC), in GEMM_LIBS order."""
    return [lib for lib in GEMM_LIBS if gemm and f"asrun_fwd_{lib}" in gemm[0]]


def gemm_reference(dims: dict, micro_shapes: list[list[int]], head_at: str, gemm: list[dict],
                   kind: str = "asrun", rows_at: str = "padded", only: tuple[str, ...] = ()) -> dict | None:
    """What the step's frozen-weight matmuls would take at the measured GEMM rates (best of the measured
    libraries, or of those in `only`; median time, the measured M nearest in log scale) -> the FLOP-weighted
    GEMM rate.

    kind "asrun": half of each matmul's FLOPs at the forward rate and half at the backward one (dX = dY W^T),
    as the training session runs them: ORT without prepacking (its training API forbids it), each weight
    read from memory. kind "warm": all of them at the forward rate with the weight prepacked (ORT) and
    repeated on one weight (in cache when it fits): an upper bound the training session cannot reach."""
    if kind == "asrun":
        libs = [lib for lib in gemm_libs(gemm) if not only or lib in only]
        fields = tuple(tuple(f"asrun_{d}_{lib}" for lib in libs) for d in ("fwd", "bwd"))
    else:
        fields = (("numpy_gflops_median", "ort_gflops_median"),) * 2
    if not gemm or not fields[0] or any(f not in g for g in gemm for pair in fields for f in pair):
        return None                # results of a bench version that did not measure this kind
    rates: dict[tuple, dict[int, tuple[float, float]]] = {}
    for g in gemm:
        rates.setdefault((g["k"], g["n"]), {})[g["m"]] = tuple(max(g[f] for f in pair) * 1e9 for pair in fields)

    def seconds(f, k, n, m):
        by_m = rates[(k, n)]
        fwd, bwd = by_m[min(by_m, key=lambda x: abs(math.log(max(m, 1) / x)))]
        return f / 2 / fwd + f / 2 / bwd

    flops = secs = 0.0
    for b, length, real, labelled in micro_shapes:
        p = _body_rows(b, length, real, rows_at)
        for _, k, n, _lo in dims["linear"]:
            f = 2 * 2.0 * p * k * n * dims["layers"]
            flops += f
            secs += seconds(f, k, n, p)
        ph = labelled if head_at == "labelled" else p
        f = 2 * 2.0 * ph * dims["hidden"] * dims["vocab"]
        flops += f
        head = dims["head_cols"] if (dims["hidden"], dims["head_cols"]) in rates else dims["vocab"]   # older JSON
        secs += seconds(f, dims["hidden"], head, ph)
    return {"gemm_flops": flops, "gemm_seconds": secs, "gemm_rate": flops / secs if secs else float("nan")}


def combined_gemm(p: dict, name: str) -> list[dict]:
    """Per shape and backend the better median of the measurements at the start and at the end."""
    out: dict[tuple, dict] = {}
    for g in (p.get("gemm") or {}).get(name, []) + (p.get("gemm_end") or {}).get(name, []):
        key = (g["m"], g["k"], g["n"], g["trans_b"])
        if key not in out:
            out[key] = dict(g)
        else:
            for f in ("numpy_gflops_median", "ort_gflops_median", "numpy_gflops_best", "ort_gflops_best",
                      *(f"asrun_{d}_{lib}" for d in ("fwd", "bwd") for lib in GEMM_LIBS)):
                if f in g:
                    out[key][f] = max(out[key].get(f, 0.0), g[f])
    return list(out.values())
