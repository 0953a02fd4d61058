"""ort_trainer.optimizer_graph: global-norm clipping whose result does not depend on the order of the tensors.

ORT's InplaceClipGradNorm adds the per-tensor sums of squares in the order of the parameter sequence, which ORT
builds by iterating an unordered map, so that order, and the last bits of every clipped step, changed from process
to process. Here the same step is run with the tensors in shuffled orders: the updated weights must be
bitwise equal, and equal to torch's clip_grad_norm_ + AdamW to float32 rounding."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from ort_trainer.optimizer_graph import AdamWSpec, build_adamw, is_order_dependent
from tests.bundle_helpers import with_outputs

N = 120      # tensors: enough that float32 sums in different orders differ


def _problem(seed=0):
    rng = np.random.default_rng(seed)
    shapes = [(int(rng.integers(1, 40)), int(rng.integers(1, 40))) for _ in range(N)]
    params = [rng.standard_normal(s).astype(np.float32) * 0.1 for s in shapes]
    scales = 10.0 ** rng.uniform(-4, 1, N)                        # sums of squares over many magnitudes
    grads = [(rng.standard_normal(s) * c).astype(np.float32) for s, c in zip(shapes, scales)]
    return params, grads


def _outcomes(model, params, grads, orders):
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    seen = set()
    for order in orders:
        out = sess.run(None, {
            "learning_rate": np.array([2e-3], np.float32), "step": np.array([1], np.int64),
            "params": [params[i].copy() for i in order], "gradients": [grads[i].copy() for i in order],
            "first_order_moments": [np.zeros_like(params[i]) for i in order],
            "second_order_moments": [np.zeros_like(params[i]) for i in order]})
        new = out[1]
        back = np.argsort(order)
        seen.add(np.concatenate([new[j].ravel() for j in back]).tobytes())
    return seen, new


def test_clipping_does_not_depend_on_the_order_of_the_tensors():
    params, grads = _problem()
    rng = np.random.default_rng(1)
    orders = [np.arange(N)] + [rng.permutation(N) for _ in range(15)]
    seen, _ = _outcomes(with_outputs(build_adamw(AdamWSpec(clip=1.0, weight_decay=0.01))), params, grads, orders)
    assert len(seen) == 1


def _legacy_graph(spec: AdamWSpec) -> onnx.ModelProto:
    """The optimizer graph as bundles held it before 2026-12-06: ORT's InplaceClipGradNorm in front of AdamW."""
    legacy = build_adamw(AdamWSpec(**{**spec.to_dict(), "clip": None}))
    adam = next(n for n in legacy.graph.node if n.op_type == "AdamWOptimizer")
    clip = onnx.helper.make_node("InplaceClipGradNorm", [adam.input[3]], ["clipped"], domain="com.microsoft",
                                 max_norm=spec.clip)
    adam.input[3] = "clipped"
    legacy.graph.node.insert(list(legacy.graph.node).index(adam), clip)
    return legacy


def test_orts_own_clipping_kernel_does(tmp_path):
    """The control: the same problem through ORT's InplaceClipGradNorm (what bundles held before 2026-12-06) gives
    several outcomes, so the test above can fail."""
    legacy = _legacy_graph(AdamWSpec(clip=1.0, weight_decay=0.01))
    onnx.save(legacy, str(tmp_path / "legacy.onnx"))
    onnx.save(build_adamw(AdamWSpec(clip=1.0)), str(tmp_path / "ours.onnx"))
    assert is_order_dependent(tmp_path / "legacy.onnx") and not is_order_dependent(tmp_path / "ours.onnx")
    params, grads = _problem()
    rng = np.random.default_rng(1)
    orders = [np.arange(N)] + [rng.permutation(N) for _ in range(15)]
    seen, _ = _outcomes(with_outputs(legacy), params, grads, orders)
    assert len(seen) > 1


@pytest.mark.parametrize("clip", [1.0, 1e3])         # clipped, and a norm under the bar
def test_clipped_step_equals_torch(clip):
    params, grads = _problem(2)
    _, new = _outcomes(with_outputs(build_adamw(AdamWSpec(clip=clip, weight_decay=0.01))), params, grads,
                              [np.arange(N)])
    tp = [torch.nn.Parameter(torch.from_numpy(p.copy())) for p in params]
    for p, g in zip(tp, grads):
        p.grad = torch.from_numpy(g.copy())
    norm = torch.nn.utils.clip_grad_norm_(tp, clip)
    assert (float(norm) > clip) == (clip == 1.0)
    opt = torch.optim.AdamW(tp, lr=2e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    opt.step()
    for mine, ref in zip(new, tp):
        ref = ref.detach().numpy()
        assert np.max(np.abs(mine - ref)) <= 1e-6 * max(np.max(np.abs(ref)), 1e-3)


def test_an_older_bundles_graph_is_rebuilt_outside_the_bundle(tmp_path, monkeypatch):
    from ort_trainer import manifest as mf
    from ort_trainer import session as session_mod
    from ort_trainer.bundle import open_bundle
    from tests.bundle_helpers import build_tiny_bundle

    _, path = build_tiny_bundle("gpt2", tmp_path)
    bundle = open_bundle(path, verify="none")
    onnx.save(_legacy_graph(AdamWSpec(**bundle.manifest.optimizer)), str(bundle.file(mf.OPTIMIZER_MODEL)))
    before = sorted(p.name for p in path.iterdir())
    built = []
    real = session_mod.write_adamw
    monkeypatch.setattr(session_mod, "write_adamw", lambda target, spec: (built.append(spec), real(target, spec)))
    s = session_mod.TrainSession(bundle)                     # no work_dir: a scratch directory, not the bundle
    assert built == [AdamWSpec(**bundle.manifest.optimizer)]
    assert sorted(p.name for p in path.iterdir()) == before
    ids = np.arange(1, 33, dtype=np.int64)[None] % 50
    s.forward_backward({"input_ids": ids, "attention_mask": np.ones_like(ids), "labels": ids}, 1.0 / 32)
    s.step(1e-3)                                             # the rebuilt graph steps
