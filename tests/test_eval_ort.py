"""eval.ort_scorer (ORT eval graph) against PyTorch/PEFT and against a hand-made perplexity loop.

Everything is compared with independent computations: a PEFT model built straight from the tiny
checkpoint (tests.bundle_helpers.peft_reference), HF's tokenizer, and numpy log-softmax.
"""
from __future__ import annotations

import csv
import json
import math

import numpy as np
import pytest
import torch

from eval.inputs import letter_ids, prompt_encoder, text_token_ids
from eval.scoring import Scorer, mmlu_eval, mmlu_prompt, perplexity
from eval.ort_scorer import OrtScorer
from ort_trainer.adapter import initial_lora, lora_from_peft
from eval.torch_scorer import TorchScorer
from ort_trainer.bundle import open_bundle
from ort_trainer.tokenizer import TextTokenizer
from tests.bundle_helpers import build_tiny_bundle, load_lora_into, peft_reference, random_lora, to_onnx_layout
from tests.tiny_models import FAMILIES

SEQ, STRIDE, MAX_TOKENS = 40, 24, 150     # neither 40 nor the window tails are the traced length (32)


@pytest.fixture(scope="module", params=FAMILIES)
def fam(request, tmp_path_factory, shared_data):
    family = request.param
    root = tmp_path_factory.mktemp(f"evalort-{family}")
    ckpt, path = build_tiny_bundle(family, root)
    bundle = open_bundle(path)
    man = bundle.manifest
    lora = random_lora(man, seed=11)                 # PEFT keys, PEFT layout, non-zero B
    ref = peft_reference(ckpt, man)
    load_lora_into(ref, lora)
    text = root / "text.txt"
    text.write_text("".join((shared_data / "wikitext2" / "valid.txt").read_text().splitlines(keepends=True)[400:440]))
    return {"family": family, "ckpt": ckpt, "bundle": bundle, "lora": lora, "ref": ref, "root": root,
            "text": text, "ort": OrtScorer(bundle, to_onnx_layout(man, lora))}


def hf_tokenizer(bundle):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(bundle.tokenizer_dir, local_files_only=True)


def log_softmax64(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def hand_perplexity(model, ids: np.ndarray, seq_len: int, stride: int) -> tuple[float, int]:
    """HF perplexity guide, by hand: window [begin, end), score the last end - prev_end tokens."""
    nll, count, prev_end = 0.0, 0, 0
    for begin in range(0, len(ids), stride):
        end = min(begin + seq_len, len(ids))
        trg = end - prev_end
        window = torch.from_numpy(ids[begin:end][None])
        with torch.no_grad():
            logp = log_softmax64(model(input_ids=window).logits[0].numpy())
        w = ids[begin:end]
        for t in range(len(w) - trg, len(w)):
            if t == 0:
                continue                       # the first token of the file has no prediction
            nll -= logp[t - 1, w[t]]
            count += 1
        prev_end = end
        if end == len(ids):
            break
    return math.exp(nll / count), count


def test_text_tokens_match_hf_tokenizer(fam):
    bundle = fam["bundle"]
    tok = hf_tokenizer(bundle)
    text = fam["text"].read_text()
    want = tok(text, add_special_tokens=False)["input_ids"]
    bos = tok("a", add_special_tokens=True)["input_ids"][:-len(tok("a", add_special_tokens=False)["input_ids"])]
    got = text_token_ids(fam["text"], TextTokenizer.from_dir(bundle.tokenizer_dir))
    assert got.tolist() == list(bos) + list(want)


def test_ort_perplexity_equals_pytorch_and_hand_computed(fam):
    ids = text_token_ids(fam["text"], TextTokenizer.from_dir(fam["bundle"].tokenizer_dir), MAX_TOKENS)
    assert len(ids) == MAX_TOKENS
    assert isinstance(fam["ort"], Scorer)
    by_ort = perplexity(fam["ort"], ids, SEQ, STRIDE, batch_size=4)
    by_torch = perplexity(TorchScorer(fam["ref"]), ids, SEQ, STRIDE, batch_size=3)
    by_hand, count = hand_perplexity(fam["ref"], ids, SEQ, STRIDE)
    assert by_ort.tokens == by_torch.tokens == count == MAX_TOKENS - 1
    assert by_ort.windows == by_torch.windows and by_ort.windows > 2
    assert abs(by_ort.ppl - by_torch.ppl) / by_torch.ppl <= 1e-4
    assert abs(by_ort.ppl - by_hand) / by_hand <= 1e-4
    assert abs(by_torch.ppl - by_hand) / by_hand <= 1e-4


def test_initial_lora_is_the_base_model(fam):
    """lora=None (the bundle checkpoint, PEFT init B = 0) scores exactly like the plain base model."""
    from transformers import AutoModelForCausalLM

    man = fam["bundle"].manifest
    init = initial_lora(fam["bundle"])
    for t in man.trainable:
        if "lora_B" in t.peft_key:
            assert not init[t.onnx_name].any()
    base = AutoModelForCausalLM.from_pretrained(fam["ckpt"], dtype=torch.float32).eval()
    ids = np.random.default_rng(3).integers(0, man.model.vocab_size, 70)
    a = perplexity(OrtScorer(fam["bundle"]), ids, 30, 30)
    b, _ = hand_perplexity(base, ids, 30, 30)
    assert abs(a.ppl - b) / b <= 1e-4


def test_last_logits_of_padded_batch_match_pytorch(fam):
    man = fam["bundle"].manifest
    rng = np.random.default_rng(5)
    lengths = [17, 5, 33, 1]
    ids = np.zeros((4, 33), dtype=np.int64)
    mask = np.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, :n] = rng.integers(0, man.model.vocab_size, n)
        mask[i, :n] = 1
    got = fam["ort"].last_logits(ids, mask)
    assert got.shape == (4, man.model.vocab_size)
    for i, n in enumerate(lengths):                   # each row alone, no padding at all
        with torch.no_grad():
            want = fam["ref"](input_ids=torch.from_numpy(ids[i:i + 1, :n])).logits[0, -1].numpy()
        assert np.abs(got[i] - want).max() <= 1e-4


