"""eval.scoring.Scorer over a bundle's ONNX eval model (ONNX Runtime inference, no torch).

The eval graph takes input_ids, attention_mask, labels and loss_scale and returns
`loss` = loss_scale * summed shifted NLL over the labelled tokens, plus `logits` [N, V] at the N
positions t whose *next* label is set (labels[:, t+1] != -100), in row-major (batch, position)
order (see ort_trainer.manifest.LossSpec). So:

* nll: one run with loss_scale = 1 gives the sum; the count is loss_token_count(labels).
* last_logits: one column (pad id, attention 0) is appended and only labels[b, last_real_b + 1]
  is set, so the graph returns exactly one logits row per batch row, at its last real token.

LoRA weights are graph inputs keyed by their ONNX names (ort_trainer.adapter reads them from a bundle's
initial checkpoint, a training run's latest checkpoint, or a PEFT adapter directory).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ort_trainer.bundle import Bundle, open_bundle
from ort_trainer.records import IGNORE_INDEX, loss_token_count
from ort_trainer.adapter import initial_lora
from ort_trainer.session import EvalSession, RuntimeOptions

# Rows per graph run are limited so that the model's full logits block ([rows, seq, V] float32,
# computed inside the graph before the labelled positions are gathered) stays below this many
# elements (2**28 floats = 1 GiB); a row is never split.
MAX_LOGIT_ELEMENTS = 1 << 28


# --------------------------------------------------------------------------------------------
# Where LoRA weights come from
# --------------------------------------------------------------------------------------------
def as_bundle(bundle: Bundle | str | Path, verify: str = "sizes") -> Bundle:
    return bundle if isinstance(bundle, Bundle) else open_bundle(bundle, verify=verify)


# --------------------------------------------------------------------------------------------
# The scorer
# --------------------------------------------------------------------------------------------
class OrtScorer:
    """Scorer over a bundle's eval model. `lora` maps ONNX names to tensors (ONNX layout);
    None means the bundle's initial checkpoint (PEFT init, B = 0: exactly the base model)."""

    def __init__(self, bundle: Bundle | str | Path, lora: dict[str, np.ndarray] | None = None,
                 options: RuntimeOptions = RuntimeOptions(), max_logit_elements: int = MAX_LOGIT_ELEMENTS):
        self.bundle = as_bundle(bundle)
        man = self.bundle.manifest
        if lora is None:
            lora = initial_lora(self.bundle)
        self.vocab = int(man.model.vocab_size)
        self.max_positions = int(man.model.max_positions)
        self.max_logit_elements = int(max_logit_elements)
        self.session = EvalSession(self.bundle, self._validated(lora), options)

    def _validated(self, lora: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        man = self.bundle.manifest
        missing = sorted(set(man.trainable_names) - set(lora))
        if missing:
            raise KeyError(f"LoRA weights are missing {len(missing)} tensors of the bundle, e.g. {missing[0]}")
        for t in man.trainable:
            if list(np.shape(lora[t.onnx_name])) != list(t.shape):
                raise ValueError(f"{t.onnx_name}: shape {list(np.shape(lora[t.onnx_name]))} != bundle's {t.shape}")
        return {n: np.ascontiguousarray(lora[n], dtype=np.float32) for n in man.trainable_names}

    def set_lora(self, lora: dict[str, np.ndarray]) -> None:
        """Score with other LoRA weights (ONNX names); they are graph inputs, so the session is reused."""
        self.session.lora = self._validated(lora)

    # -- helpers -------------------------------------------------------------------------------
    def _groups(self, lengths: np.ndarray):
        """Row indices in groups of similar length (sorted), each within the logits budget;
        with the width each group needs (its longest row)."""
        order = np.argsort(lengths, kind="stable")
        group: list[int] = []
        width = 0
        for i in order:
            w = max(width, int(lengths[i]))
            if group and (len(group) + 1) * w * self.vocab > self.max_logit_elements:
                yield np.asarray(group), width
                group, w = [], int(lengths[i])
            group.append(int(i))
            width = w
        if group:
            yield np.asarray(group), width

    @staticmethod
    def _check(input_ids, attention_mask, labels=None):
        input_ids = np.asarray(input_ids, dtype=np.int64)
        attention_mask = np.asarray(attention_mask, dtype=np.int64)
        if input_ids.ndim != 2 or attention_mask.shape != input_ids.shape:
            raise ValueError("input_ids and attention_mask must both be [B, S]")
        if labels is not None:
            labels = np.asarray(labels, dtype=np.int64)
            if labels.shape != input_ids.shape:
                raise ValueError("labels must be [B, S] like input_ids")
        return input_ids, attention_mask, labels

    @staticmethod
    def _used_width(attention_mask: np.ndarray, labels: np.ndarray | None = None) -> np.ndarray:
        """Per row: columns up to the last real token or label (right padding beyond is dropped)."""
        used = attention_mask != 0
        if labels is not None:
            used = used | (labels != IGNORE_INDEX)
        cols = np.arange(attention_mask.shape[1])[None, :]
        return np.where(used, cols + 1, 0).max(axis=1)

    # -- Scorer --------------------------------------------------------------------------------
    def nll(self, input_ids: np.ndarray, attention_mask: np.ndarray, labels: np.ndarray) -> tuple[float, int]:
        input_ids, attention_mask, labels = self._check(input_ids, attention_mask, labels)
        total = 0.0
        count = 0
        widths = np.maximum(self._used_width(attention_mask, labels), 1)
        for rows, width in self._groups(widths):
            lab = labels[rows, :width]
            n = loss_token_count(lab)
            if n == 0:
                continue
            batch = {"input_ids": input_ids[rows, :width], "attention_mask": attention_mask[rows, :width],
                     "labels": lab}
            loss, _ = self.session.run(batch, loss_scale=1.0)
            total += float(loss)
            count += n
        return total, count

    def last_logits(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        input_ids, attention_mask, _ = self._check(input_ids, attention_mask)
        lengths = attention_mask.sum(axis=1).astype(np.int64)
        if (lengths < 1).any():
            raise ValueError("every row needs at least one real token")
        widths = self._used_width(attention_mask)
        if not np.array_equal(widths, lengths):
            raise ValueError("last_logits expects right padding (attention_mask = 1 then 0)")
        if int(lengths.max()) + 1 > self.max_positions:
            raise ValueError(f"a prompt of {int(lengths.max())} tokens leaves no room for the extra column the eval "
                             f"graph needs (max {self.max_positions - 1} tokens for this model); truncate prompts "
                             f"to <= {self.max_positions - 1} tokens")
        out = np.empty((input_ids.shape[0], self.vocab), dtype=np.float32)
        pad = int(input_ids[attention_mask == 0][0]) if (attention_mask == 0).any() else 0
        for rows, width in self._groups(lengths):
            b = len(rows)
            ids = np.full((b, width + 1), pad, dtype=np.int64)
            mask = np.zeros((b, width + 1), dtype=np.int64)
            labels = np.full((b, width + 1), IGNORE_INDEX, dtype=np.int64)
            ids[:, :width] = input_ids[rows, :width]
            mask[:, :width] = attention_mask[rows, :width]
            labels[np.arange(b), lengths[rows]] = 0          # position last_real + 1: any valid id
            _, logits = self.session.run({"input_ids": ids, "attention_mask": mask, "labels": labels}, 1.0)
            if logits.shape[0] != b:
                raise RuntimeError(f"eval graph returned {logits.shape[0]} logits rows for {b} prompts")
            out[rows] = logits
        return out
