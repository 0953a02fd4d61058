"""A quantized frozen base (issue 29, artifacts_gen/quantize.py): bundles built with --quant int8|int4 against
PyTorch/PEFT running on the same dequantized weights, which the test computes itself from the codes and scales in
the bundle (numpy, onnx's own INT4 unpacking); the dequantization runs just in time."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import onnx
import pytest

from artifacts_gen import quantize
from ort_trainer import manifest as mf
from ort_trainer.bundle import open_bundle
from tests.bundle_helpers import (
    build_tiny_bundle, dequantizations, dequantized_here, eval_initializers, is_vocab, offset_term_model,
    offset_weight_here, peft_reference, run_offset_term_model, weight_reads, with_dequantized_base,
)
from tests.test_artifacts_gen import (
    assert_eval_matches_peft, assert_lora_grads_match_autograd, ten_adamw_steps,
)
from tests.tiny_models import FAMILIES

MODES = ("int8", "int4")


@pytest.fixture(scope="module", params=[(f, m) for f in FAMILIES for m in MODES], ids=lambda p: f"{p[0]}-{p[1]}")
def built(request, tmp_path_factory):
    family, mode = request.param
    ckpt, path = build_tiny_bundle(family, tmp_path_factory.mktemp(f"{family}-{mode}"), quant=mode, quant_block=16)
    return family, mode, ckpt, open_bundle(path)


def reference(ckpt, bundle):
    """PEFT on the source model, its quantized weights replaced by the bundle's dequantized values."""
    return with_dequantized_base(peft_reference(ckpt, bundle.manifest), bundle)