# ---------------------------------------------------------------------------------------------
# MMLU
# ---------------------------------------------------------------------------------------------
QUESTIONS = {
    "astronomy": [
        ["Which planet is closest to the Sun?", "Venus", "Mercury", "Mars", "Earth", "B"],
        ["What is the Sun mostly made of?", "Iron", "Helium", "Hydrogen", "Carbon", "C"],
        ["How many moons does Mars have?", "Two", "One", "None", "Four", "A"],
        ["What is a light year?", "A time", "A speed", "A mass", "A distance", "D"],
    ],
    "high_school_biology": [
        ["What carries oxygen in blood?", "Platelets", "Plasma", "Hemoglobin", "Insulin", "C"],
        ["Where is DNA stored in a cell?", "Nucleus", "Membrane", "Wall", "Vacuole", "A"],
        ["What do plants take in for photosynthesis?", "Oxygen", "Carbon dioxide", "Nitrogen", "Salt", "B"],
        ["Which organ pumps blood?", "Lung", "Liver", "Kidney", "Heart", "D"],
    ],
}


def write_mmlu(root):
    """2 subjects x 3 test questions + 1 dev question each (the first row of each list is the dev shot)."""
    for split in ("dev", "test"):
        (root / split).mkdir(parents=True, exist_ok=True)
    for subject, rows in QUESTIONS.items():
        for split, part in (("dev", rows[:1]), ("test", rows[1:])):
            with open(root / split / f"{subject}_{split}.csv", "w", newline="") as f:
                csv.writer(f).writerows(part)
    return root


def test_mmlu_letters_equal_pytorch_argmax(fam):
    bundle = fam["bundle"]
    data = write_mmlu(fam["root"] / "mmlu")
    tok = TextTokenizer.from_dir(bundle.tokenizer_dir)
    res = mmlu_eval(fam["ort"], prompt_encoder(tok), data, split="test", shots=1, max_len=255,
                    letter_ids=letter_ids(tok), batch_size=4)
    assert res.n == 6 and res.shots_dropped == 0 and res.truncated == 0

    hf = hf_tokenizer(bundle)
    letters = [hf(" " + x, add_special_tokens=False)["input_ids"] for x in "ABCD"]
    assert all(len(x) == 1 for x in letters)
    letters = [x[0] for x in letters]
    assert letter_ids(tok) == letters
    for p in res.predictions:
        rows = QUESTIONS[p["subject"]]
        prompt = mmlu_prompt(p["subject"], rows[:1], rows[1 + p["index"]])
        ids = hf(prompt, add_special_tokens=True)["input_ids"]
        if hf.eos_token_id is not None and ids[-1] == hf.eos_token_id and not prompt.endswith(hf.eos_token):
            ids = ids[:-1]                            # a post-processor EOS is not part of a prompt
        with torch.no_grad():
            logits = fam["ref"](input_ids=torch.tensor([ids])).logits[0, -1].numpy()
        want = logits[letters]
        assert p["prompt_tokens"] == len(ids)
        assert np.abs(np.asarray(p["letter_logits"]) - want).max() <= 1e-4
        top2 = np.sort(want)[-2:]
        if top2[1] - top2[0] > 1e-3:                 # a near-tie is not a meaningful comparison
            assert p["pred"] == "ABCD"[int(np.argmax(want))]
        assert p["correct"] == (p["pred"] == rows[1 + p["index"]][5])


