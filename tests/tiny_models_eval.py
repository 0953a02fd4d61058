"""Tiny random models and data for the eval tests (no hub downloads: built from configs)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

GPT2_TOKENIZER = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "tokenizers" / "gpt2" / "tokenizer.json"
VOCAB = 1000


def tiny_gpt2(seed: int = 0, vocab_size: int = VOCAB, n_positions: int = 64, n_layer: int = 2,
              n_embd: int = 64, n_head: int = 4, perturb: float = 0.15):
    """A float32 GPT-2 with perturbed random weights (non-degenerate logits), in eval mode."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_head, vocab_size=vocab_size,
                     n_positions=n_positions, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(cfg).float()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * perturb)
    return model.eval()


def randomize_lora(peft_model, seed: int = 0, scale: float = 0.05) -> None:
    """Give every LoRA A and B random values (PEFT starts B at zero, which hides A's gradients)."""
    from eval.reference import get_lora_state, set_lora_state

    rng = np.random.default_rng(seed)
    state = get_lora_state(peft_model)
    set_lora_state(peft_model, {k: (rng.standard_normal(v.shape) * scale).astype(v.dtype) for k, v in state.items()})


def gpt2_encoder(vocab_size: int = VOCAB):
    """encode(str) -> ids with the real GPT-2 BPE, ids folded into the tiny vocab (letters " A".." D" stay < 1000)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(GPT2_TOKENIZER))

    def encode(text: str) -> list[int]:
        return [i % vocab_size for i in tok.encode(text).ids]

    return encode


def random_batch(rng: np.random.Generator, lengths: list[int], width: int, vocab: int = VOCAB,
                 label_frac: float = 0.7) -> dict[str, np.ndarray]:
    """Right-padded batch with rows of the given lengths; a random subset of real tokens labelled."""
    b = len(lengths)
    ids = np.zeros((b, width), dtype=np.int64)
    mask = np.zeros((b, width), dtype=np.int64)
    labels = np.full((b, width), -100, dtype=np.int64)
    for i, n in enumerate(lengths):
        ids[i, :n] = rng.integers(0, vocab, n)
        mask[i, :n] = 1
        keep = rng.random(n) < label_frac
        labels[i, :n] = np.where(keep, ids[i, :n], -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}
