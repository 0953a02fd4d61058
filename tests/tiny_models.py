"""Tiny random checkpoints of each family, saved like a real HF checkpoint directory.

Weights are perturbed so that no two tensors are identical (the exporter deduplicates equal
initializers, which would hide naming and tying bugs). Real tokenizer files come from ../shared.
"""
from __future__ import annotations

from pathlib import Path

import torch

from tests.conftest import SHARED_DATA

FAMILIES = ("gpt2", "qwen2", "gemma3")


def tiny_config(family: str):
    from transformers import Gemma3TextConfig, GPT2Config, Qwen2Config

    if family == "gpt2":
        return GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=256, vocab_size=50257)
    if family == "qwen2":
        return Qwen2Config(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=151936, max_position_embeddings=256,
                           tie_word_embeddings=True)
    if family == "gemma3":
        return Gemma3TextConfig(num_hidden_layers=3, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16, vocab_size=50257,
                                max_position_embeddings=256, sliding_window=8,
                                layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                bos_token_id=50256, eos_token_id=50256, pad_token_id=50256)
    raise ValueError(family)


def tiny_model(family: str, seed: int = 0, **config_overrides):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = tiny_config(family)
    for key, value in config_overrides.items():
        setattr(config, key, value)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


def make_tiny_checkpoint(family: str, directory: Path, seed: int = 0, **config_overrides) -> Path:
    from transformers import AutoTokenizer

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tiny_model(family, seed, **config_overrides).save_pretrained(directory, safe_serialization=True)
    tok_dir = SHARED_DATA / "tokenizers" / ("qwen2.5" if family == "qwen2" else "gpt2")
    AutoTokenizer.from_pretrained(tok_dir).save_pretrained(directory)
    return directory
