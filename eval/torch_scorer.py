"""eval.scoring.Scorer for a Hugging Face causal LM in PyTorch (the reference side)."""
from __future__ import annotations

import contextlib
import math
import warnings

import numpy as np
import torch
import torch.nn.functional as F

from .scoring import IGNORE_INDEX

# Rows per forward are limited so that one float32 logits block stays below this many elements
# (2**28 floats = 1 GiB); a row is never split.
MAX_LOGIT_ELEMENTS = 1 << 28


@contextlib.contextmanager
def eval_mode(model: torch.nn.Module):
    """Put every submodule in eval mode, then restore each module's own previous mode."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield model
    finally:
        for m, training in modes:
            m.training = training


class TorchScorer:
    """Scorer over an HF causal LM (e.g. GPT2LMHeadModel or a PeftModel wrapping one).

    Runs under torch.no_grad() with all modules in eval mode (their modes are restored after each
    call); NLLs are float32 cross-entropy sums on the shifted logits, as in the product's loss.
    """

    def __init__(self, model: torch.nn.Module, max_logit_elements: int = MAX_LOGIT_ELEMENTS):
        self.model = model
        self.max_logit_elements = int(max_logit_elements)
        self._keep_supported: bool | None = None   # does the model accept a logits_to_keep tensor?
        dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
        if dtypes - {torch.float32}:
            warnings.warn(f"TorchScorer expects a float32 model, got parameter dtypes {sorted(map(str, dtypes))}")

    # -- helpers -------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _vocab(self) -> int:
        cfg = getattr(self.model, "config", None)
        return int(getattr(cfg, "vocab_size", 0) or 0) or 1

    def _row_chunks(self, batch: int, seq: int):
        rows = max(1, self.max_logit_elements // max(1, seq * self._vocab()))
        for r0 in range(0, batch, rows):
            yield slice(r0, min(batch, r0 + rows))

    def _tensor(self, a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(self.device)

    # -- Scorer --------------------------------------------------------------------------------
    def logits(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        """Full float32 logits [B, S, V] (for tests and debugging)."""
        with torch.no_grad(), eval_mode(self.model):
            out = self.model(input_ids=self._tensor(input_ids), attention_mask=self._tensor(attention_mask))
            return out.logits.float().cpu().numpy()

    def nll(self, input_ids: np.ndarray, attention_mask: np.ndarray, labels: np.ndarray) -> tuple[float, int]:
        input_ids = np.asarray(input_ids)
        if input_ids.ndim != 2 or np.shape(attention_mask) != input_ids.shape or np.shape(labels) != input_ids.shape:
            raise ValueError("input_ids, attention_mask and labels must all be [B, S]")
        total = 0.0
        count = 0
        with torch.no_grad(), eval_mode(self.model):
            for rows in self._row_chunks(*input_ids.shape):
                ids = self._tensor(input_ids[rows])
                mask = self._tensor(np.asarray(attention_mask)[rows])
                lab = self._tensor(np.asarray(labels)[rows])
                logits = self.model(input_ids=ids, attention_mask=mask).logits.float()
                shift_logits = logits[:, :-1, :].reshape(-1, logits.shape[-1])
                shift_labels = lab[:, 1:].reshape(-1)
                total += float(F.cross_entropy(shift_logits, shift_labels, reduction="sum", ignore_index=IGNORE_INDEX))
                count += int((shift_labels != IGNORE_INDEX).sum())
        return total, count

    def last_logits(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        input_ids = np.asarray(input_ids)
        attention_mask = np.asarray(attention_mask)
        if input_ids.ndim != 2 or attention_mask.shape != input_ids.shape:
            raise ValueError("input_ids and attention_mask must both be [B, S]")
        lengths = attention_mask.sum(axis=1).astype(np.int64)
        if (lengths < 1).any():
            raise ValueError("every row needs at least one real token")
        last = lengths - 1
        with torch.no_grad(), eval_mode(self.model):
            if self._keep_supported is not False:
                try:
                    out = self._last_logits_keep(input_ids, attention_mask, last)
                    self._keep_supported = True
                    return out
                except TypeError:
                    if self._keep_supported:
                        raise
                    self._keep_supported = False
            outs = []
            for rows in self._row_chunks(*input_ids.shape):
                logits = self.model(input_ids=self._tensor(input_ids[rows]),
                                    attention_mask=self._tensor(attention_mask[rows])).logits
                pos = torch.from_numpy(last[rows]).to(self.device)
                outs.append(logits[torch.arange(len(pos)), pos].float().cpu().numpy())
            return np.concatenate(outs, axis=0)

    def _last_logits_keep(self, input_ids, attention_mask, last) -> np.ndarray:
        """Project only the needed positions through the LM head (HF `logits_to_keep` tensor)."""
        vocab = self._vocab()
        rows_per = max(1, int(math.isqrt(max(1, self.max_logit_elements // vocab))))  # logits are [rows, <=rows, V]
        outs = []
        for r0 in range(0, input_ids.shape[0], rows_per):
            rows = slice(r0, r0 + rows_per)
            pos = last[rows]
            keep, inverse = np.unique(pos, return_inverse=True)
            logits = self.model(input_ids=self._tensor(input_ids[rows]),
                                attention_mask=self._tensor(attention_mask[rows]),
                                logits_to_keep=torch.from_numpy(keep).to(self.device)).logits
            if logits.shape[1] != len(keep):
                raise TypeError("model ignored logits_to_keep")
            sel = torch.from_numpy(inverse.reshape(-1)).to(self.device)
            outs.append(logits[torch.arange(len(pos)), sel].float().cpu().numpy())
        return np.concatenate(outs, axis=0)
