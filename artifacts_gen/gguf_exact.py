"""A GGUF source's quantized tensors as integer codes x scale (+ offset) per block, exactly (`gen --quant keep`).

Each block format is rewritten, not requantized, so that codes * scale (+ offset) in float32 is bit for bit what
gguf-py's `dequantize` returns, i.e. the values llama.cpp runs (gguf.quants, dequantize_blocks):

  Q8_0  blocks of 32: d (f16), 32 int8 q            w = q * d
  Q5_0  blocks of 32: d (f16), 5-bit q - 16         w = q * d                    (codes int8 in [-16, 15])
  Q6_K  256 = 16 x 16: 6-bit q - 32, int8 sc, d     w = (d * sc) * q             (scale per 16; codes int8)
  Q4_K  256 = 8 x 32: 4-bit q, 6-bit sc and m, d, dmin
                                                    w = (d * sc) * q - dmin * m  (scale and offset per 32;
                                                                                  codes uint4, offset = -dmin * m)

Layout: a GGUF weight is [rows, cols] with blocks along a row (the input features of a linear layer, the hidden
size of the embedding). Returned as codes [rows, cols], scale and offset [rows, cols / block].
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# GGUF tensor name -> HF parameter name (llama.cpp's convert_hf_to_gguf names, the families we build)
_LAYER = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
          "ffn_down": "mlp.down_proj"}
_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output.weight": "lm_head.weight"}
FORMATS = ("Q8_0", "Q5_0", "Q6_K", "Q4_K")


@dataclass
class ExactBlocks:
    fmt: str                     # the GGUF block format
    codes: np.ndarray            # [rows, cols] int8 (uint8 in [0, 15] for Q4_K)
    scale: np.ndarray            # [rows, cols // block] float32
    offset: np.ndarray | None    # [rows, cols // block] float32, added after scaling (Q4_K), else None
    block: int

    def dequantize(self) -> np.ndarray:
        w = self.codes.astype(np.float32) * np.repeat(self.scale, self.block, axis=1)
        return w if self.offset is None else w + np.repeat(self.offset, self.block, axis=1)


def hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL:
        return _GLOBAL[gguf_name]
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", gguf_name)
    if m and m.group(2) in _LAYER:
        return f"model.layers.{m.group(1)}.{_LAYER[m.group(2)]}.weight"
    return None


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def exact_blocks(fmt: str, data: np.ndarray, rows: int, cols: int) -> ExactBlocks:
    """One tensor's raw GGUF bytes ([rows, bytes per row] uint8) as codes, scales and offsets."""
    import gguf

    qt = gguf.GGMLQuantizationType[fmt]
    block_size, type_size = gguf.GGML_QUANT_SIZES[qt]
    blocks = np.ascontiguousarray(data).reshape(-1, type_size)          # [rows * cols / block_size, type_size]
    n = blocks.shape[0]
    if fmt == "Q8_0":
        d, x = _f16(blocks[:, :2]), blocks[:, 2:].view(np.int8)
        return ExactBlocks(fmt, x.reshape(rows, cols), d.reshape(rows, -1), None, 32)
    if fmt == "Q5_0":
        d = _f16(blocks[:, :2])
        qh = np.ascontiguousarray(blocks[:, 2:6]).view(np.uint32).reshape(n, 1) >> np.arange(32, dtype=np.uint32)
        qs = blocks[:, 6:].reshape(n, 1, 16) >> np.array([0, 4], dtype=np.uint8).reshape(1, 2, 1)
        q = ((qs & 0x0F).reshape(n, 32) | ((qh & 1).astype(np.uint8) << 4)).astype(np.int8) - np.int8(16)
        return ExactBlocks(fmt, q.reshape(rows, cols), d.reshape(rows, -1), None, 32)
    if fmt == "Q6_K":
        ql, qh, sc, d = blocks[:, :128], blocks[:, 128:192], blocks[:, 192:208].view(np.int8), _f16(blocks[:, 208:210])
        scale = (d * sc.astype(np.float32)).reshape(n, 16)                 # gguf: d * scales, in float32
        ql = (ql.reshape(n, -1, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F
        qh = (qh.reshape(n, -1, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 0x03
        q = (ql.reshape(n, -1, 32) | (qh.reshape(n, -1, 32) << np.uint8(4))).astype(np.int8) - np.int8(32)
        return ExactBlocks(fmt, q.reshape(rows, cols), scale.reshape(rows, -1), None, 16)
    if fmt == "Q4_K":
        d, dmin = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
        sc, m = gguf.quants.Q4_K.get_scale_min(blocks[:, 4:16])
        scale = (d * sc.astype(np.float32)).reshape(n, 8)
        offset = -(dmin * m.astype(np.float32)).reshape(n, 8)
        qs = blocks[:, 16:].reshape(n, -1, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
        q = (qs & 0x0F).reshape(n, 256)
        return ExactBlocks(fmt, q.reshape(rows, cols), scale.reshape(rows, -1), offset.reshape(rows, -1), 32)
    raise ValueError(f"GGUF block format {fmt}: not one of {', '.join(FORMATS)}")


def read_exact(gguf_path: str | Path) -> dict[str, ExactBlocks]:
    """HF parameter name -> exact blocks, for every tensor of a supported format that maps to a weight we build
    (the others: norms in F32, formats not listed, are not in the result and are read as the source loads them)."""
    import gguf

    out = {}
    for t in gguf.GGUFReader(str(gguf_path)).tensors:
        name = hf_name(t.name)
        if name is None or t.tensor_type.name not in FORMATS:
            continue
        cols, rows = (int(x) for x in t.shape)          # GGUF lists the fastest-varying dimension first
        out[name] = exact_blocks(t.tensor_type.name, np.asarray(t.data), rows, cols)
    return out
