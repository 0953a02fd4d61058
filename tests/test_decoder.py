"""The bundle's KV-cache decoder (issue 30: artifacts_gen/decoder.py, ort_trainer/decoder.py, android_runner/chat.py)
against transformers' generate() with the PEFT-loaded adapter (which keeps its own cache; Gemma3's sliding layers
drop old entries there, where ours mask them), on the weights the bundle computes with."""
from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import onnx
import pytest
import torch

from ort_trainer import manifest as mf
from ort_trainer.adapter import export_peft, lora_from_peft
from ort_trainer.bundle import open_bundle
from ort_trainer.decoder import Decoder, generate
from ort_trainer.sampling import GREEDY, Sampling, pick
from tests.bundle_helpers import (
    build_tiny_bundle, is_vocab, load_lora_into, peft_reference, random_lora, to_onnx_layout,
    with_dequantized_base,
)

NEW = 64
CASES = [("gpt2", None), ("qwen2", None), ("gemma3", None), ("qwen2", "int8"), ("gemma3", "int4")]


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{c[0]}-{c[1] or 'fp32'}")
def built(request, tmp_path_factory):
    family, quant = request.param
    kw = {"quant": quant, "quant_block": 16} if quant else {}
    ckpt, path = build_tiny_bundle(family, tmp_path_factory.mktemp(f"dec-{family}-{quant}"), **kw)
    bundle = open_bundle(path)
    lora = random_lora(bundle.manifest, seed=7)            # PEFT layout; B non-zero so the adapter matters
    ref = with_dequantized_base(peft_reference(ckpt, bundle.manifest), bundle)
    load_lora_into(ref, lora)
    decoder = Decoder(bundle)
    decoder.use_adapter(to_onnx_layout(bundle.manifest, lora))
    return bundle, ref, lora, decoder


