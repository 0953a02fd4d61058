"""`gen --quant keep` (issue 29): a GGUF source's quantized blocks kept exactly, checked against gguf-py.

1. Every quantized tensor of the real Gemma3-270M GGUF (Q8_0, Q5_0, Q6_K, Q4_K), decoded into codes x scale
   (+ offset), equals gguf-py's `dequantize` bit for bit.
2. A small Gemma3 whose weights are gguf-py's dequantization of random blocks of each format (dimensions of 256,
   as the K-quants need) is built with keep: the bundle stores the blocks' codes (uint4 for Q4_K, int8 otherwise),
   and its loss, logits, gradients and 10 AdamW steps match PEFT on those weights; its decoder multiplies by every
   format's codes with MatMulNBits (artifacts_gen/nbits) and generates what transformers generates.
"""
from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

from artifacts_gen import gguf_exact, quantize
from ort_trainer import manifest as mf
from ort_trainer.bundle import open_bundle
from tests.bundle_helpers import is_vocab, peft_reference
from tests.test_artifacts_gen import assert_eval_matches_peft, assert_lora_grads_match_autograd, ten_adamw_steps

FORMATS_OF = {  # the small model's weights -> the block format they are made of
    "self_attn.q_proj": "Q5_0", "self_attn.k_proj": "Q8_0", "self_attn.v_proj": "Q6_K", "self_attn.o_proj": "Q4_K",
    "mlp.gate_proj": "Q5_0", "mlp.up_proj": "Q4_K", "mlp.down_proj": "Q6_K"}


@pytest.mark.slow        # the real model's 127 quantized tensors (~30 s); the 256-wide mixed-block model runs always
def test_every_block_of_the_real_gguf_decodes_exactly():
    import gguf

    from artifacts_gen.source import EMBEDDED_DEFAULT, resolve_embedded

    directory, name = resolve_embedded(EMBEDDED_DEFAULT)
    exact = gguf_exact.read_exact(directory / name)
    seen = set()
    for t in gguf.GGUFReader(str(directory / name)).tensors:
        key = gguf_exact.hf_name(t.name)
        if key not in exact:
            continue
        want = gguf.quants.dequantize(t.data, t.tensor_type)
        got = exact[key].dequantize()
        assert got.dtype == np.float32 and np.array_equal(got.view(np.uint32), want.view(np.uint32)), t.name
        seen.add(t.tensor_type.name)
    assert seen == set(gguf_exact.FORMATS)
    assert len(exact) == 127          # 18 layers x 7 linear weights + the token embedding


def random_blocks(fmt: str, rows: int, cols: int, rng) -> np.ndarray:
    """Valid GGUF bytes of `fmt` for a [rows, cols] tensor: random codes and scales, sane f16 multipliers."""
    import gguf

    qt = gguf.GGMLQuantizationType[fmt]
    block, size = gguf.GGML_QUANT_SIZES[qt]
    b = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    f16 = {"Q8_0": [0], "Q5_0": [0], "Q6_K": [208], "Q4_K": [0, 2]}[fmt]
    for at in f16:
        b[:, at:at + 2] = rng.uniform(0.002, 0.01, (b.shape[0], 1)).astype(np.float16).view(np.uint8)
    return b.reshape(rows, -1)


@pytest.fixture(scope="module")
def kept(tmp_path_factory):
    """A small Gemma3 made of GGUF blocks, built with --quant keep (the GGUF reading stubbed: the blocks are
    handed to the build as gguf_exact.read_exact would hand them)."""
    import gguf
    from transformers import AutoTokenizer, Gemma3ForCausalLM, Gemma3TextConfig

    from artifacts_gen import build, source
    from artifacts_gen.build import build_bundle
    from artifacts_gen.export import LoraSettings
    from tests.tiny_models import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("keep")
    tok_dir = make_tiny_checkpoint("gemma3", root / "tiny")              # for its tokenizer files
    cfg = Gemma3TextConfig(num_hidden_layers=2, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                           num_key_value_heads=1, head_dim=64, query_pre_attn_scalar=64, vocab_size=50257,
                           max_position_embeddings=256, sliding_window=32, layer_types=["sliding_attention",
                           "full_attention"])
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(cfg).eval()
    rng = np.random.default_rng(0)
    blocks = {}
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, p in params.items():
            fmt = next((f for k, f in FORMATS_OF.items() if f".{k}." in name), "Q8_0" if "embed_tokens" in name else None)
            if fmt is None:
                continue
            rows, cols = p.shape
            raw = random_blocks(fmt, rows, cols, rng)
            p.copy_(torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[fmt]).reshape(rows, cols)))
            blocks[name] = gguf_exact.exact_blocks(fmt, raw, rows, cols)
    ckpt = root / "ckpt"
    model.save_pretrained(ckpt)
    AutoTokenizer.from_pretrained(tok_dir).save_pretrained(ckpt)

    real_load = source.load_source

    def as_gguf(*a, **k):
        src = real_load(*a, **k)
        src.gguf_file = "stub.gguf"
        return src
    mp = pytest.MonkeyPatch()
    mp.setattr(build, "load_source", as_gguf)
    mp.setattr(gguf_exact, "read_exact", lambda path: blocks)
    try:
        build_bundle(ckpt, root / "bundle", lora=LoraSettings(r=4, alpha=8.0, targets="attn"), seq_len=64,
                     shard_mb=64, log=lambda *_: None)         # no --quant: a GGUF source's default, keep
    finally:
        mp.undo()
    bundle = open_bundle(root / "bundle")
    ref = peft_reference(ckpt, bundle.manifest)
    return ckpt, bundle, ref, blocks


