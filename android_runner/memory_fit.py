"""Choose the micro-batch from a memory budget, by measuring this device.

The effective batch (micro-batch x accumulation) defines the training; how it is split only decides
speed and memory. Larger micro-batches run larger matmuls (faster) but keep more activations for the
backward pass. Peak RSS grows linearly with the sequences of a micro-batch (bench, all three real
shapes: e.g. Qwen2.5-0.5B 2,293 / 2,515 / 2,963 / 3,829 MiB at 1 / 2 / 4 / 8 sequences, +~110 MiB
each), so two measured forward/backward passes predict the rest:

0. save a checkpoint of the session to a scratch file (deleted), from a reset peak: what the save adds;
1. run a worst-case micro-batch of 1 sequence (every position a real, labelled token, at the bundle's
   seq-len) from a reset peak (VmHWM); then one of 2 sequences, but only if even the first pass's peak plus
   all it added fits the budget (so that pass never goes over; else every further sequence is counted at
   that bound); gradients are dropped after each, so the model is untouched. A peak counts the weight shards'
   pages the pass did not read (an untied embedding's rows: the pass reads token 0's, training all of them);
2. peak(m) = peak(1) + (m - 1) * (peak(2) - peak(1)); pick the largest m that divides the effective
   batch and whose prediction fits the budget;
   every peak also counts what a checkpoint save adds (measured once, step 0): the loop saves after
   steps, on top of the memory the passes left in ORT's arena, and that was a run's peak (GPT-2 int4 at 1x8:
   361 MiB in the pass, 376 at the final save; Qwen2.5 int4: 868 against 909);
3. if that m is above 2, run it once as well, and step down while the measurement exceeds the budget;
4. if the chosen m is below the largest measured, train in a new session (the loop): ORT's arena keeps what
   its largest pass needed.

The measurement is this device's own: its ORT build, its allocator, its page size. In the normal
memory mode the budget counts all of RSS, the memory-mapped weights included. With `--memory low` the
weights are meant to be dropped and read again under pressure, so the budget counts anonymous memory
only (activations, gradients, the runtime): the peak RSS of the pass minus its file-backed part
(VmHWM - RssFile), and the weights' page cache gets what the budget leaves. Qwen2.5-0.5B in low mode
under a cgroup cap of 1,131 MiB (60% of its weights): 1 x 8 took 29.0 s per step, 2 x 4 20.0 s, and
4 x 2 was killed by the cgroup (anonymous 1.15 GB), all three with ORT's arena off; with the arena on
(now the default in low mode too) 4 x 2 completes in 17.6 s.
"""
from __future__ import annotations

import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from .metrics import peak_rss_mb, reset_peak_rss, rss_mb, status_mb, unfaulted_mb

AUTO = "auto"
AUTO_FRACTION = 0.8    # `auto`: this share of what the system can still give (MemAvailable + own RSS, or a cgroup limit)


class MemoryBudgetError(ValueError):
    pass


def parse_budget(text: str) -> str | float:
    """'auto', or a size in MiB: '2800', '2800M', '2.8G' (G = GiB)."""
    t = str(text).strip()
    if t.lower() == AUTO:
        return AUTO
    scale = 1.0
    if t[-1:].upper() in ("M", "G"):
        scale = 1024.0 if t[-1].upper() == "G" else 1.0
        t = t[:-1]
    try:
        mb = float(t) * scale
    except ValueError:
        raise MemoryBudgetError(f"--memory-budget {text!r}: give MiB (2800), a size (2800M, 2.8G) or auto") from None
    if mb <= 0:
        raise MemoryBudgetError(f"--memory-budget {text!r} must be > 0")
    return mb


def _ancestors(path: str) -> list[str]:
    """'/a/b' -> ['/a/b', '/a', '/']: a cgroup's limit applies to everything below it."""
    parts = [p for p in path.split("/") if p]
    return ["/" + "/".join(parts[:k]) for k in range(len(parts), -1, -1)]


def cgroup_limit_mb(proc_cgroup: str = "/proc/self/cgroup", fs: str = "/sys/fs/cgroup") -> float | None:
    """The tightest memory limit over this process's cgroup and its ancestors (v2 memory.max, v1
    memory.limit_in_bytes), or None where there is none."""
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return None
    limits = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            files = [Path(fs + d) / "memory.max" for d in _ancestors(path)]
        elif "memory" in controllers.split(","):
            files = [Path(fs, "memory" + d) / "memory.limit_in_bytes" for d in _ancestors(path)]
        else:
            continue
        for f in files:
            try:
                raw = f.read_text().strip()
            except OSError:
                continue
            if raw != "max" and int(raw) < 2**60:      # v1 writes "no limit" as ~2^63
                limits.append(int(raw) / 2**20)
    return min(limits) if limits else None


