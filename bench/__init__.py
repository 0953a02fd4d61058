"""Benchmarks, run from the repository root as modules; each run writes a dated run file of its own.

    python -m bench.train_throughput ...   training throughput and memory, ORT against PyTorch (bench/throughput/)
    python -m bench.gen_real_shapes ...    bundle generation at the true shapes of real models
    python -m bench.label_positions ...    what computing the LM head only at labelled positions saves
    python -m bench.memory_timeline ...    which tensors are alive at the peak of one training step (prints only)
    python -m bench.runs [DIR]             an index of the runs in DIR (default docs/bench/runs)

Results are runs named by their UTC start and what ran, e.g. docs/bench/runs/2026-12-03T0913Z-train-throughput.md,
with the raw JSON (and a plot, where there is one) beside it under the same stem; bench/runs.py names and heads them.
docs/bench/README.md (hand-written) holds the current table and links to the runs.

Shared by all: bench/common.py (paths, the host's fingerprint, logging), bench/children.py (child processes:
the parent's runner and lockstep, the child's side of the protocol), bench/runs.py (dated run files).
"""
