"""int4 codes chosen with calibration text: GPTQ (Frantar et al., 2022), for `gen --quant int4 --quant-calib FILE`.

A layer computes x @ W; rounding W alone minimizes |W - Wq|, while what matters is the layer's output on real
inputs, |X (W - Wq)|^2 = tr((W - Wq)^T H (W - Wq)) with H = X^T X. GPTQ rounds W one input row at a time and
moves each row's rounding error onto the rows not yet rounded, through the inverse of H (its upper Cholesky
factor). Here the rows go in blocks of `block` (int4's scale blocks): a block's scale and offset are fitted to
the block as the earlier errors left it, weighting each input by H's diagonal (quantize.fit_int4_blocks), then
its rows are rounded on that grid. H comes from the source model run in PyTorch on the calibration text
(input_hessians), before LoRA is added; the workstation has torch, the device never runs this.

Measured on the real Gemma3-270M, calibration on 16,384 tokens of WikiText-2 train, perplexity on WikiText-2 test:
bench/quant_quality (docs/bench/runs/2026-12-06T1940Z, 32,768 tokens): float32 93.48, int4 110.40 (+18.1%),
int4 calibrated 95.26 (+1.9%). A side experiment in PyTorch on the first 16,384 tokens: float32 82.66, int4 96.52,
the blocks fitted on H's diagonal alone (no error carried over) 87.96 (+6.4%), GPTQ 84.11 (+1.8%).

Without a text (`--quant int4`'s default, `--quant-calib self`) the calibration windows are sampled from the source
model itself (sampled_ids: from its BOS, temperature 1 over the whole vocabulary, seeded), as LLM-QAT's data-free
quantization does: what matters is which input channels carry large activations, and the model's own text shows
that. Side experiment in PyTorch (2026-12-07, real Gemma3-270M, the first 4,064 tokens of WikiText-2 test, windows
of 128 with a BOS): float32 113.92; plain rounding 129.35 (+13.5%); on 16,384 sampled tokens GPTQ 116.65 (+2.4%),
H's diagonal alone 117.50 (+3.1%); on 4,096 sampled tokens GPTQ 119.63 (+5.0%). Weighting the blocks by the RMSNorm
weights before each layer instead (no data at all) made it worse: 163.05. Sampling costs ~2.1 s a window of 128 on
2 cores for Gemma3's 262k-entry vocabulary (its LM head dominates), hence SAMPLED_TOKENS.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .quantize import CALIB_TOKENS, SAMPLED_TOKENS, SELF_CALIB, QuantError, fit_int4_blocks, quantize_array

SAMPLE_SEED = 0              # sampled_ids' generator: the same source gives the same windows and codes
SAMPLE_BATCH = 32            # windows sampled at once
DAMP = 0.01                  # H += DAMP * mean(diag H) * I: keeps the Cholesky factorization well-posed
REFINE = 8                   # least-squares rounds per block fit


@dataclass
class Calibration:
    """E[x x^T] of each linear layer's inputs by the source parameter's key, and the codes computed from them
    (memoized: the training graphs and the decoder quantize the same weights and must get the same bytes)."""
    hessians: dict[str, np.ndarray]
    description: str
    done: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = field(default_factory=dict)

    def covers(self, key: str) -> bool:
        return key in self.hessians or key in self.done

    def quantize(self, key: str, w: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if key not in self.done:
            self.done[key] = quantize_array(w, "int4", block, hessian=self.hessians.pop(key))
        return self.done[key]


def calibration_ids(tokenizer, text_path: str | Path, seq_len: int, max_tokens: int) -> np.ndarray:
    """[windows, seq_len] token ids: the text's first tokens, cut into windows, each led by the BOS when the
    tokenizer has one (as the models are trained and as `eval ppl --bos-per-window` scores them)."""
    path = Path(text_path)
    if not path.is_file():
        raise QuantError(f"--quant-calib {path}: no such file. Give a plain text file (e.g. text like the "
                               "data the model will see).")
    try:
        text = path.read_text(encoding="utf-8")[: max_tokens * 16]
    except UnicodeDecodeError:
        raise QuantError(f"--quant-calib {path}: not UTF-8 text. Give a plain text file.") from None
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][:max_tokens]
    bos = getattr(tokenizer, "bos_token_id", None)
    width = seq_len - (bos is not None)
    n = len(ids) // width
    if n < 1:
        raise QuantError(f"--quant-calib {path}: {len(ids)} tokens, fewer than one window of {width}. Give a "
                               f"longer text (about {CALIB_TOKENS:,} tokens is the default amount read).")
    x = np.asarray(ids[: n * width], dtype=np.int64).reshape(n, width)
    if bos is not None:
        x = np.concatenate([np.full((n, 1), bos, np.int64), x], axis=1)
    return x


def input_hessians(model, ids: np.ndarray, batch: int = 8) -> dict[str, np.ndarray]:
    """{parameter key: E[x x^T] [in, in] float32} for every linear layer (nn.Linear, GPT-2's Conv1D) of the model's
    backbone (the LM head is quantized per row, without calibration), over the calibration windows `ids`."""
    import torch
    from transformers.pytorch_utils import Conv1D

    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}

    def hook(key):
        def record(_module, inputs, _output):
            x = inputs[0].detach().reshape(-1, inputs[0].shape[-1]).float()
            sums[key] = sums[key].addmm_(x.T, x) if key in sums else x.T @ x
            counts[key] = counts.get(key, 0) + x.shape[0]
        return record

    backbone = model.base_model
    inside = {id(m) for m in backbone.modules()}
    handles = [m.register_forward_hook(hook(name + ".weight")) for name, m in model.named_modules()
               if isinstance(m, (torch.nn.Linear, Conv1D)) and id(m) in inside]
    try:
        with torch.no_grad():
            for i in range(0, len(ids), batch):
                backbone(input_ids=torch.from_numpy(ids[i:i + batch]))
    finally:
        for h in handles:
            h.remove()
    return {k: (v / counts[k]).numpy() for k, v in sums.items()}


def sampled_ids(model, tokenizer, seq_len: int, max_tokens: int, seed: int = SAMPLE_SEED) -> np.ndarray:
    """[windows, seq_len] token ids sampled from the model itself: each window its BOS (or, without one, its EOS, the
    document separator) and seq_len - 1 tokens drawn at temperature 1 from the whole vocabulary, no early stop;
    max_tokens // seq_len windows (at least 1). The global torch generator is left as it was."""
    import torch

    start = next((t for t in (getattr(tokenizer, "bos_token_id", None), getattr(tokenizer, "eos_token_id", None))
                  if t is not None), 0)
    n, out = max(1, max_tokens // seq_len), []
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        for i in range(0, n, SAMPLE_BATCH):
            b = min(SAMPLE_BATCH, n - i)
            ids = model.generate(input_ids=torch.full((b, 1), start), attention_mask=torch.ones(b, 1, dtype=torch.long),
                                 do_sample=True, temperature=1.0, top_k=0, top_p=1.0, repetition_penalty=1.0,
                                 no_repeat_ngram_size=0, max_new_tokens=seq_len - 1,
                                 min_new_tokens=seq_len - 1, pad_token_id=int(start == 0))   # never padded: any other id
            out.append(ids.numpy().astype(np.int64))
    return np.concatenate(out)


def calibrate(model, tokenizer, source: str | Path, seq_len: int, max_tokens: int | None = None) -> Calibration:
    """GPTQ's Hessians from a calibration text (`source` a path; up to CALIB_TOKENS tokens by default), or from
    windows the model samples itself (`source` SELF_CALIB; SAMPLED_TOKENS by default)."""
    if seq_len < 2:
        raise QuantError(f"--seq-len {seq_len}: int4's calibration needs windows of 2 or more tokens; use a longer "
                         "--seq-len, or --quant-calib none.")
    if str(source) == SELF_CALIB:
        ids = sampled_ids(model, tokenizer, seq_len, SAMPLED_TOKENS if max_tokens is None else max_tokens)
        what, seed = "tokens sampled from the model itself", f"seed {SAMPLE_SEED}; "
    else:
        ids = calibration_ids(tokenizer, source, seq_len, CALIB_TOKENS if max_tokens is None else max_tokens)
        what, seed = f"tokens of {Path(source).name}", ""
    return Calibration(input_hessians(model, ids),
                       f"GPTQ on {ids.size:,} {what} ({seed}{len(ids)} windows of {ids.shape[1]})")


def gptq_int4(w: np.ndarray, hessian: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """W [K, N] (x @ W), H [K, K] -> quantize_array's int4 result: codes [K, N] uint8, scales and offsets
    [K / block, N] float16. K must be a multiple of `block`."""
    import torch

    k, n = w.shape
    if k % block:
        raise ValueError(f"gptq_int4: {k} rows are not a multiple of block {block}")
    wt = torch.from_numpy(np.ascontiguousarray(w.T, dtype=np.float64))       # [N, K]: one row per output
    h = torch.from_numpy(np.asarray(hessian, dtype=np.float64)).clone()
    dead = torch.diag(h) == 0                                                  # inputs that were always 0
    h[dead, dead] = 1
    wt[:, dead] = 0
    h += DAMP * torch.mean(torch.diag(h)) * torch.eye(k, dtype=h.dtype)
    importance = torch.diag(h).numpy().astype(np.float32)
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    codes = np.zeros((n, k), np.uint8)
    scales = np.zeros((k // block, n), np.float32)
    offsets = np.zeros((k // block, n), np.float32)
    for b, g in enumerate(range(0, k, block)):
        wg = wt[:, g:g + block]                                                 # a view: updated in place
        _, s, lo = fit_int4_blocks(wg.T.numpy().astype(np.float32)[None], importance[g:g + block].reshape(1, -1, 1),
                                   refine=REFINE)
        scales[b], offsets[b] = s[0, 0], lo[0, 0]
        s, lo = torch.from_numpy(s[0, 0]).double(), torch.from_numpy(lo[0, 0]).double()
        hg = hinv[g:g + block, g:g + block]
        err = torch.zeros_like(wg)
        for j in range(block):
            col = wg[:, j]
            q = torch.clamp(torch.round((col - lo) / s), 0, 15)
            codes[:, g + j] = q.numpy().astype(np.uint8)
            e = (col - (q * s + lo)) / hg[j, j]
            wg[:, j + 1:] -= e[:, None] * hg[j, j + 1:][None, :]
            err[:, j] = e
        wt[:, g + block:] -= err @ hinv[g:g + block, g + block:]
    return np.ascontiguousarray(codes.T), scales.astype(np.float16), offsets.astype(np.float16)