def hf_generate(model, prompts: list[list[int]], new: int, pad: int = 0):
    """Left-padded greedy generate() of exactly `new` tokens -> (new ids per row, per-step logits [B, V])."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, width - len(p):] = torch.tensor(p)
        mask[b, width - len(p):] = 1
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                             do_sample=False, return_dict_in_generate=True, output_logits=True, pad_token_id=pad,
                             eos_token_id=None)
    return out.sequences[:, width:].tolist(), [x.numpy() for x in out.logits]


def ours(decoder, prompts, new, sampling=GREEDY):
    steps = []
    out = generate(decoder, prompts, replace(sampling, max_new_tokens=new), set(), pad_id=0,
                   on_logits=lambda x: steps.append(x.copy()))
    return [g.token_ids for g in out], steps


def assert_same_as_hf(decoder, ref, prompts, new):
    tokens, steps = ours(decoder, prompts, new)
    hf_tokens, hf_steps = hf_generate(ref, prompts, new)
    assert len(steps) == len(hf_steps) == new
    worst = max(float(np.abs(a - b).max()) for a, b in zip(steps, hf_steps))
    assert worst <= 1e-4, worst
    assert tokens == hf_tokens


def test_greedy_64_tokens_and_every_step_match_hf_generate_with_the_peft_adapter(built):
    bundle, ref, _, decoder = built
    vocab = bundle.manifest.model.vocab_size
    rng = np.random.default_rng(0)
    assert_same_as_hf(decoder, ref, [rng.integers(0, vocab, 9).tolist()], NEW)                 # one row
    batch = [rng.integers(0, vocab, n).tolist() for n in (11, 3, 1, 6)]                         # left-padded rows
    assert_same_as_hf(decoder, ref, batch, NEW)


def test_a_one_token_prompt_and_a_prompt_filling_the_context(built):
    bundle, ref, _, decoder = built
    assert_same_as_hf(decoder, ref, [[17]], 8)
    full = np.random.default_rng(1).integers(0, bundle.manifest.model.vocab_size, decoder.max_positions - 1).tolist()
    assert_same_as_hf(decoder, ref, [full], 1)          # the last position the model has
    out = generate(decoder, [full], Sampling(max_new_tokens=50, temperature=0), set(), pad_id=0)
    assert len(out[0].token_ids) == 1 and out[0].stopped_by == "length"        # capped by the context


def test_adapters_switch_at_run_time_without_a_new_session(built, tmp_path):
    bundle, ref, lora, decoder = built
    prompt = [[5, 6, 7, 8]]
    with_adapter = ours(decoder, prompt, 4)[1]
    decoder.use_adapter(None)                                                  # the base model
    base = ours(decoder, prompt, 4)[1]
    with ref.disable_adapter():
        assert max(float(np.abs(a - b).max()) for a, b in zip(base, hf_generate(ref, prompt, 4)[1])) <= 1e-4
    assert np.abs(base[0] - with_adapter[0]).max() > 1e-3                      # the adapter did something
    # the same adapter through a PEFT directory (export --peft, then --peft)
    decoder.use_adapter(lora_from_peft(export_peft(bundle.manifest, to_onnx_layout(bundle.manifest, lora), tmp_path / "p"),
                                  bundle.manifest))
    again = ours(decoder, prompt, 4)[1]
    assert all(np.array_equal(a, b) for a, b in zip(again, with_adapter))


def test_the_decoder_reads_the_training_shards_and_stays_quantized(built):
    bundle, *_ = built
    dec = onnx.load(str(bundle.file(mf.DECODER_MODEL)), load_external_data=False)
    ev = onnx.load(str(bundle.file(mf.EVAL_MODEL)), load_external_data=False)
    where = lambda m: {i.name: tuple((e.key, e.value) for e in i.external_data)       # noqa: E731
                       for i in m.graph.initializer if i.data_location == onnx.TensorProto.EXTERNAL}
    d, e = where(dec), where(ev)
    assert d and set(d.values()) <= set(e.values())        # every external weight: bytes the eval graph reads
    renamed = [n for n in d if d[n] != e.get(n) and not n.endswith("/codes_u8")]   # uint4 codes read as bytes
    assert len(renamed) <= 4                                # nearly all under the same name (not: derived constants)
    inline = sum(len(i.raw_data) for i in dec.graph.initializer if i.data_location != onnx.TensorProto.EXTERNAL)
    assert inline < 2 ** 20                                 # the LoRA defaults, norms, shapes: no weight
    lora = {t.onnx_name for t in bundle.manifest.trainable}
    inputs = {i.name for i in dec.graph.input}
    assert lora <= inputs and not lora & {i.name for i in dec.graph.initializer}     # plain inputs (WASM feeds them)
    if bundle.manifest.quant.weights:         # every quantized matmul multiplies by the codes (artifacts_gen/nbits)
        produced = {o: n for n in dec.graph.node for o in n.output}
        dqs = [n for n in dec.graph.node if n.op_type == "DequantizeLinear"]
        gathered = [getattr(produced.get(n.input[0]), "op_type", "") == "Gather" for n in dqs]
        assert all(gathered)                                # only an embedding's gathered rows are dequantized
        linear = [w for w in bundle.manifest.quant.weights if not is_vocab(w)]
        assert sum(n.op_type == "MatMulNBits" for n in dec.graph.node) >= len(linear) + 1       # + the LM head
        assert not ({w.onnx_name for w in bundle.manifest.quant.weights} & {i.name for i in dec.graph.initializer})


def test_seeded_sampling_is_reproducible_and_sampling_filters_like_their_definitions(built):
    _, _, _, decoder = built
    s = Sampling(max_new_tokens=12, temperature=1.3, top_k=20, top_p=0.9, seed=5)
    a = generate(decoder, [[3, 4, 5], [9]], s, set(), pad_id=0)
    b = generate(decoder, [[3, 4, 5], [9]], s, set(), pad_id=0)
    c = generate(decoder, [[3, 4, 5], [9]], replace(s, seed=6), set(), pad_id=0)
    assert [g.token_ids for g in a] == [g.token_ids for g in b] != [g.token_ids for g in c]


def test_pick_draws_only_from_the_top_k_and_top_p_sets():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((2, 50)).astype(np.float32)
    order = np.argsort(-logits, axis=1)
    k_draws = {(b, int(t)) for _ in range(300) for b, t in enumerate(pick(logits, Sampling(top_k=3, top_p=1), rng))}
    assert k_draws == {(b, int(t)) for b in range(2) for t in order[b, :3]}            # all 3, nothing else
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    need = [int(np.searchsorted(np.cumsum(p[b, order[b]]), 0.5) + 1) for b in range(2)]    # smallest set >= 0.5
    p_draws = {(b, int(t)) for _ in range(300)
               for b, t in enumerate(pick(logits, Sampling(temperature=1, top_k=0, top_p=0.5), rng))}
    assert p_draws == {(b, int(t)) for b in range(2) for t in order[b, :need[b]]}
    assert (pick(logits, GREEDY, rng) == logits.argmax(1)).all()


def test_stop_strings_cut_the_text_and_streaming_gives_the_same_text(built):
    _, _, _, decoder = built
    vocab_text = lambda ids: "".join(f"<{i % 7}>" for i in ids)                # a stand-in detokenizer
    full = generate(decoder, [[1, 2, 3]], Sampling(max_new_tokens=20, temperature=0), set(), 0, decode=vocab_text)[0]
    stop = full.text[12:15]                                                    # a piece of the 4th token on
    pieces = []
    cut = generate(decoder, [[1, 2, 3]], Sampling(max_new_tokens=20, temperature=0), set(), 0, decode=vocab_text,
                   stop_strings=(stop,), on_text=lambda _b, p: pieces.append(p))[0]
    assert cut.stopped_by == "stop string" and cut.text == full.text[:full.text.find(stop)]
    assert "".join(pieces) == cut.text and stop not in "".join(pieces)


def test_bad_input_is_one_line_and_exit_2(built, tmp_path, capsys):
    from pocketlora_cli import main

    bundle, *_ = built
    other_ckpt, other = build_tiny_bundle(bundle.manifest.family, tmp_path / "r2", r=2)      # another LoRA rank
    peft = export_peft(open_bundle(other).manifest,
                       to_onnx_layout(open_bundle(other).manifest, random_lora(open_bundle(other).manifest, 0)),
                       tmp_path / "peft-r2")
    cases = {
        "not a training run": ["--run", str(tmp_path / "nope"), "--prompt", "hi"],
        "does not fit this bundle: r=2": ["--bundle", str(bundle.path), "--peft", str(peft), "--prompt", "hi"],
        "empty prompt": ["--bundle", str(bundle.path), "--prompt", "  "],
        "Shorten the prompt": ["--bundle", str(bundle.path), "--raw", "--prompt", "word " * 400],
        "--top-p": ["--bundle", str(bundle.path), "--prompt", "hi", "--top-p", "0"],
    }
    for expect, argv in cases.items():
        assert main(["generate", *argv]) == 2, expect
        err = capsys.readouterr().err
        assert expect in err and err.count("\n") == 1 and "Traceback" not in err, err


def test_generate_json_from_a_prompts_file(built, tmp_path, capsys):
    from pocketlora_cli import main

    bundle, ref, lora, _ = built
    peft = export_peft(bundle.manifest, to_onnx_layout(bundle.manifest, lora), tmp_path / "peft")
    (tmp_path / "p.txt").write_text("Hello there\n\nThe weather today\n")
    assert main(["generate", "--bundle", str(bundle.path), "--peft", str(peft), "--prompts-file",
                 str(tmp_path / "p.txt"), "--raw", "--greedy", "--max-new-tokens", "6", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(rows) == 2 and all(set(r) == {"token_ids", "text"} for r in rows)
    from ort_trainer.tokenizer import TextTokenizer

    tok = TextTokenizer.from_dir(bundle.tokenizer_dir)
    prompts = [tok.prefix_ids + tok.encode(t, add_special_tokens=False) for t in ("Hello there", "The weather today")]
    for r, p in zip(rows, prompts):                 # each row alone through HF (stops at eos like ours would)
        hf, _ = hf_generate(ref, [p], len(r["token_ids"]))
        assert r["token_ids"] == hf[0]
        assert r["text"] == tok.decode(r["token_ids"], skip_special_tokens=True)
