"""artifacts_gen/fast_dequant.py: the rewritten dequantizations give DequantizeLinear's values bit for bit, computed
here by numpy from the codes and scales; the forward matmuls it hands to MatMulNBits match numpy's product."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from artifacts_gen import fast_dequant
from artifacts_gen.quantize import int4_tensor
from artifacts_gen.recompute import gate_nodes

RNG = np.random.default_rng(0)
N, K, BLOCK = 24, 64, 16


def _graph(codes: onnx.TensorProto, scale: np.ndarray, dq_attrs: dict, zero_point: onnx.TensorProto | None,
           reader: str) -> onnx.ModelProto:
    """x -> gate(scale) -> DequantizeLinear(codes) -> w; outputs w itself (reader ""), FusedMatMul(x, w, transB)
    ("mm": a forward matmul, x [m, K]) or MatMul(x, w) ("dx": the backward pass's dY W, x [m, N])."""
    inits = [codes, numpy_helper.from_array(scale, "s"), numpy_helper.from_array(np.asarray(0, np.int64), "zero")]
    dq_inputs = ["q", "g/x"]
    if zero_point is not None:
        inits.append(zero_point)
        dq_inputs.append("zp")
    nodes = gate_nodes("s", "x", "g/", "zero") + [helper.make_node("DequantizeLinear", dq_inputs, ["w"], name="dq",
                                                                   **dq_attrs)]
    outputs = [helper.make_tensor_value_info("w", TensorProto.FLOAT, None)]
    if reader == "mm":
        nodes.append(helper.make_node("FusedMatMul", ["x", "w"], ["y"], name="mm", domain="com.microsoft", transB=1))
    elif reader == "dx":
        nodes.append(helper.make_node("MatMul", ["x", "w"], ["y"], name="dx"))
    if reader:
        outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]
    x_dim = N if reader == "dx" else K
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, None)], outputs,
                          inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)],
                             ir_version=10)


def _run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.add_session_config_entry("session.disable_prepacking", "1")
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


