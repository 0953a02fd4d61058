"""Batching on the device: right-padded micro-batches (`collate`), the deterministic, resumable order
they are taken in (`DataOrder`, `data_order`), and the micro-batches of one optimizer step
(`step_batches`)."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .records import IGNORE_INDEX, Example
from .tokenizer import DataError


def collate(examples: list[Example], pad_id: int, pad_to: int | None = None) -> dict[str, np.ndarray]:
    """Right-pad a micro-batch to its longest example (or to ``pad_to``).

    Returns int64 ``input_ids`` (padding = ``pad_id``), ``attention_mask`` (1 on tokens, 0 on
    padding) and ``labels`` (``-100`` on padding), each ``[B, L]``.
    """
    if not examples:
        raise ValueError("collate: no examples")
    longest = max(len(e.input_ids) for e in examples)
    length = longest if pad_to is None else int(pad_to)
    if length < longest:
        raise ValueError(f"collate: pad_to={pad_to} is shorter than the longest example ({longest} tokens)")
    b = len(examples)
    input_ids = np.full((b, length), int(pad_id), dtype=np.int64)
    attention_mask = np.zeros((b, length), dtype=np.int64)
    labels = np.full((b, length), IGNORE_INDEX, dtype=np.int64)
    for i, e in enumerate(examples):
        n = len(e.input_ids)
        if len(e.labels) != n:
            raise ValueError(f"collate: example {i} has {n} input_ids but {len(e.labels)} labels")
        input_ids[i, :n] = e.input_ids
        attention_mask[i, :n] = 1
        labels[i, :n] = e.labels
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}



class DataOrder:
    """Deterministic, resumable order over examples: epoch e uses
    ``np.random.default_rng([seed, e]).permutation(n)``.

    Micro-batches are consecutive slices of that permutation. Policy: ``drop_last`` — when
    ``n >= batch_size`` the last partial micro-batch of an epoch is skipped (each epoch has
    ``n // batch_size`` micro-batches of exactly ``batch_size``; the skipped examples differ from
    epoch to epoch). When ``n < batch_size`` every epoch is one short micro-batch of all ``n``
    examples. Epochs roll over without end. The state (``epoch``, ``position`` = examples already
    taken in the current epoch) always points at the next micro-batch, so after the last batch of
    an epoch it reads ``epoch + 1, position 0``.

    ``lengths`` (token count per example) turns on length grouping, as transformers'
    ``group_by_length``: the epoch's permutation is cut into mega-batches of ``GROUP_BATCHES``
    micro-batches, each sorted by length (longest first) and cut into micro-batches whose order is
    then shuffled with the same generator. A micro-batch is padded to its longest example, so
    mixing 20- and 120-token examples otherwise spends most of the step on padding. The grouped
    order is still a pure function of (seed, epoch, lengths): resume stays exact.
    """

    GROUP_BATCHES = 32

    VERSION = 1

    def __init__(self, n: int, seed: int, batch_size: int, lengths: Sequence[int] | None = None):
        if int(n) < 1:
            raise DataError(f"DataOrder: no examples (n={n})")
        if int(batch_size) < 1:
            raise ValueError(f"DataOrder: batch_size must be >= 1 (got {batch_size})")
        self.n = int(n)
        self.seed = int(seed)
        self.batch_size = int(batch_size)
        if lengths is not None and len(lengths) != self.n:
            raise ValueError(f"DataOrder: {len(lengths)} lengths for {self.n} examples")
        self.lengths = None if lengths is None else np.asarray(lengths, dtype=np.int64)
        self.epoch = 0
        self.position = 0
        self._perm_epoch = -1
        self._perm: np.ndarray | None = None

    @property
    def _take(self) -> int:
        return min(self.batch_size, self.n)

    def steps_per_epoch(self) -> int:
        """Micro-batches per epoch (``n // batch_size``, at least 1)."""
        return max(1, self.n // self.batch_size)

    @property
    def step_in_epoch(self) -> int:
        return self.position // self._take

    @property
    def epoch_progress(self) -> float:
        """Epochs done as a float (e.g. 1.5 = halfway through the second epoch)."""
        return self.epoch + self.step_in_epoch / self.steps_per_epoch()

    def permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            rng = np.random.default_rng([self.seed, int(epoch)])
            perm = rng.permutation(self.n)
            self._perm = perm if self.lengths is None else self._grouped(perm, rng)
            self._perm_epoch = epoch
        return self._perm

    def _grouped(self, perm: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        take, mega = self._take, self._take * self.GROUP_BATCHES
        out = []
        for m in range(0, len(perm), mega):
            chunk = perm[m:m + mega]
            chunk = chunk[np.argsort(-self.lengths[chunk], kind="stable")]
            batches = [chunk[i:i + take] for i in range(0, len(chunk), take)]
            full = [b for b in batches if len(b) == take]
            out += [full[i] for i in rng.permutation(len(full))] + [b for b in batches if len(b) < take]
        return np.concatenate(out)

    def next_batch(self) -> tuple[list[int], int]:
        """Indices of the next micro-batch and the epoch it belongs to."""
        take = self._take
        epoch = self.epoch
        perm = self.permutation(epoch)
        idx = [int(i) for i in perm[self.position:self.position + take]]
        self.position += take
        if self.position + take > self.n:
            self.epoch += 1
            self.position = 0
        return idx, epoch

    def state_dict(self) -> dict:
        return {"version": self.VERSION, "epoch": self.epoch, "position": self.position, "seed": self.seed,
                "n": self.n, "batch_size": self.batch_size, "group_by_length": self.lengths is not None}

    def load_state_dict(self, d: dict) -> None:
        try:
            n, seed, bs = int(d["n"]), int(d["seed"]), int(d["batch_size"])
            epoch, position = int(d["epoch"]), int(d["position"])
        except (KeyError, TypeError, ValueError) as e:
            raise DataError(f"data order state is incomplete or malformed ({e!r}); it needs epoch, position, "
                            "seed, n and batch_size") from e
        if n != self.n:
            raise DataError(f"the data changed since the run started: the checkpoint's data order has n={n} "
                            f"examples, the data now gives {self.n}; resume with the same data file, tokenizer "
                            "and seq_len, or start a new run")
        if seed != self.seed:
            raise DataError(f"the data order changed since the run started: the checkpoint used seed={seed}, "
                            f"now seed={self.seed}; resume with the same seed, or start a new run")
        if bs != self.batch_size:
            raise DataError(f"the micro-batch size changed since the run started (checkpoint {bs}, now "
                            f"{self.batch_size}); resume with the same batch size, or start a new run")
        if bool(d.get("group_by_length", False)) != (self.lengths is not None):
            raise DataError(f"length grouping changed since the run started (checkpoint "
                            f"group_by_length={bool(d.get('group_by_length', False))}); resume with the same "
                            "setting, or start a new run")
        if epoch < 0 or position < 0 or position % self._take or position + self._take > self.n:
            raise DataError(f"data order state is inconsistent (epoch={epoch}, position={position}, n={n}, "
                            f"batch_size={bs})")
        self.epoch, self.position = epoch, position



def data_order(examples: Sequence[Example], seed: int, micro_batch: int, group_by_length: bool = False) -> DataOrder:
    """The order a run takes its micro-batches in (length grouping uses each example's token count)."""
    return DataOrder(len(examples), seed, micro_batch,
                     lengths=[len(e.input_ids) for e in examples] if group_by_length else None)



def step_batches(examples: Sequence[Example], order: DataOrder, accum: int, pad_id: int) -> list[dict[str, np.ndarray]]:
    """The micro-batches of one optimizer step: the next `accum` micro-batches of `order`, collated."""
    return [collate([examples[i] for i in order.next_batch()[0]], pad_id) for _ in range(accum)]