def test_keep_stores_the_blocks_as_they_are(kept):
    ckpt, bundle, ref, blocks = kept
    q = bundle.manifest.quant
    assert q.mode == "keep"
    by_key = {w.source_key: w for w in q.weights}
    assert set(by_key) == set(blocks)                    # every block-made weight, the embedding too
    g = onnx.load(str(bundle.file(mf.EVAL_MODEL))).graph
    inits = {i.name: i for i in g.initializer}
    for key, w in by_key.items():
        assert w.source_format == blocks[key].fmt and w.onnx_name not in inits
        # Q4_K's 4-bit codes: read as their bytes, uint8 (artifacts_gen/fast_dequant.py); the embedding's: as stored
        want = onnx.TensorProto.UINT8 if w.source_format == "Q4_K" else onnx.TensorProto.INT8
        assert inits[w.codes].data_type == want
        assert bool(w.offset) == (w.source_format == "Q4_K")
    ours = quantize.dequantized_weights(bundle.path, q)
    for key, b in blocks.items():            # the values the graphs compute are gguf-py's, bit for bit
        want = b.dequantize()
        assert np.array_equal(ours[key].view(np.uint32), want.view(np.uint32)), key


@pytest.mark.parametrize("seq", [20, 48])
def test_keep_eval_matches_peft(kept, seq):
    ckpt, bundle, ref, _ = kept
    assert_eval_matches_peft(bundle, ref, seq)


def test_keep_grads_and_adamw_steps_match_peft(kept):
    ckpt, bundle, ref, _ = kept
    assert_lora_grads_match_autograd(ckpt, bundle, ref)
    ort_final, torch32, _ = ten_adamw_steps(bundle, ref)
    for key, want in torch32.items():
        assert np.abs(ort_final[key] - want).max() <= 1e-5, key


def test_keep_needs_a_gguf_source(tmp_path):
    from artifacts_gen.build import build_bundle
    from tests.tiny_models import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint("qwen2", tmp_path / "ckpt")
    with pytest.raises(quantize.QuantError, match="not a GGUF file; keep holds a GGUF's own blocks"):
        build_bundle(ckpt, tmp_path / "bundle", quant="keep", log=lambda *_: None)
    assert not (tmp_path / "bundle").exists()


def test_keep_dequantizes_just_in_time_and_again_for_the_backward(kept):
    from artifacts_gen.recompute import backward_nodes, readers
    from tests.test_quantize import assert_dequantization_is_just_in_time

    ckpt, bundle, ref, _ = kept
    g = onnx.load(str(bundle.file(mf.TRAINING_MODEL)), load_external_data=False).graph
    assert_dequantization_is_just_in_time(g)
    read_by, bwd = readers(g), backward_nodes(g)
    linear = [w for w in bundle.manifest.quant.weights if not is_vocab(w)]
    assert {w.source_format for w in linear} == {"Q4_K", "Q5_0", "Q6_K", "Q8_0"}
    for w in linear:          # the forward's float32 copy (Q4_K: after its offset) is not kept for the backward
        assert not [j for j in read_by[w.onnx_name] if j in bwd], w.onnx_name


def test_keep_decoder_multiplies_by_every_format_and_matches_hf_generate(kept):
    """The decoder runs each Q8_0 / Q5_0 / Q6_K / Q4_K weight (and the Q8_0 head) as MatMulNBits over the bundle's
    codes, never dequantized, and its greedy tokens equal transformers + PEFT's on the weights gguf-py dequantizes.
    This model's random blocks give logits up to ~150 (real models: ~10-60), where float32 itself is ~1e-5 off, so
    every step's logits are held to float64 PyTorch within 1e-6 of the largest logit (measured 9e-7; float32
    PyTorch 2e-7) rather than to 1e-4 absolute (tests/test_decoder.py's tiny models: logits of a few units)."""
    import copy

    from ort_trainer.decoder import Decoder
    from tests.bundle_helpers import load_lora_into, random_lora, to_onnx_layout
    from tests.test_decoder import hf_generate, ours

    ckpt, bundle, _, _ = kept
    dec = onnx.load(str(bundle.file(mf.DECODER_MODEL)), load_external_data=False).graph
    produced = {o: n for n in dec.node for o in n.output}
    dqs = [n for n in dec.node if n.op_type == "DequantizeLinear"]
    assert all(getattr(produced.get(n.input[0]), "op_type", "") == "Gather" for n in dqs)   # embedding rows only
    linear = [w for w in bundle.manifest.quant.weights if w.source_key != "model.embed_tokens.weight"]
    assert sum(n.op_type == "MatMulNBits" for n in dec.node) == len(linear) + 1                  # + the LM head
    ref = peft_reference(ckpt, bundle.manifest)
    lora = random_lora(bundle.manifest, seed=5)
    load_lora_into(ref, lora)
    decoder = Decoder(bundle)
    decoder.use_adapter(to_onnx_layout(bundle.manifest, lora))
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, bundle.manifest.model.vocab_size, n).tolist() for n in (12, 5)]    # crosses the window
    tokens, steps = ours(decoder, prompts, 40)
    hf_tokens, _ = hf_generate(ref, prompts, 40)
    f64_tokens, f64_steps = hf_generate(copy.deepcopy(ref).double(), prompts, 40)
    assert tokens == hf_tokens == f64_tokens
    scale = max(float(np.abs(x).max()) for x in f64_steps)
    worst = max(float(np.abs(a - b).max()) for a, b in zip(steps, f64_steps))
    assert worst <= 1e-6 * scale, (worst, scale)