def auto_budget_mb() -> tuple[float, str]:
    """AUTO_FRACTION of what this process can grow to, and where that figure came from."""
    available = status_mb("MemAvailable", "/proc/meminfo")
    room, why = (available + rss_mb(), "MemAvailable + own RSS") if available is not None else (None, "")
    limit = cgroup_limit_mb()
    if limit is not None and (room is None or limit < room):
        room, why = limit, "cgroup memory limit"
    if room is None:
        raise MemoryBudgetError("--memory-budget auto: /proc/meminfo is not readable here; give the budget in MiB")
    return AUTO_FRACTION * room, f"{AUTO_FRACTION:.0%} of {why} ({room:,.0f} MiB)"


def worst_case_batch(micro: int, seq_len: int) -> dict[str, np.ndarray]:
    """`micro` sequences of `seq_len` real tokens, every one labelled: the most a micro-batch can hold.
    Token values do not change memory; 0 is a valid id in every vocabulary."""
    ids = np.zeros((micro, seq_len), dtype=np.int64)
    return {"input_ids": ids, "attention_mask": np.ones_like(ids), "labels": ids.copy()}


@dataclass(frozen=True)
class Pass:
    peak_mb: float         # what the budget counts at the pass's peak
    growth_mb: float       # of it, the anonymous memory the pass added (activations, the arena's growth)


def measure_pass(session, micro: int, seq_len: int, anonymous: bool = False, mapped=()) -> Pass:
    """One forward/backward pass at `micro` worst-case sequences from a reset peak; the gradients are dropped.
    Its peak is the process's peak RSS plus the pages of the `mapped` files (the weight shards) it did not read:
    an untied embedding's rows, of which the pass reads token 0's and training all (a tied one is read whole by the
    head's vocabulary views every pass). `anonymous` (--memory low): the peak RSS minus the file-backed pages
    instead."""
    anon_before = _anon_mb()
    reset_peak_rss()
    session.forward_backward(worst_case_batch(micro, seq_len), 1.0 / (micro * seq_len))
    session.drop_grads()
    anon_peak = _anon_peak_mb()
    peak = anon_peak if anonymous else peak_rss_mb() + unfaulted_mb(mapped)
    return Pass(peak, max(0.0, anon_peak - anon_before))


def measure_save(session, anonymous: bool = False) -> float:
    """MiB a checkpoint save of `session` adds at its peak (ORT serializes the LoRA weights and the optimizer's
    moments): a save to a scratch file in the session's work directory, deleted after. `anonymous`: anonymous
    memory only."""
    with tempfile.TemporaryDirectory(prefix=".memory-fit-", dir=session.work_dir) as scratch:
        before = _anon_mb() if anonymous else rss_mb()
        reset_peak_rss()
        session.save(Path(scratch) / "probe.ckpt")
        peak = _anon_peak_mb() if anonymous else peak_rss_mb()
    return max(0.0, peak - before)


def _anon_mb() -> float:
    return status_mb("RssAnon") or 0.0


def _anon_peak_mb() -> float:
    """The peak RSS less the file-backed pages resident now (what --memory low counts)."""
    return peak_rss_mb() - (status_mb("RssFile") or 0.0)


@dataclass
class MemoryFit:
    budget_mb: float
    budget_source: str
    effective_batch: int
    micro_batch: int
    accum: int
    measured_mb: dict = field(default_factory=dict)     # micro-batch -> measured peak MiB
    per_sequence_mb: float = 0.0
    predicted_mb: dict = field(default_factory=dict)    # candidate micro-batch -> linear prediction from 1 and 2
    counts: str = "RSS"                                 # or "anonymous RSS" (--memory low)
    start_mb: float = 0.0                               # the process's peak before the fit: the sessions' start
    save_mb: float = 0.0                                # what a checkpoint save adds; in every measured peak
    bound_2_mb: float = 0.0                             # micro-batch 2 at most (1's peak + 1's growth): run if in budget

    @property
    def needs_new_session(self) -> bool:
        """The split is below the largest measured pass, whose memory ORT's arena keeps: train in a new session
        (GPT-2 int4 measured at 1 and 2 and trained at 1 in the same session peaked as at 2)."""
        return self.micro_batch < max(self.measured_mb)

    def summary(self) -> str:
        meas = ", ".join(f"{m}: {v:,.0f}" for m, v in sorted(self.measured_mb.items()))
        if 2 not in self.measured_mb and self.effective_batch % 2 == 0:
            meas += f" (2 not run: it could take up to {self.bound_2_mb:,.0f})"
        meas += f"; +{self.per_sequence_mb:,.0f} MiB per sequence"
        if self.save_mb:
            meas += f"; a checkpoint save's {self.save_mb:,.0f} MiB counted in each"
        return (f"memory budget {self.budget_mb:,.0f} MiB of {self.counts} ({self.budget_source}): measured peak MiB at micro-batch "
                f"{meas} -> micro-batch {self.micro_batch} x accum "
                f"{self.accum} (predicted {self.predicted_mb[self.micro_batch]:,.0f} MiB, measured "
                f"{self.measured_mb[self.micro_batch]:,.0f}); the sessions' start peaked at {self.start_mb:,.0f} MiB")

    def to_dict(self) -> dict:
        return asdict(self)


