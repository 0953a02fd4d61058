"""The PyTorch reference model of a bundle: the base model named by the manifest's model.source
(loaded through artifacts_gen.source) with a PEFT LoRA of the manifest's LoRA settings.

Used by `pocketlora eval ppl|mmlu --backend torch` (eval.verbs) and by parity's PyTorch side.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from .reference import make_peft_model, set_lora_state


def split_source(source: str) -> tuple[Path, str | None]:
    """manifest.model.source -> (directory, gguf file or None)."""
    p = Path(source)
    if p.suffix.lower() == ".gguf":
        return p.parent, p.name
    return p, None


def load_base_model(manifest):
    """The float32 HF base model named by the manifest, through artifacts_gen.source."""
    from artifacts_gen.source import load_source     # transformers and the GGUF reader: only when a model is loaded

    path, gguf = split_source(manifest.model.source)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: the bundle's source model (manifest model.source) is not on this "
                                "machine; the PyTorch side needs the checkpoint the bundle was built from")
    return load_source(path, gguf).model


def torch_lora_model(manifest, peft_state: dict[str, np.ndarray] | None = None, base=None):
    """A PEFT model of the base with the manifest's LoRA config, loaded with `peft_state` (PEFT keys)."""
    base = load_base_model(manifest) if base is None else base
    lora = manifest.lora
    model = make_peft_model(base, r=lora.r, alpha=lora.alpha, dropout=lora.dropout,
                            target_modules=lora.target_modules, fan_in_fan_out=lora.fan_in_fan_out)
    if peft_state is not None:
        set_lora_state(model, peft_state)
    return model.eval()
