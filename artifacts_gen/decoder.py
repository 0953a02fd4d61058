"""The bundle's decoder graph: prefill and single-token decode with a KV cache, in one graph.

Inputs: input_ids [B, S]; attention_mask [B, P + S] (1 = a real token; prompts are left-padded); position_ids
[B, S]; past.{i}.key / past.{i}.value [B, kv_heads, P, head_dim] per layer (P = 0 at prefill); and every LoRA
tensor of the manifest's `trainable` list, under its ONNX name, as a plain input (zeros: the base model), so any
run's or PEFT directory's adapter applies at run time without a re-export. (Not initializers with a zero default:
onnxruntime-web refuses to feed an overridable initializer.) Outputs: logits [B, V] at the last position, present.{i}.key / .value [B, kv_heads, P + S,
head_dim].

The frozen weights are the training graphs' own: the decoder is traced from the same PEFT model, named, fixed and
quantized by the same passes, and each initializer is then pointed at the shard bytes that already hold it, after
checking that the bytes are equal (link_to_shards). No weight is stored twice; a quantized bundle's decoder
multiplies by the codes themselves (MatMulNBits: nbits.py) instead of dequantizing them.

Gemma3's sliding-window layers keep their whole cache here and apply the window in the attention mask (the same
function as transformers' sliding cache, which drops the old entries instead).
"""
from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import helper, numpy_helper

from ort_trainer import manifest as mf

from . import graph_fixes, nbits, quantize
from .export import ExportError, fusable_gelu, traceable_masks
from .families import Family
from .shards import MIN_EXTERNAL_BYTES

INPUTS = ("input_ids", "attention_mask", "position_ids")


def cache_shape(config) -> tuple[int, int, int]:
    """(layers, kv_heads, head_dim) of the model's KV cache."""
    layers = int(config.num_hidden_layers)
    heads = int(getattr(config, "num_attention_heads", None) or config.n_head)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    return layers, kv_heads, head_dim


def past_names(layers: int) -> list[str]:
    return [f"past.{i}.{kv}" for i in range(layers) for kv in ("key", "value")]


def present_names(layers: int) -> list[str]:
    return [f"present.{i}.{kv}" for i in range(layers) for kv in ("key", "value")]


class DecoderWithPast(torch.nn.Module):
    """(input_ids, attention_mask, position_ids, *past) -> (last-position logits, *present)."""

    def __init__(self, peft_model, family: Family):
        super().__init__()
        base = peft_model.base_model.model
        self.body = getattr(base, family.body_attr)
        self.head = base.get_output_embeddings()
        self.layers = int(base.config.num_hidden_layers)
        cap = getattr(base.config, family.softcap_key, None) if family.softcap_key else None
        self.softcap = float(cap) if cap else None

    def forward(self, input_ids, attention_mask, position_ids, *past):
        from transformers import DynamicCache

        cache = DynamicCache()           # no config: every layer keeps its whole past (see the module note)
        for i in range(self.layers):
            cache.update(past[2 * i], past[2 * i + 1], i)
        out = self.body(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                        past_key_values=cache, use_cache=True)
        logits = self.head(out.last_hidden_state[:, -1])
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        present = []
        for layer in out.past_key_values.layers:
            present += [layer.keys, layer.values]
        return (logits, *present)


def export_decoder(peft_model, family: Family, out_path: Path) -> None:
    """Trace the decoder with a past of 5 and 3 new tokens, one row left-padded; every length is dynamic."""
    base = peft_model.base_model.model
    base.set_attn_implementation("eager")     # as export_forward: masked scores at finfo.min, never NaN
    layers, kv_heads, head_dim = cache_shape(base.config)
    g = torch.Generator().manual_seed(4321)
    batch, past_len, new = 2, 5, 3
    ids = torch.randint(0, int(base.config.vocab_size), (batch, new), generator=g)
    mask = torch.ones(batch, past_len + new, dtype=torch.long)
    mask[1, :2] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, -new:]
    past = [torch.randn(batch, kv_heads, past_len, head_dim, generator=g) for _ in range(2 * layers)]
    dyn = {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "total"},
           "position_ids": {0: "batch", 1: "seq"}, "logits": {0: "batch"}}
    dyn.update({n: {0: "batch", 2: "past"} for n in past_names(layers)})
    dyn.update({n: {0: "batch", 2: "total"} for n in present_names(layers)})
    wrapper = DecoderWithPast(peft_model, family).eval()
    # The tracer's warnings here are about a new cache's lazy set-up and a padding test that is 0 whenever the
    # mask covers past + new tokens: both hold at every length (tests run other batch sizes, pasts, prompts).
    with traceable_masks(), fusable_gelu(wrapper), torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(wrapper, (ids, mask, positions, *past), str(out_path),
                          input_names=[*INPUTS, *past_names(layers)], output_names=["logits", *present_names(layers)],
                          dynamic_axes=dyn, opset_version=family.opset, do_constant_folding=True, dynamo=False)