def choose_micro_batch(measure, effective_batch: int, budget_mb: float, budget_source: str = "given",
                       counts: str = "RSS") -> MemoryFit:
    """`measure(m)` -> the Pass of a worst-case micro-batch of m sequences. Candidates are the divisors of
    `effective_batch`, measured in increasing order, and only where predicted to fit. Micro-batch 2 is measured only
    if it fits even at the first pass's peak plus all that pass added (a bound: the pass's fixed part counts twice),
    so that pass never goes over; without it (or with an odd effective batch) every sequence is counted at that
    bound."""
    candidates = [m for m in range(1, effective_batch + 1) if effective_batch % m == 0]
    first = measure(1)
    measured = {1: first.peak_mb}
    if measured[1] > budget_mb:
        raise MemoryBudgetError(
            f"even micro-batch 1 needs {measured[1]:,.0f} MiB, over the {budget_mb:,.0f} MiB budget. Raise "
            f"--memory-budget, use --memory low (weights stay file-backed), or build the bundle with a shorter "
            f"--seq-len.")
    bound_2 = first.peak_mb + first.growth_mb
    if effective_batch > 1 and candidates[1] == 2 and bound_2 <= budget_mb:
        measured[2] = measure(2).peak_mb
    # per sequence: from the passes of 1 and 2; without a pass of 2, all the first pass added (an upper bound)
    slope = max(0.0, measured[2] - measured[1]) if 2 in measured else first.growth_mb
    predicted = {m: measured[1] + (m - 1) * slope for m in candidates}
    fitting = [m for m in candidates if measured.get(m, predicted[m]) <= budget_mb]
    while True:
        chosen = fitting[-1]
        if chosen in measured:
            break
        measured[chosen] = measure(chosen).peak_mb
        if measured[chosen] <= budget_mb:
            break
        fitting.pop()
    return MemoryFit(budget_mb, budget_source, effective_batch, chosen, effective_batch // chosen,
                     measured, slope, predicted, counts, bound_2_mb=bound_2)


def fit_session(session, seq_len: int, effective_batch: int, budget, log=print, anonymous: bool = False) -> MemoryFit:
    """Measure `session` (a TrainSession) and choose its micro-batch under `budget` (MiB or AUTO);
    `anonymous` (--memory low): the budget bounds anonymous memory only."""
    if budget == AUTO:
        budget_mb, source = auto_budget_mb()
    else:
        budget_mb, source = float(budget), "given"
    log(f"measuring memory per micro-batch (worst case: {seq_len} labelled tokens per sequence)")
    start_mb = peak_rss_mb()             # the peak so far: loading the bundle and starting the sessions
    if start_mb > budget_mb and not anonymous:
        log(f"warning: starting the sessions already peaked at {start_mb:,.0f} MiB, over the {budget_mb:,.0f} MiB "
            "budget; no split brings the process under it")
    if not reset_peak_rss():
        log("warning: this kernel cannot reset the peak-RSS mark (/proc/self/clear_refs); each measurement is the "
            "peak of the whole process so far, so the split chosen may be smaller than what fits")
    shards = [session.bundle.file(f.path) for f in session.bundle.manifest.files_with_role("shard")]
    save_mb = measure_save(session, anonymous)

    def measure(m: int) -> Pass:
        p = measure_pass(session, m, seq_len, anonymous, shards)
        return Pass(p.peak_mb + save_mb, p.growth_mb)

    fit = choose_micro_batch(measure, effective_batch, budget_mb, source, "anonymous RSS" if anonymous else "RSS")
    fit.start_mb, fit.save_mb = start_mb, save_mb
    log(fit.summary())
    return fit
