"""Trace a PEFT-wrapped causal LM, with its loss, to a forward-only ONNX graph.

The traced module takes (input_ids, attention_mask, labels, loss_scale) and returns
(loss, logits). Its per-token layers run on the real tokens only (packing.py), and it computes the
LM head only at positions whose shifted label is not -100, so prompt tokens and padding cost no
vocabulary projection, and the [B, S, V] logits tensor never exists. The loss is exactly HF's when
loss_scale = 1 / (number of labelled tokens).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ort_trainer.manifest import IGNORE_INDEX, INPUT_NAMES

from .families import Family
from .packing import Packing, attention_windows, packed_attention


class ExportError(RuntimeError):
    pass


@dataclass
class LoraSettings:
    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: str = "attn"
    seed: int = 0


def make_peft_model(model, family: Family, lora: LoraSettings):
    """Wrap `model` in PEFT LoRA exactly as a PEFT user would (A Kaiming-uniform, B zero)."""
    from peft import LoraConfig, get_peft_model

    targets = family.target_modules(lora.targets)
    _check_targets(model, targets, lora.targets)
    for name, why in family.broken_targets:
        if name in targets:
            ok = ",".join(t for t in family.attn_targets + family.mlp_targets if t not in dict(family.broken_targets))
            raise ExportError(f"--targets {lora.targets}: LoRA on {name!r} cannot be trained in a {family.name} bundle: "
                              f"{why}. Leave it out, e.g. --targets {ok} (what --targets all-linear gives here).")
    torch.manual_seed(lora.seed)
    config = LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=targets,
        fan_in_fan_out=family.fan_in_fan_out,
        bias="none",
    )
    peft_model = get_peft_model(model, config)
    peft_model.eval()
    return peft_model, config


def _check_targets(model, targets: list[str], asked: str) -> None:
    linear_names = [
        name for name, mod in model.named_modules() if type(mod).__name__ in ("Linear", "Conv1D")
    ]
    for t in targets:
        if not any(n == t or n.endswith("." + t) for n in linear_names):
            suffixes = sorted({".".join(n.split(".")[-2:]) for n in linear_names} | {n.split(".")[-1] for n in linear_names})
            raise ExportError(
                f"--targets {asked}: no linear layer named {t!r} in this model. "
                f"Known names: {', '.join(suffixes)}. Or use --targets attn / mlp-out / all-linear."
            )


class CausalLMWithLoss(torch.nn.Module):
    """(input_ids, attention_mask, labels, loss_scale) -> (loss, logits at labelled positions)."""

    def __init__(self, peft_model, family: Family):
        super().__init__()
        self.peft_model = peft_model
        base = peft_model.base_model.model
        self.body = getattr(base, family.body_attr)
        self.head = base.get_output_embeddings()
        cap = getattr(base.config, family.softcap_key, None) if family.softcap_key else None
        self.softcap = float(cap) if cap else None
        self.packing: dict = {}         # the traced micro-batch's Packing, read by packed_attention
        self.windows = attention_windows(self.body)

    def forward(self, input_ids, attention_mask, labels, loss_scale):
        # Padding-free: the body runs on the real tokens only (see packing.py), so the graph computes
        # nothing per token at padding positions. Labels are shifted in the padded layout first.
        pk = self.packing["packing"] = Packing(attention_mask, self.windows)
        # Embeddings go in as inputs_embeds: GPT-2's body views input_ids as (-1, length), and with the -1 the
        # residual stream's leading 1 became unknown to shape inference, so ORT's gradient of every residual
        # Add summed over that axis of size 1 (a copy of [1, T, D] per layer).
        embeds = self.body.get_input_embeddings()(pk.tokens(input_ids))
        hidden = self.body(inputs_embeds=embeds, position_ids=pk.positions, attention_mask=None,
                           use_cache=False).last_hidden_state
        h = hidden.flatten(0, 1)                                               # [T, H]
        end = torch.full_like(labels[:, :1], IGNORE_INDEX)
        y = pk.tokens(torch.cat([labels[:, 1:], end], dim=1)).flatten()        # [T]: the next token's label
        keep = torch.nonzero(y != IGNORE_INDEX).squeeze(1)
        logits = self.head(h.index_select(0, keep))
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        nll = F.cross_entropy(logits, y.index_select(0, keep), reduction="sum")
        return nll * loss_scale, logits


@contextlib.contextmanager
def traceable_masks():
    """transformers builds masks with vmap, which TorchScript cannot trace ("unordered_map::at").
    optimum-onnx ships vectorised replacements; register them for the duration of the export."""
    import transformers.masking_utils as mu
    from optimum.exporters.onnx.model_patcher import (
        eager_mask_without_vmap,
        find_packed_sequence_indices_patched,
        sdpa_mask_without_vmap,
    )

    registry = mu.ALL_MASK_ATTENTION_FUNCTIONS
    saved = (registry["sdpa"], registry["eager"], mu.find_packed_sequence_indices)
    registry.register("sdpa", sdpa_mask_without_vmap)
    registry.register("eager", eager_mask_without_vmap)
    mu.find_packed_sequence_indices = find_packed_sequence_indices_patched
    try:
        yield
    finally:
        registry.register("sdpa", saved[0])
        registry.register("eager", saved[1])
        mu.find_packed_sequence_indices = saved[2]


@contextlib.contextmanager
def fusable_gelu(model):
    """Trace tanh-approximated GELU modules (Gemma's GELUTanh = F.gelu(approximate="tanh")) as the
    explicit formula of GPT-2's NewGELUActivation: the same function, in the form ORT fuses into one
    FastGelu node, which keeps only its input for the backward pass instead of several [tokens, ffn]
    intermediates (slow_kernels makes its gradient fast)."""
    from transformers.activations import NewGELUActivation

    patched = [m for m in model.modules() if type(m).__name__ == "GELUTanh"]
    for m in patched:
        m.forward = NewGELUActivation.forward.__get__(m)
    try:
        yield len(patched)
    finally:
        for m in patched:
            del m.forward


def trace_inputs(vocab_size: int, seq_len: int, batch: int = 2):
    """Inputs for tracing: a padded row and prompt-masked labels, so no path is specialised away."""
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, vocab_size, (batch, seq_len), generator=g)
    mask = torch.ones(batch, seq_len, dtype=torch.long)
    mask[-1, seq_len - max(1, seq_len // 4):] = 0
    labels = ids.clone()
    labels[mask == 0] = IGNORE_INDEX
    labels[0, : seq_len // 3] = IGNORE_INDEX
    return ids, mask, labels, torch.tensor(1.0)


def export_forward(wrapper: CausalLMWithLoss, family: Family, out_path: Path, traced_seq_len: int) -> None:
    base = wrapper.peft_model.base_model.model
    vocab = base.config.vocab_size
    # Eager attention masks with finfo.min, not -inf: a query row whose keys are all masked (padding
    # beyond a sliding window) then gets a uniform softmax instead of NaN, which would otherwise
    # reach the LoRA gradients through NaN * 0 in the backward pass. Same math as SDPA otherwise.
    base.set_attn_implementation("eager")
    args = trace_inputs(vocab, traced_seq_len)
    dyn = {name: {0: "batch", 1: "seq"} for name in INPUT_NAMES[:3]}
    dyn["logits"] = {0: "labelled"}
    with traceable_masks(), fusable_gelu(wrapper), packed_attention(base, wrapper.packing), torch.no_grad():
        torch.onnx.export(
            wrapper,
            args,
            str(out_path),
            input_names=list(INPUT_NAMES),
            output_names=["loss", "logits"],
            dynamic_axes=dyn,
            opset_version=family.opset,
            do_constant_folding=True,
            dynamo=False,
        )


def lora_tensors(peft_model) -> dict[str, np.ndarray]:
    """PEFT's state-dict key -> current value, for the LoRA weights only."""
    from peft import get_peft_model_state_dict

    return {k: v.detach().cpu().numpy().copy() for k, v in get_peft_model_state_dict(peft_model).items()}


def set_placeholders(peft_model, seed: int) -> None:
    """Give every LoRA tensor distinct values before tracing.

    PEFT initialises every B to zeros, so all B's of one shape are identical; the exporter
    would merge them into ONE shared initializer and training would silently tie the layers.
    PEFT's real initial values are written back into the graph after export.
    """
    g = torch.Generator().manual_seed(10_000 + seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