def test_every_frozen_linear_weight_is_quantized_and_close_to_the_source(built):
    family, mode, ckpt, bundle = built
    q = bundle.manifest.quant
    assert q.mode == mode and q.weights
    source = {n: p.detach().numpy() for n, p in peft_reference(ckpt, bundle.manifest).base_model.model.named_parameters()}
    source = {n.replace(".base_layer", ""): v for n, v in source.items()}
    layers = bundle.manifest.model.num_layers
    assert len(q.weights) >= 4 * layers                       # attention in/out and the MLP's, every layer
    inits = eval_initializers(bundle)
    for w in q.weights:
        assert w.onnx_name not in inits                       # no float32 copy of it is stored
        vocab = is_vocab(w)                  # embedding / LM head: int8 per row in both modes
        assert w.dtype == ("int8" if vocab or mode == "int8" else "uint4")
        if w.dtype == "uint4":      # the graphs read 4-bit codes [N, K] as their bytes, uint8 [N, K / block, block / 2]
            n, k = w.shape[::-1] if w.codes_transposed else w.shape
            assert inits[w.codes].data_type == onnx.TensorProto.UINT8
            assert list(inits[w.codes].dims) == [n, k // w.block, w.block // 2]
        else:
            assert inits[w.codes].data_type == onnx.TensorProto.INT8
        assert bool(w.offset) == (w.dtype == "uint4")
    deq = dequantized_here(bundle)
    for w in q.weights:
        x, y = source[w.source_key], deq[w.source_key]
        x_onnx = x.T if w.transposed else x                   # [in, out]: int8 per column, int4 per block of rows
        err = np.abs((y.T if w.transposed else y) - x_onnx)
        assert err.max() > 0                                  # really quantized
        if is_vocab(w):                      # embedding / LM head [V, H]: int8 per row
            step = np.abs(x_onnx).max(axis=1, keepdims=True) / 127
        elif mode == "int8":
            step = np.abs(x_onnx).max(axis=0, keepdims=True) / 127
        else:   # int4, asymmetric and clipped to the least squared error: per block, no worse than 16 even levels
            # from the block's min to its max, rounded to nearest (computed here), scale and offset in float16
            assert inits[w.scale].data_type == inits[w.offset].data_type == onnx.TensorProto.FLOAT16
            b = x_onnx.reshape(-1, 16, x_onnx.shape[1])
            lo, hi = np.minimum(b.min(axis=1, keepdims=True), 0), np.maximum(b.max(axis=1, keepdims=True), 0)
            s = np.where(hi > lo, (hi - lo) / 15, 1).astype(np.float16).astype(np.float32)
            lo = lo.astype(np.float16).astype(np.float32)
            plain = ((np.clip(np.rint((b - lo) / s), 0, 15) * s + lo - b) ** 2).sum(axis=1)
            ours = (err.reshape(b.shape) ** 2).sum(axis=1)
            assert (ours <= plain * (1 + 1e-4) + 1e-12).all() and ours.sum() < plain.sum(), w.source_key
            continue
        assert (err <= step / 2 * (1 + 1e-5) + 1e-12).all(), w.source_key       # round to nearest
    # the product's own reader (eval's PyTorch side) gives the same values
    ours = quantize.dequantized_weights(bundle.path, q)
    assert set(ours) == set(deq) and all(np.array_equal(ours[k], deq[k]) for k in deq)


@pytest.mark.parametrize("seq", [20, 48])       # not the traced length
def test_eval_logits_and_loss_match_peft_on_the_dequantized_weights(built, seq):
    family, mode, ckpt, bundle = built
    assert_eval_matches_peft(bundle, reference(ckpt, bundle), seq)


def test_lora_grads_match_autograd_on_the_dequantized_weights(built):
    family, mode, ckpt, bundle = built
    assert_lora_grads_match_autograd(ckpt, bundle, reference(ckpt, bundle))


def test_ten_adamw_steps_match_torch_on_the_dequantized_weights(built):
    """Against float64 PyTorch (the exact answer), within 1e-5 or twice float32 PyTorch's own distance from it.

    The start must be well-posed. At the first step AdamW moves every element by about lr * sign(gradient), so an
    element whose first gradient is below float32's rounding of it moves by +-lr on a coin toss in any float32
    run, and the change then spreads to every tensor through the next steps (measured on Gemma3 int4 with LoRA
    seed 4: one gradient 4.6e-8 in float64, -2.3e-8 in ORT, against 0.106 the tensor's largest; float32 PyTorch
    ended 9.9e-5 from float64 and ORT 3.3e-3). Later steps can amplify rounding too. So the LoRA start is the first
    seed from 4 that well_posed accepts: chosen from the float64 reference alone, never from ORT."""
    family, mode, ckpt, bundle = built
    ref64 = reference(ckpt, bundle).double()
    seed = next(s for s in range(4, 12) if well_posed(bundle, ref64, s))
    ort_final, torch32, _ = ten_adamw_steps(bundle, reference(ckpt, bundle), seed)
    _, torch64, _ = ten_adamw_steps(bundle, ref64, seed)
    for key, exact in torch64.items():
        floor = np.abs(torch32[key] - exact).max()
        assert np.abs(ort_final[key] - exact).max() <= max(1e-5, 2 * floor), (key, floor)


def well_posed(bundle, ref64, seed: int) -> bool:
    """Float32 rounding cannot move ten_adamw_steps from random_lora(seed) by more than 1e-6, judged in float64:
    no LoRA gradient of its first batch is a coin toss, and a start changed by 1e-7 relative (float32's rounding)
    ends within 1e-6 of it. Some starts amplify that 100-fold: on a tiny Gemma3 int4, seeds 4 and 5 ended 2.1e-5
    and 2.9e-5 apart, seeds 6-10 2.5-8e-7 (2026-12-06), and float32 PyTorch itself ended 2.2e-5 from float64 on
    seed 5."""
    from tests.bundle_helpers import load_lora_into, peft_lora_params, random_lora, torch_batch
    from tests.test_artifacts_gen import adamw_batches, torch_adamw_steps

    lora = random_lora(bundle.manifest, seed)
    load_lora_into(ref64, lora)
    ref64.zero_grad()
    batches = adamw_batches(bundle.manifest)
    ref64(**torch_batch(batches[0])).loss.backward()
    grads = [p.grad.numpy() for p in peft_lora_params(ref64).values()]
    if not all((np.abs(g) >= 1e-6 * np.abs(g).max()).all() for g in grads):
        return False
    rng = np.random.default_rng(seed)
    nudged = {k: v * (1 + 1e-7 * rng.choice([-1.0, 1.0], v.shape)) for k, v in lora.items()}
    a, b = torch_adamw_steps(bundle, ref64, lora, batches), torch_adamw_steps(bundle, ref64, nudged, batches)
    return max(np.abs(a[k] - b[k]).max() for k in a) <= 1e-6


def _ancestors(g: onnx.GraphProto, name: str) -> set[str]:
    """Every tensor `name` is computed from (itself included)."""
    producer = {o: n for n in g.node for o in n.output}
    seen, stack = set(), [name]
    while stack:
        t = stack.pop()
        if t in seen:
            continue
        seen.add(t)
        if t in producer:
            stack.extend(x for x in producer[t].input if x)
    return seen


def assert_dequantization_is_just_in_time(g: onnx.GraphProto) -> None:
    """Each dequantization waits for the activation of the matmul that reads it (so ORT cannot run them all, and
    hold all the float32 copies, at the start of the step, nor fold them into float32 constants), and the backward
    pass dequantizes again instead of keeping the forward's copy alive."""
    from artifacts_gen.recompute import backward_nodes, readers

    read_by = readers(g)
    bwd = backward_nodes(g, read_by)
    producer = {o: n for n in g.node for o in n.output}
    dqs = [(i, n) for i, n, _ in dequantizations(g)]
    assert dqs
    offsets = [(i, n) for i, n in enumerate(g.node) if n.op_type == "Reshape" and n.input[0].endswith(quantize.OFFSET)]
    for i, n in dqs + offsets:
        out = n.output[0]  # the weight or an offset term's (O + 8 S)^T: after its Reshape, Add, Transpose or Cast
        while (len(read_by[out]) == 1
               and g.node[read_by[out][0]].op_type in ("Reshape", "Add", "Transpose", "Cast", "Mul")):
            out = g.node[read_by[out][0]].output[0]
        readers_of = [g.node[j] for j in read_by[out]]
        assert readers_of
        before = _ancestors(g, out)
        assert "input_ids" in before, n.name                              # not a constant: waits for the batch
        uses = [r for r in readers_of if r.op_type in ("MatMul", "Gemm", "FusedMatMul") and r.input[1] == out]
        acts = [r.input[0] for r in uses] + [producer[r.input[0]].input[0] for r in uses   # the offset term: X E
                                             if r.input[0] in producer and producer[r.input[0]].name.endswith("/sums")]
        assert not uses or set(acts) & before, n.name                   # ... and for its reader's activation
        sides = {j in bwd for j in read_by[out]}
        assert len(sides) == 1, n.name                                 # not kept from the forward to the backward
    # A Cast (int4's float16 scales and offsets; int8 codes) or a bit operation (uint4 codes) of an initializer is a
    # constant, which ORT folds into a float32 copy on the heap: each reads its initializer through a gate, and the
    # backward pass has its own (Qwen2.5-0.5B in --memory low: +170 MiB for the scales and offsets' Casts)
    constants = {i.name for i in g.initializer} | {i.name for i in g.input}
    for i, n in enumerate(g.node):
        if n.op_type in ("Cast", "BitwiseAnd", "BitShift") and n.output[0].startswith("/"):
            assert n.input[0] not in constants, n.name
            assert {j in bwd for j in read_by[n.output[0]]} == {i in bwd}, n.name


def test_dequantization_is_gated_and_recomputed_for_the_backward(built):
    family, mode, ckpt, bundle = built
    g = onnx.load(str(bundle.file(mf.TRAINING_MODEL)), load_external_data=False).graph
    assert_dequantization_is_just_in_time(g)
    assert_dequantization_is_just_in_time(onnx.load(str(bundle.file(mf.EVAL_MODEL)), load_external_data=False).graph)
    weights = {w.onnx_name for w in bundle.manifest.quant.weights}
    from artifacts_gen.recompute import backward_nodes, readers
    bwd = backward_nodes(g)
    fwd_dq = [codes for i, _, codes in weight_reads(g) if i not in bwd]
    bwd_dq = [codes for i, _, codes in dequantizations(g) if i in bwd]
    linear = [w for w in bundle.manifest.quant.weights if not is_vocab(w)]
    assert set(fwd_dq) >= {w.codes for w in linear}               # every linear weight dequantized or MatMulNBits'
    weights = {w.onnx_name for w in linear}
    read_by = readers(g)
    for w in weights:          # its float32 copy (after the offset, if any) is not kept for the backward pass
        assert not [j for j in read_by[w] if j in bwd], w
    # the LM head is dequantized one vocabulary slice at a time, never whole (the eval graph does it whole)
    vocab = [w for w in bundle.manifest.quant.weights if is_vocab(w)]
    assert vocab, "the embedding / LM head is quantized too"
    whole = {w.codes for w in vocab}
    assert not [codes for _, _, codes in dequantizations(g) if codes in whole]
    assert sum(codes.startswith("/chunked_head/") for _, _, codes in dequantizations(g)) >= 2
    # dX = dY W^T needs a weight again wherever a gradient flows below it (not under the first layer's inputs)
    assert len(weights) // 2 <= len(set(bwd_dq)) < len(weights)   # (a split weight: two halves, one weight)
    for graph in (g, onnx.load(str(bundle.file(mf.EVAL_MODEL)), load_external_data=False).graph):
        assert_four_bit_weights_read_as_dequantized(graph, bundle.manifest.quant.weights)


MAPPED_TWICE = """
import json, sys
from ort_trainer.bundle import open_bundle
from ort_trainer.session import TrainSession
from tests.bundle_helpers import sample_batch
bundle = open_bundle(sys.argv[1], verify="none")
sess = TrainSession(bundle)
sess.forward_backward(sample_batch(bundle.manifest.model.vocab_size, 2, 33, seed=0), 1.0)
from android_runner.metrics import file_mappings
shards = [bundle.file(f.path) for f in bundle.manifest.files_with_role("shard")]
print(json.dumps([(path, offset, offset + size) for path, offset, size, _ in file_mappings(shards)]))
"""


def test_no_shard_bytes_are_mapped_twice(built):
    """ORT maps each external initializer on its own, and RSS counts a page once per mapping. The LM head's
    vocabulary views and the tied embedding lookup must read the same mappings, not the views and the whole table
    (Qwen2.5-0.5B int4 had its 130 MiB table in RSS twice). After a pass over ids across the vocabulary, no run of
    a shard's bytes longer than two pages (neighbours sharing a page) is mapped twice in the process."""
    import json
    import mmap
    from pathlib import Path

    family, mode, ckpt, bundle = built
    out = subprocess.run([sys.executable, "-c", MAPPED_TWICE, str(bundle.path)], capture_output=True, text=True,
                         check=True, cwd=Path(__file__).resolve().parents[1]).stdout
    maps = json.loads(out.splitlines()[-1])
    assert maps, "no shard mapped"
    for path in {m[0] for m in maps}:
        edges = sorted([(a, 1) for p, a, _ in maps if p == path] + [(b, -1) for p, _, b in maps if p == path])
        depth, start, longest = 0, 0, 0
        for x, d in edges:
            if depth >= 2:
                longest = max(longest, x - start)
            depth += d
            start = x
        assert longest <= 2 * mmap.PAGESIZE, f"{Path(path).name}: {longest:,} bytes mapped twice"


def assert_four_bit_weights_read_as_dequantized(g: onnx.GraphProto, weights) -> None:
    """A 4-bit [out, in] weight is read by MatMulNBits (the forward pass: no float32 copy), or its float32 copy is
    its dequantization's output, read by matmuls as it is (B transposed; the backward pass): no Transpose (ORT
    1.19's optimizer breaks a Transpose of a uint4 DQ) and no offset added to the whole weight (the offset term
    multiplies the activation's block sums instead, or MatMulNBits takes the offsets as float zero points, computed
    from the gated offsets); and the codes are centred, (C - 8) S (MatMulNBits' default zero point is 8)."""
    from artifacts_gen.recompute import readers

    read_by = readers(g)
    by_name = {n.name: n for n in g.node}
    inits = {i.name for i in g.initializer}
    codes = {w.codes for w in weights if w.codes_transposed}
    reads = [(n, c) for _, n, c in weight_reads(g) if c in codes]
    assert {c for _, c in reads} == codes
    for n, _ in reads:
        if n.op_type == "MatMulNBits":
            assert len(n.input) == 3 or n.input[3] not in inits, n.name     # 8, or computed float zero points
            continue
        zero_point = (by_name.get(n.name + "3") or by_name.get(n.name[:-1] + "lo/w3")    # fast_dequant's DQ
                      or n)                                                              # per row of a half
        assert len(zero_point.input) == 3, n.name
        for j in read_by[n.output[0]]:
            r = g.node[j]
            assert r.op_type in ("FusedMatMul", "Gemm") and list(r.input).index(n.output[0]) == 1, (n.name, r.op_type)


def test_a_manifest_without_quant_loads_as_unquantized(built, tmp_path):
    """Bundles built before the quantized base have no `quant` in their manifest."""
    import json

    data = json.loads((bundle_path := built[3].path / mf.MANIFEST_NAME).read_text())
    assert data["quant"]["mode"] == built[1]
    del data["quant"]
    old = mf.Manifest.from_dict(data, origin=str(bundle_path))
    assert old.quant.mode == "none" and old.quant.weights == []
    assert quantize.dequantized_weights(tmp_path, old.quant) == {}


@pytest.mark.parametrize("args, expect", [
    (["--quant", "int3"], "--quant int3: use one of none, int8, int4, keep"),
    (["--quant", "int4", "--quant-block", "7"], "--quant-block 7: use an even number"),
    (["--quant", "int8", "--quant-calib", "README.md"], "--quant-calib chooses int4's codes (GPTQ); add --quant int4"),
    (["--quant", "int4", "--quant-calib", "no-such.txt"], "--quant-calib no-such.txt: no such file"),
    (["--quant", "int4", "--quant-calib-tokens", "0"], "--quant-calib-tokens 0: use 1 or more"),
])
def test_bad_quant_options_fail_in_one_line_before_anything_is_written(tmp_path, args, expect):
    out = tmp_path / "bundle"
    r = subprocess.run([sys.executable, "-m", "pocketlora_cli", "gen", "--model", str(tmp_path / "none"),
                        "--out", str(out), *args], capture_output=True, text=True)
    assert r.returncode != 0
    assert expect in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not out.exists()


def test_offset_term_with_shared_activations_and_a_weight_read_twice():
    """int4's offset term where block sums are shared: weight A read by m1(x1) and m3(x2), weight B by m2(x2), in that
    order, so x2's block sums must come before m2 although A reaches x2 first. The graph stays topologically sorted
    (onnx.checker), and ORT's outputs equal numpy's x @ W on the weights dequantized here from codes, scales and
    offsets (W^T[n, k] = C[n, k] S[n, k // block] + O[n, k // block])."""
    model = offset_term_model(0)
    model.ir_version = 10
    onnx.checker.check_model(model)
    w = {x: offset_weight_here(model, x) for x in "AB"}
    for y, want in zip(*run_offset_term_model(model, w, 0)):
        np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
