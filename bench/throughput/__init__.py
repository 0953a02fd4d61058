"""The training-throughput bench (entry point: bench/train_throughput.py), one module per concern:

    config     what is measured (shapes, workloads, settings) and the issue's targets
    phases     the measuring: checkpoints and bundles, the pilot, one lockstep per shape, the GEMM reference
    lowmem     the low-memory run under a cgroup memory limit
    profile    ORT-profiled steps and their summary (where a step's time goes)
    gemm       the GEMM reference worker (float32 GEMM throughput on the step's own matmul shapes, in a child)
    flops      FLOPs of a step and what its matmuls would take at the measured GEMM rates
    summary    run records -> per-configuration statistics
    verdicts   the statistics against the targets
    render     the run's report (Markdown), from its JSON alone
    plot       the run's plot

Rendering reads only a run's JSON (and config, flops, summary, verdicts): any run can be re-rendered.
"""
