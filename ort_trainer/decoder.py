"""Generate text with the bundle's decoder graph: a KV cache, and the adapter applied at run time.

onnxruntime and numpy only. The decoder (artifacts_gen/decoder.py, manifest.DecoderSpec) takes the LoRA tensors as
inputs (zeros: the base model), so `use_adapter` switches between adapters (a run's, a PEFT directory's, or none)
without touching the session or the weights. Rows of a batch are left-padded; each step feeds one new token per
row and the cache the previous step returned (its OrtValues, never copied through numpy).
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnxruntime as ort

from . import manifest as mf
from .bundle import Bundle, blame_damage
from .faults import InputError
from .sampling import Sampling, pick
from .session import RuntimeOptions


class Decoder:
    def __init__(self, bundle: Bundle, options: RuntimeOptions | None = None):
        spec = bundle.manifest.decoder
        if not spec.file:
            raise InputError(f"{bundle.path}: this bundle has no decoder graph (built before 2026-12-05). Rebuild it "
                             "with `pocketlora gen`; trained runs stay usable, their adapter fits the new bundle.")
        self.bundle, self.spec, self.manifest = bundle, spec, bundle.manifest
        so = (options or RuntimeOptions()).session_options()
        with blame_damage(bundle):
            self.session = ort.InferenceSession(str(bundle.file(spec.file)), so, providers=["CPUExecutionProvider"])
        self.outputs = [o.name for o in self.session.get_outputs()]
        self.adapter: dict[str, ort.OrtValue] = {}
        self.adapter_name = ""
        self.use_adapter(None)

    @property
    def max_positions(self) -> int:
        return self.spec.max_positions

    def use_adapter(self, lora: dict[str, np.ndarray] | None, name: str = "") -> float:
        """Apply an adapter (ONNX name -> tensor, as adapter.load_lora / load_peft give) or none; -> seconds taken."""
        t0 = time.perf_counter()
        if lora is None:
            lora, name = {t.onnx_name: np.zeros(t.shape, np.float32) for t in self.manifest.trainable}, \
                "none (the base model)"
        check_adapter(self.manifest, lora, name)
        self.adapter = {n: ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(v, dtype=np.float32))
                        for n, v in lora.items()}
        self.adapter_name = name or "an adapter"
        return time.perf_counter() - t0

    def empty_cache(self, batch: int) -> list[ort.OrtValue]:
        shape = (batch, self.spec.kv_heads, 0, self.spec.head_dim)
        return [ort.OrtValue.ortvalue_from_numpy(np.zeros(shape, np.float32)) for _ in range(2 * self.spec.num_layers)]

    def step(self, ids: np.ndarray, mask: np.ndarray, positions: np.ndarray,
             cache: list[ort.OrtValue]) -> tuple[np.ndarray, list[ort.OrtValue]]:
        """One call of the graph: -> (logits [B, V] at the last position, the new cache)."""
        feed = {"input_ids": ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(ids, np.int64)),
                "attention_mask": ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(mask, np.int64)),
                "position_ids": ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(positions, np.int64))}
        for i in range(self.spec.num_layers):
            feed[f"past.{i}.key"], feed[f"past.{i}.value"] = cache[2 * i], cache[2 * i + 1]
        feed.update(self.adapter)
        out = self.session.run_with_ort_values(self.outputs, feed)
        return out[0].numpy(), list(out[1:])


def check_adapter(manifest: mf.Manifest, lora: dict[str, np.ndarray], name: str) -> None:
    """Every LoRA tensor of the bundle, with its shape; else InputError naming the first mismatch."""
    want = {t.onnx_name: tuple(t.shape) for t in manifest.trainable}
    missing = [n for n in want if n not in lora]
    extra = [n for n in lora if n not in want]
    bad = [(n, want[n], tuple(np.shape(v))) for n, v in lora.items() if n in want and tuple(np.shape(v)) != want[n]]
    what = name or "the adapter"
    if bad:
        n, w, g = bad[0]
        raise InputError(f"{what}: {n} has shape {list(g)}, the bundle's LoRA needs {list(w)} ({len(bad)} tensor(s) "
                         "differ): the adapter was trained for another base model or LoRA rank. Use an adapter "
                         "trained on this bundle.")
    if missing or extra:
        n = (missing or extra)[0]
        raise InputError(f"{what}: {'lacks' if missing else 'has an unknown'} LoRA tensor {n} ({len(missing)} missing, "
                         f"{len(extra)} unknown): its target modules differ from the bundle's "
                         f"({', '.join(manifest.lora.target_modules)}). Use an adapter trained on this bundle.")


@dataclass
class Generated:
    token_ids: list[int]
    text: str
    stopped_by: str          # "eos" | "stop string" | "length"


def generate(decoder: Decoder, prompts: list[list[int]], sampling: Sampling, stop_ids: set[int], pad_id: int,
             decode: Callable[[list[int]], str] | None = None, stop_strings: tuple[str, ...] = (),
             on_text: Callable[[int, str], None] | None = None,
             on_logits: Callable[[np.ndarray], None] | None = None) -> list[Generated]:
    """New tokens for each prompt, all rows decoded together. A row ends at a stop id (not kept), at a stop string
    (the text is cut before it), or after max_new_tokens. `decode` (token ids -> text) is needed for text, stop
    strings and streaming: `on_text(row, piece)` gets each row's new text as it comes. `on_logits` sees each
    step's [B, V] logits before the pick."""
    sampling.check()
    if not prompts or any(len(p) == 0 for p in prompts):
        raise InputError("empty prompt: give at least one token of text.")
    longest = max(len(p) for p in prompts)
    if longest >= decoder.max_positions:
        raise InputError(f"prompt of {longest} tokens: the model's context is {decoder.max_positions} tokens, and "
                         "generation needs room for at least one more. Shorten the prompt.")
    budget = min(sampling.max_new_tokens, decoder.max_positions - longest)
    batch = len(prompts)
    ids = np.full((batch, longest), pad_id, dtype=np.int64)
    mask = np.zeros((batch, longest), dtype=np.int64)
    for b, p in enumerate(prompts):
        ids[b, longest - len(p):] = p
        mask[b, longest - len(p):] = 1
    positions = np.maximum(mask.cumsum(-1) - 1, 0)
    rng = np.random.default_rng(sampling.seed)
    new: list[list[int]] = [[] for _ in prompts]
    texts, ended, shown, streamed = [""] * batch, [""] * batch, [""] * batch, [0] * batch
    logits, cache = decoder.step(ids, mask, positions, decoder.empty_cache(batch))
    last = positions[:, -1:]
    for k in range(budget):
        if on_logits is not None:
            on_logits(logits)
        nxt = pick(logits, sampling, rng)
        for b, tok in enumerate(nxt.tolist()):
            if ended[b]:
                continue
            if tok in stop_ids:
                ended[b] = "eos"
                continue
            new[b].append(tok)
            if decode is not None:
                text = decode(new[b])
                hits = [i for i in (text.find(s) for s in stop_strings if s) if i >= 0]
                if hits:
                    text, ended[b] = text[:min(hits)], "stop string"
                texts[b] = text
        done = all(ended) or k == budget - 1
        if on_text is not None:
            for b, text in enumerate(texts):
                upto = len(text) if done or ended[b] else len(text) - _held_back(text, stop_strings)
                if upto > streamed[b] and text[:streamed[b]] == shown[b]:
                    on_text(b, text[streamed[b]:upto])
                    shown[b], streamed[b] = text[:upto], upto
        if done:
            break
        nxt = np.where(np.array([bool(e) for e in ended]), pad_id, nxt)
        mask = np.concatenate([mask, np.ones((batch, 1), np.int64)], axis=1)
        last = last + 1
        logits, cache = decoder.step(nxt[:, None], mask, last, cache)
    return [Generated(n, t, e or "length") for n, t, e in zip(new, texts, ended)]


def _held_back(text: str, stop_strings: tuple[str, ...]) -> int:
    """How many trailing characters of `text` are not streamed yet: a piece of a character still being decoded
    (U+FFFD: an incomplete UTF-8 sequence of byte tokens), or what could start a stop string."""
    partial = len(text) - len(text.rstrip("\ufffd"))
    return partial + max((k for s in stop_strings for k in range(min(len(s) - 1, len(text)), 0, -1)
                         if text[:len(text) - partial].endswith(s[:k])), default=0)
