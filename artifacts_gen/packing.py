"""Padding-free tracing: the per-token layers of the traced forward see the real tokens only.

A micro-batch arrives right-padded, [B, L]. Every layer but attention works token by token (embeddings,
norms, the linear layers with their LoRA, the MLP), so computing them at padding positions is pure
waste: 21% of the positions of an Alpaca micro-batch of 8 at L = 128. The traced forward
(export.CausalLMWithLoss) runs the decoder body on the T real tokens as one row [1, T] (positions
0..len-1 of each sequence, as before), and the attention core alone goes back to the padded layout:

    q, k, v [1, heads, T, d] --ScatterND(pack)--> [B, heads, L, d] --the family's own eager attention,
    causal + key-padding (+ sliding-window) mask [B, 1, L, L]--> [B, L, heads, d] --Gather(pack)--> [1, T, heads, d]

With grouped-query attention (Qwen2.5-0.5B: 14 query heads on 2 key/value heads; Gemma3-270M: 4 on 1), the
query heads that share a key/value head are stacked along the rows, [B, kv_heads, rep * L, d], instead of
copying each key and value rep times (HF's repeat_kv): ORT kept those copies for the backward pass. Micro-batch 8,
WikiText LM: peak RSS Qwen2.5 3,983 -> 3,828 MiB, Gemma3 2,404 -> 2,216 MiB; the same losses and step times.

`pack` [T] holds the flat padded index of each real token (row-major, so the labelled positions keep
their order; NonZero's output, so no index repeats). q, k, v are scattered to the padded layout with
zeros at padding positions: those keys are masked (exp(min - max) is exactly 0, and so is their
gradient), and those query rows are gathered away. ORT differentiates the scatter into a gather
(GatherND), and the gather into its GatherGrad, which the build replaces (slow_kernels.replace_gather_grad).
The graph's inputs stay the padded (input_ids, attention_mask, labels), so nothing changes on the device.
Positions are taken from the attention mask's shape, never from the traced length.

Measured (A/B, one process per bundle, alternating, micro-batch 8, 2 threads): Alpaca SFT steps 10-20%
faster for GPT-2 124M, Gemma3-270M and Qwen2.5-0.5B; WikiText LM (no padding) the same for GPT-2 and Qwen2.5
(within 1%), 14% faster for Gemma3 (one round of 2 steps each; the cause is not isolated).
"""
from __future__ import annotations

import contextlib
import sys

import torch


class Packing:
    """The index tensors of one traced micro-batch, computed from its [B, L] attention mask."""

    def __init__(self, attention_mask: torch.Tensor, windows: set, dtype=torch.float32):
        self.batch, self.length = attention_mask.shape[0], attention_mask.shape[1]
        real = attention_mask.reshape(-1).to(torch.int64)
        self.pack = torch.nonzero(real).squeeze(1)                          # [T]
        pos = torch.cumsum(torch.ones_like(attention_mask[0], dtype=torch.int64), 0) - 1    # [L]
        self.positions = self.tokens(pos.reshape(1, -1).expand(self.batch, -1))            # [1, T]
        # Additive [B, 1, L, L] masks, one per sliding window (None = none), as HF's eager mask: 0 where a
        # query may see a key (causal, key not padding, within the window), finfo.min elsewhere.
        q, k = pos.unsqueeze(1), pos.unsqueeze(0)
        causal = torch.logical_and((k <= q).unsqueeze(0).unsqueeze(0), (attention_mask != 0).unsqueeze(1).unsqueeze(1))
        zero, low = torch.zeros((), dtype=dtype), torch.full((), torch.finfo(dtype).min, dtype=dtype)
        self.masks = {}
        self._grouped = {}
        for w in windows:
            allowed = causal if not w else torch.logical_and(causal, (q - k < w).unsqueeze(0).unsqueeze(0))
            self.masks[w] = torch.where(allowed, zero, low)

    def mask(self, window: int | None, rep: int = 1) -> torch.Tensor:
        """The window's [B, 1, L, L] mask; for rep > 1 query heads per key/value head, [B, 1, rep * L, L], for the
        query rows r * L + i of _packed_attention (built once per micro-batch, window and rep)."""
        if rep == 1:
            return self.masks[window]
        if (window, rep) not in self._grouped:
            self._grouped[window, rep] = self.masks[window].repeat(1, 1, rep, 1)
        return self._grouped[window, rep]

    def tokens(self, x: torch.Tensor) -> torch.Tensor:
        """[B, L, ...] -> [1, T, ...]: the real tokens, in row-major order."""
        return x.reshape(self.batch * self.length, *x.shape[2:]).index_select(0, self.pack).unsqueeze(0)

    def to_padded(self, x: torch.Tensor) -> torch.Tensor:
        """[1, heads, T, d] -> [B, heads, L, d], zeros at padding positions. A scatter (ScatterND), so that
        its gradient is a gather (GatherND), not ORT's GatherGrad (see slow_kernels.replace_gather_grad)."""
        # [T, heads, d]. Transposing back first makes two inverse Transposes in a row (the family's own
        # [1, T, heads, d] -> [1, heads, T, d] and this one), which ORT cancels; a Reshape between them did
        # not cancel. (squeeze(0) would trace to an If.)
        rows = x.transpose(1, 2).flatten(0, 1)
        zeros = rows.new_zeros((self.batch * self.length, rows.shape[1], rows.shape[2]))
        flat = zeros.index_put((self.pack,), rows)                           # [B*L, heads, d]
        return flat.reshape(self.batch, self.length, rows.shape[1], rows.shape[2]).transpose(1, 2)