def _cases():
    q8 = RNG.integers(-127, 128, (K, N)).astype(np.int8)
    c4 = RNG.integers(0, 16, (N, K)).astype(np.int8)
    f32 = lambda *shape: (RNG.random(shape) * 0.1 + 0.01).astype(np.float32)
    return {   # name: (codes tensor, scales, DQ attributes, zero point tensor, numpy's weight)
        "int8 per column": (numpy_helper.from_array(q8, "q"), s := f32(N), {"axis": 1}, None, q8 * s),
        "int8 per row": (numpy_helper.from_array(q8, "q"), s := f32(K), {"axis": 0}, None, q8 * s[:, None]),
        "int8 blocks along rows": (numpy_helper.from_array(q8, "q"), s := f32(K // BLOCK, N),
                                   {"axis": 0, "block_size": BLOCK}, None, q8 * np.repeat(s, BLOCK, axis=0)),
        "int8 blocks along columns": (numpy_helper.from_array(q8.T.copy(), "q"), s := f32(N, K // BLOCK),
                                      {"axis": 1, "block_size": BLOCK}, None, q8.T * np.repeat(s, BLOCK, axis=1)),
        "uint4 zero point 8": (int4_tensor(c4, "q", unsigned=True), s := f32(N, K // BLOCK),
                               {"axis": 1, "block_size": BLOCK},
                               int4_tensor(np.full((N, K // BLOCK), 8, np.int8), "zp", unsigned=True),
                               (c4.astype(np.float32) - 8) * np.repeat(s, BLOCK, axis=1)),
        "uint4 no zero point": (int4_tensor(c4, "q", unsigned=True), s := f32(N, K // BLOCK),
                                {"axis": 1, "block_size": BLOCK}, None, c4 * np.repeat(s, BLOCK, axis=1)),
    }


@pytest.mark.parametrize("case", list(_cases()))
def test_rewritten_dequantization_is_bit_identical(case):
    codes, scale, attrs, zp, want = _cases()[case]
    model = _graph(codes, scale, attrs, zp, reader="")
    before = _run(model, np.ones((3, K), np.float32))
    assert fast_dequant.rewrite(model, {"q"}) == 1
    ops = {n.op_type for n in model.graph.node}
    left = [n for n in model.graph.node if n.op_type == "DequantizeLinear"]      # uint4: per row of computed codes
    assert all(n.input[0] != "q" and not any(a.name == "block_size" for a in n.attribute) for n in left), ops
    after = _run(model, np.ones((3, K), np.float32))
    w = want.astype(np.float32)
    assert np.array_equal(after.view(np.uint32), w.view(np.uint32)), case
    assert np.array_equal(after.view(np.uint32), before.view(np.uint32)), case


def test_a_forward_matmul_of_uint4_codes_becomes_matmulnbits():
    codes, scale, attrs, zp, want = _cases()["uint4 zero point 8"]
    model = _graph(codes, scale, attrs, zp, reader="mm")
    assert fast_dequant.rewrite(model, {"q"}) == 1
    ops = [n.op_type for n in model.graph.node]
    assert "MatMulNBits" in ops and "DequantizeLinear" not in ops and "FusedMatMul" not in ops
    x = RNG.standard_normal((5, K)).astype(np.float32)
    y = _run(model, x)
    ref = x.astype(np.float64) @ want.astype(np.float64).T
    assert np.abs(y - ref).max() <= 1e-5 * np.abs(ref).max()


def test_a_backward_matmul_of_uint4_codes_is_split_into_even_and_odd_columns():
    """dY W as dY W[:, 0::2] and dY W[:, 1::2] from the low and high nibbles, interleaved: no float32 copy of the
    whole weight, the high half's dequantization waiting for the low half's product."""
    codes, scale, attrs, zp, want = _cases()["uint4 zero point 8"]
    model = _graph(codes, scale, attrs, zp, reader="dx")
    assert fast_dequant.rewrite(model, {"q"}) == 1
    g = model.graph
    assert sum(n.op_type == "MatMul" for n in g.node) == 2 and "Concat" in {n.op_type for n in g.node}
    produced = {o: n for n in g.node for o in n.output}
    hi_gate = next(n for n in g.node if n.name.endswith("hi/gate/gate_shape"))
    assert produced[hi_gate.input[0]].op_type == "MatMul"          # waits for the low half's product
    dy = RNG.standard_normal((2, 3, N)).astype(np.float32)
    y = _run(model, dy)
    ref = dy.astype(np.float64) @ want.astype(np.float64)
    assert y.shape == ref.shape and np.abs(y - ref).max() <= 1e-5 * np.abs(ref).max()


def test_codes_read_otherwise_are_left_alone():
    """Codes read by anything but gated DequantizeLinear nodes (here an ungated one, a constant) stay as they are."""
    codes, scale, attrs, zp, _ = _cases()["uint4 zero point 8"]
    model = _graph(codes, scale, attrs, zp, reader="")
    model.graph.node[-1].input[1] = "s"                       # the scales straight from the initializer
    assert fast_dequant.rewrite(model, {"q"}) == 0
    assert next(i for i in model.graph.initializer if i.name == "q").data_type == TensorProto.UINT4


@pytest.mark.parametrize("zero_scale", [False, True])
def test_int4_offsets_fold_into_matmulnbits_zero_points(zero_scale):
    """int4's offset term y += blocksum(X) (O + 8 S)^T (quantize._add_offset_term) becomes MatMulNBits' float zero
    points -O / S, for every reader of the weight: weight A read by m1(x1) and m3(x2), B by m2(x2). A weight with a
    zero scale (a GGUF Q4_K sub-block can have one: its values are its offset alone) keeps the offset term. Either
    way ORT's outputs equal numpy's x @ W on weights dequantized here (W^T = C S + O per block)."""
    from artifacts_gen import quantize
    from tests.bundle_helpers import offset_term_model, offset_weight_here, run_offset_term_model

    model = offset_term_model(1)
    if zero_scale:
        init = next(i for i in model.graph.initializer if i.name == "A" + quantize.SCALE)
        s = numpy_helper.to_array(init).copy()
        s.flat[3] = 0
        init.CopyFrom(numpy_helper.from_array(s, init.name))
    w = {x: offset_weight_here(model, x) for x in "AB"}         # before the rewrite retypes the codes
    assert fast_dequant.rewrite(model, {"A" + quantize.CODES, "B" + quantize.CODES}) == 2
    model.ir_version = 10
    onnx.checker.check_model(model)
    mnb = {n.input[1][0]: n for n in model.graph.node if n.op_type == "MatMulNBits"}
    assert {c: len(n.input) == 4 for c, n in mnb.items()} == {"A": not zero_scale, "B": True}
    offset_terms = [n for n in model.graph.node if n.input and n.input[0].endswith("/sums")]
    assert bool(offset_terms) == zero_scale              # the block sums survive only for the unfolded weight
    for y, want in zip(*run_offset_term_model(model, w, 1)):
        np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
