"""The web runner's pieces against their Python/ORT originals: the learning-rate schedule (exactly equal) and
clip + AdamW (android_runner/web/src/adamw.mjs) against ORT's own InplaceClipGradNorm + AdamWOptimizer
kernels, run through the optimizer graph the device builds (ort_trainer.optimizer_graph)."""
from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest

from tests.conftest import WEB


def run_node(script: str, payload) -> object:
    proc = subprocess.run(["node", "--input-type=module", "-e", script], input=json.dumps(payload),
                          capture_output=True, text=True, cwd=WEB, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


READ_STDIN = "const input = JSON.parse(require('fs').readFileSync(0, 'utf8'));".replace(
    "require('fs')", "(await import('node:fs')).default")


def test_schedule_equals_python(node_web):
    from ort_trainer.schedule import lr_at

    cases = [(s, lr, w, t, sch) for sch in ("cosine", "linear", "constant") for (lr, w, t) in
             [(2e-4, 10, 100), (5e-3, 0, 7), (1e-3, 3, 3), (3e-4, 5, 1)] for s in range(0, t + 2)]
    script = READ_STDIN + """
const { lrAt } = await import('./src/schedule.mjs');
console.log(JSON.stringify(input.map(([s, lr, w, t, sch]) => lrAt(s, lr, w, t, sch))));"""
    got = run_node(script, cases)
    want = [lr_at(*c) for c in cases]
    # V8's Math.cos and the C library's cos may differ in the last bit of a double; the optimizer is fed
    # float32 (Optimizer.set_learning_rate), which is equal.
    assert np.array_equal(np.float32(got), np.float32(want))
    assert max(abs(a - b) / max(abs(b), 1e-300) for a, b in zip(got, want)) < 1e-15


@pytest.mark.parametrize("clip,weight_decay", [(0.5, 0.01), (None, 0.0), (100.0, 0.1)])
def test_adamw_matches_ort_kernels(node_web, clip, weight_decay):
    import onnxruntime as ort

    from ort_trainer.optimizer_graph import AdamWSpec, build_adamw
    from tests.bundle_helpers import with_outputs

    sess = ort.InferenceSession(with_outputs(build_adamw(AdamWSpec(clip=clip, weight_decay=weight_decay))).SerializeToString(),
                                providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    shapes = [(64, 4), (4, 192), (3,), (17, 5)]
    params = [rng.standard_normal(s).astype(np.float32) * 0.1 for s in shapes]
    m = [np.zeros(s, np.float32) for s in shapes]
    v = [np.zeros(s, np.float32) for s in shapes]
    steps = [([rng.standard_normal(s).astype(np.float32) * 0.3 for s in shapes], float(lr))
             for lr in (1e-3, 5e-3, 2.5e-3, 7e-4, 1e-2)]
    ref_p, ref_m, ref_v = [p.copy() for p in params], m, v
    for k, (grads, lr) in enumerate(steps):
        _, ref_p, ref_m, ref_v = sess.run(None, {
            "learning_rate": np.array([lr], np.float32), "step": np.array([k + 1], np.int64),
            "params": ref_p, "gradients": [g.copy() for g in grads], "first_order_moments": ref_m,
            "second_order_moments": ref_v})

    script = READ_STDIN + """
const { adamwSpec, adamwStep, clipGradNorm } = await import('./src/adamw.mjs');
const spec = adamwSpec(input.spec);
const F = (xs) => xs.map((x) => Float32Array.from(x));
const p = F(input.params), m = p.map((x) => new Float32Array(x.length)), v = p.map((x) => new Float32Array(x.length));
input.steps.forEach(([grads, lr], k) => {
  const g = F(grads);
  if (spec.maxNorm !== null) clipGradNorm(g, spec.maxNorm);
  adamwStep(spec, p, g, m, v, Math.fround(lr), k + 1);
});
console.log(JSON.stringify([p, m, v].map((xs) => xs.map((x) => Array.from(x)))));"""
    got = run_node(script, {
        "spec": {"beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": weight_decay, "clip": clip},
        "params": [p.ravel().tolist() for p in params],
        "steps": [[[g.ravel().tolist() for g in grads], lr] for grads, lr in steps]})
    # The same float32 operations in the same order; x86 ORT's Eigen evaluates the AdamW sqrt with an
    # approximate reciprocal square root (EIGEN_FAST_MATH) where JS (and ORT's WASM build) rounds exactly,
    # so parameters may differ in the last bits; the moments do not depend on it.
    worst = 0.0
    for mine, ref in zip(got, (ref_p, ref_m, ref_v)):
        for a, b in zip(mine, ref):
            a, b = np.asarray(a, np.float32), b.ravel()
            worst = max(worst, float(np.max(np.abs(a - b)) / np.max(np.abs(b))))
    print(f"clip={clip} wd={weight_decay}: max diff vs ORT kernels after {len(steps)} steps {worst:.1e} of the tensor's max")
    assert worst < 1e-6