def attention_window(module) -> int | None:
    """The sliding window of an attention module (Gemma3's local layers), None for full attention."""
    return getattr(module, "sliding_window", None) or None


def attention_windows(model) -> set:
    return {attention_window(m) for m in model.modules() if type(m).__name__.endswith("Attention")}


def _packed_attention(eager, state: dict):
    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        pk: Packing = state["packing"]
        window, rep = attention_window(module), getattr(module, "num_key_value_groups", 1)
        q, k, v = pk.to_padded(query), pk.to_padded(key), pk.to_padded(value)
        if rep == 1:
            out, weights = eager(module, q, k, v, pk.mask(window), *args, **kwargs)
            return pk.tokens(out), weights      # [B, L, heads, d] -> [1, T, heads, d]
        # Grouped-query attention without repeat_kv: the rep query heads that share a key/value head are
        # stacked along the rows, [B, kv_heads, rep * L, d], so each shared head is read by one larger matmul
        # and never copied rep times (ORT kept both copies, [B, heads, L, d] each, for the backward pass).
        # The eager function sees an attention with one query head per key/value head.
        b, kvh, length, d = k.shape
        qg = q.reshape(b, kvh, rep * length, d)                   # head kvh * rep + r -> group kvh, rows r * L + i
        module.num_key_value_groups = 1
        try:
            out, weights = eager(module, qg, k, v, pk.mask(window, rep), *args, **kwargs)
        finally:
            module.num_key_value_groups = rep
        # eager ends in transpose(1, 2); undoing it first makes two inverse Transposes in a row, which ORT
        # cancels, and one Transpose puts the rows back to [B, L, heads, d]
        out = out.transpose(1, 2).reshape(b, kvh, rep, length, d).permute(0, 3, 1, 2, 4).reshape(b, length, kvh * rep, d)
        return pk.tokens(out), weights
    return attention


@contextlib.contextmanager
def packed_attention(model, state: dict):
    """Route the eager attention of `model`'s attention modules through the padded layout of
    `state["packing"]` (set by the traced forward before it calls the body)."""
    modules = {sys.modules[type(m).__module__] for m in model.modules()
               if type(m).__name__.endswith("Attention") and hasattr(sys.modules[type(m).__module__], "eager_attention_forward")}
    if not modules:
        raise RuntimeError("packed_attention: no attention module with an eager_attention_forward in this model")
    saved = {mod: mod.eager_attention_forward for mod in modules}
    for mod, fn in saved.items():
        mod.eager_attention_forward = _packed_attention(fn, state)
    try:
        yield
    finally:
        for mod, fn in saved.items():
            mod.eager_attention_forward = fn