def fix_decoder(model: onnx.ModelProto, sources: dict[str, np.ndarray], train: list[mf.Trainable], quant: str,
                quant_block: int, exact: dict | None, calibration=None) -> onnx.ModelProto:
    """The passes the training graphs' forward went through, so every weight gets the same name (and codes), then
    the LoRA tensors become graph inputs."""
    graph_fixes.split_value_merges(model)
    graph_fixes.name_initializers(model, sources)
    graph_fixes.untie_head(model)
    graph_fixes.constants_to_initializers(model, MIN_EXTERNAL_BYTES)
    graph_fixes.drop_causal_where(model)
    inits = {i.name: i for i in model.graph.initializer}
    missing = [t.onnx_name for t in train if t.onnx_name not in inits]
    if missing:
        raise ExportError(f"decoder graph: LoRA tensor(s) {missing[:3]} not found under the training graph's names")
    for t in train:               # plain inputs: onnxruntime-web cannot feed an initializer that is also an input
        model.graph.initializer.remove(inits[t.onnx_name])
        model.graph.input.append(helper.make_tensor_value_info(t.onnx_name, onnx.TensorProto.FLOAT, t.shape))
    model, weights = quantize.quantize_forward(model, quant, quant_block, {t.onnx_name for t in train},
                                               graph_fixes.TRANSPOSED, exact, calibration, split_offsets=False)
    model, _ = nbits.fuse(model, weights)       # one token at a time: multiply by the codes, never dequantize
    return model


INLINE_MAX = 1 << 20    # a derived tensor no shard holds (e.g. an exporter-folded constant) may stay in the graph


def link_to_shards(model: onnx.ModelProto, sharded: onnx.ModelProto, bundle_dir: Path, keep_inline: set[str]) -> int:
    """Point every initializer of `model` of >= MIN_EXTERNAL_BYTES (but `keep_inline`) at the shard bytes that hold
    the same values: the initializer of the same name in `sharded`, after checking the bytes are equal, or else
    (a derived tensor the exporter named anew, e.g. Gemma's 1 + norm weight) one of equal bytes. A weight the shards
    do not hold stays inline only if it is under INLINE_MAX; else it is an error: the decoder never carries a second
    copy of the weights. -> bytes linked."""
    where = {i.name: {e.key: e.value for e in i.external_data} for i in sharded.graph.initializer
             if i.data_location == onnx.TensorProto.EXTERNAL}
    by_length: dict[int, list[str]] = {}
    for name, ext in where.items():
        by_length.setdefault(int(ext["length"]), []).append(name)
    maps: dict[str, np.memmap] = {}

    def stored(name: str) -> np.ndarray:
        ext = where[name]
        if ext["location"] not in maps:
            maps[ext["location"]] = np.memmap(bundle_dir / ext["location"], dtype=np.uint8, mode="r")
        return maps[ext["location"]][int(ext["offset"]):int(ext["offset"]) + int(ext["length"])]

    linked = 0
    for init in model.graph.initializer:
        if init.name in keep_inline:
            continue
        data = np.frombuffer(init.raw_data if init.HasField("raw_data") else numpy_helper.to_array(init).tobytes(),
                             np.uint8)
        if len(data) < MIN_EXTERNAL_BYTES:
            continue
        if init.name in where:
            if int(where[init.name]["length"]) != len(data) or not np.array_equal(stored(init.name), data):
                raise ExportError(f"decoder graph: weight {init.name} differs from the shards' bytes of that name")
            same = init.name
        else:
            same = next((n for n in by_length.get(len(data), []) if np.array_equal(stored(n), data)), None)
            if same is None:
                if len(data) >= INLINE_MAX:
                    raise ExportError(f"decoder graph: weight {init.name} ({len(data)} bytes) is not in the bundle's "
                                      "shards")
                continue
        init.ClearField("raw_data")
        init.data_location = onnx.TensorProto.EXTERNAL
        del init.external_data[:]
        for key in ("location", "offset", "length"):
            entry = init.external_data.add()
            entry.key, entry.value = key, where[same][key]
        linked += len(data)
    return linked


def decoder_spec(config, max_positions: int) -> mf.DecoderSpec:
    layers, kv_heads, head_dim = cache_shape(config)
    return mf.DecoderSpec(file=mf.DECODER_MODEL, num_layers=layers, kv_heads=kv_heads, head_dim=head_dim,
                          max_positions=max_positions)