# ---------------------------------------------------------------------------------------------
# The CLI (one family: the wiring is family-independent)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fam", ["gpt2"], indirect=True)     # the CLI's wiring is family-independent
def test_cli_ppl_and_mmlu_with_peft_dir_on_both_backends(fam, capsys):
    from ort_trainer.adapter import export_peft
    from pocketlora_cli import main

    bundle, root = fam["bundle"], fam["root"]
    peft_dir = export_peft(bundle.manifest, to_onnx_layout(bundle.manifest, fam["lora"]), root / "peft")
    assert all(np.array_equal(v, to_onnx_layout(bundle.manifest, fam["lora"])[k])
               for k, v in lora_from_peft(peft_dir, bundle.manifest).items())
    ids = text_token_ids(fam["text"], TextTokenizer.from_dir(bundle.tokenizer_dir), 120)
    want, _ = hand_perplexity(fam["ref"], ids, 48, 16)
    results = {}
    for backend in ("ort", "torch"):
        out = root / f"ppl-{backend}.json"
        assert main(["eval", "ppl", "--bundle", str(bundle.path), "--peft", str(peft_dir), "--data", str(fam["text"]),
                     "--seq-len", "48", "--stride", "16", "--max-tokens", "120", "--backend", backend,
                     "--out", str(out)]) == 0
        results[backend] = json.loads(out.read_text())
        assert results[backend]["tokens"] == 119 and results[backend]["seq_len"] == 48
        assert abs(results[backend]["ppl"] - want) / want <= 1e-4
    assert "perplexity" in capsys.readouterr().out

    data = write_mmlu(root / "mmlu-cli")
    accs = {}
    for backend in ("ort", "torch"):
        out = root / f"mmlu-{backend}.json"
        assert main(["eval", "mmlu", "--bundle", str(bundle.path), "--peft", str(peft_dir), "--data", str(data),
                     "--shots", "0", "--split", "test", "--backend", backend, "--out", str(out)]) == 0
        r = json.loads(out.read_text())
        assert r["n"] == 6 and set(r["per_subject"]) == set(QUESTIONS)
        accs[backend] = (r["micro"], r["macro"])
    assert accs["ort"] == accs["torch"]
    # a wrong adapter is a one-line user error (exit 2), not a traceback
    assert main(["eval", "ppl", "--bundle", str(bundle.path), "--peft", str(root), "--data", str(fam["text"])]) == 2


def test_bos_tokenizer_puts_bos_once_for_text_and_per_prompt(tmp_path, shared_data):
    """A tokenizer whose post-processor adds BOS (like Gemma's): once before the text, once per prompt."""
    from tokenizers import Tokenizer
    from tokenizers.processors import TemplateProcessing

    src = shared_data / "tokenizers" / "gpt2"
    tok = Tokenizer.from_file(str(src / "tokenizer.json"))
    bos = tok.token_to_id("<|endoftext|>")
    tok.post_processor = TemplateProcessing(single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", bos)])
    d = tmp_path / "tok"
    d.mkdir()
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"}))
    text = "".join((shared_data / "wikitext2" / "valid.txt").read_text().splitlines(keepends=True)[10:30])
    (tmp_path / "t.txt").write_text(text)

    plain = Tokenizer.from_file(str(src / "tokenizer.json"))
    tt = TextTokenizer.from_dir(d)
    assert text_token_ids(tmp_path / "t.txt", tt).tolist() == [bos] + plain.encode(text, add_special_tokens=False).ids
    assert text_token_ids(tmp_path / "t.txt", tt, max_tokens=7).tolist() == [bos] + plain.encode(text).ids[:6]
    prompt = mmlu_prompt("astronomy", [], QUESTIONS["astronomy"][1])
    assert prompt_encoder(tt)(prompt) == [bos] + plain.encode(prompt).ids
    assert letter_ids(tt) == [plain.encode(" " + x).ids[0] for x in "ABCD"]
