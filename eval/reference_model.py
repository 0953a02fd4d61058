"""The PyTorch reference model of a bundle: the base model named by the manifest's model.source
(loaded through artifacts_gen.source) with a PEFT LoRA of the manifest's LoRA settings. For a quantized bundle
(manifest quant), the frozen weights it quantized are replaced by the values its graphs compute from the codes, so
both backends run the same weights.

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


def load_base_model(bundle):
    """The float32 HF base model named by the bundle's manifest, through artifacts_gen.source, with a quantized
    bundle's dequantized weights."""
    import torch

    from artifacts_gen.quantize import dequantized_weights
    from artifacts_gen.source import load_source     # transformers and the GGUF reader: only when a model is loaded

    path, gguf = split_source(bundle.manifest.model.source)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: the bundle's source model (manifest model.source) is not on this "
                                "machine; the PyTorch side needs the checkpoint the bundle was built from")
    model = load_source(path, gguf).model
    weights = dequantized_weights(bundle.path, bundle.manifest.quant)
    if weights:
        params = dict(model.named_parameters())
        with torch.no_grad():
            for key, w in weights.items():
                params[key].copy_(torch.from_numpy(w))
    return model


def torch_lora_model(bundle, peft_state: dict[str, np.ndarray] | None = None, base=None):
    """A PEFT model of the bundle's base with the manifest's LoRA config, loaded with `peft_state` (PEFT keys)."""
    base = load_base_model(bundle) if base is None else base
    lora = bundle.manifest.lora
    model = make_peft_model(base, r=lora.r, alpha=lora.alpha, dropout=lora.dropout,
                            target_modules=lora.target_modules, fan_in_fan_out=lora.fan_in_fan_out)
    if peft_state is not None:
        set_lora_state(model, peft_state)
    return model.eval()
