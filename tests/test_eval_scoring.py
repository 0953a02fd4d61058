"""eval.scoring + eval.torch_scorer against independent numpy / PyTorch computations."""
from __future__ import annotations

import csv
import math

import numpy as np
import pytest
import torch

from eval.scoring import (
    MMLUResult,
    PerplexityResult,
    Scorer,
    format_subject,
    mmlu_eval,
    mmlu_prompt,
    mmlu_subjects,
    perplexity,
    perplexity_by_position,
)
from eval.torch_scorer import TorchScorer
from tiny_models_eval import GPT2_TOKENIZER, VOCAB, gpt2_encoder, random_batch, tiny_gpt2


def log_softmax64(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def model_logits(model, ids: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
    """Logits straight from the model (no scorer), [B, S, V] float32."""
    ids_t = torch.as_tensor(np.atleast_2d(ids), dtype=torch.long)
    mask_t = torch.ones_like(ids_t) if mask is None else torch.as_tensor(np.atleast_2d(mask), dtype=torch.long)
    with torch.no_grad():
        return model(input_ids=ids_t, attention_mask=mask_t).logits.numpy()


@pytest.fixture(scope="module")
def model():
    return tiny_gpt2(seed=0)


@pytest.fixture(scope="module")
def scorer(model):
    return TorchScorer(model)


# ---------------------------------------------------------------------------------------------
# TorchScorer
# ---------------------------------------------------------------------------------------------
def test_scorer_is_a_scorer(scorer):
    assert isinstance(scorer, Scorer)


def test_nll_matches_numpy(model, scorer):
    rng = np.random.default_rng(1)
    b = random_batch(rng, [20, 13, 7], width=20)
    b["labels"][1, 1] = -100
    nll, count = scorer.nll(b["input_ids"], b["attention_mask"], b["labels"])

    logp = log_softmax64(model_logits(model, b["input_ids"], b["attention_mask"]))
    want, want_n = 0.0, 0
    for i in range(3):
        for t in range(19):
            y = b["labels"][i, t + 1]
            if y != -100:
                want -= logp[i, t, y]
                want_n += 1
    assert count == want_n
    assert want_n > 10
    assert nll == pytest.approx(want, rel=1e-5)
    # The nll is the sum, not the mean: far above log(V) per token.
    assert nll > 0.5 * want_n


def test_nll_is_padding_invariant(scorer):
    rng = np.random.default_rng(2)
    b = random_batch(rng, [9], width=9)
    s1, c1 = scorer.nll(b["input_ids"], b["attention_mask"], b["labels"])
    p = random_batch(rng, [9], width=15)
    p["input_ids"][:, :9] = b["input_ids"]
    p["labels"][:, :9] = b["labels"]
    p["input_ids"][:, 9:] = 5   # garbage under mask 0
    s2, c2 = scorer.nll(p["input_ids"], p["attention_mask"], p["labels"])
    assert c1 == c2
    assert s1 == pytest.approx(s2, rel=1e-5)


def test_nll_row_chunking_matches(model):
    rng = np.random.default_rng(3)
    b = random_batch(rng, [12, 10, 8, 12], width=12)
    full = TorchScorer(model).nll(b["input_ids"], b["attention_mask"], b["labels"])
    chunked = TorchScorer(model, max_logit_elements=1).nll(b["input_ids"], b["attention_mask"], b["labels"])
    assert full[1] == chunked[1]
    assert full[0] == pytest.approx(chunked[0], rel=1e-5)


def test_last_logits(model, scorer):
    rng = np.random.default_rng(4)
    b = random_batch(rng, [11, 4, 11, 7], width=11)
    got = scorer.last_logits(b["input_ids"], b["attention_mask"])
    assert got.shape == (4, VOCAB)
    for i, n in enumerate([11, 4, 11, 7]):
        want = model_logits(model, b["input_ids"][i, :n])[0, -1]
        np.testing.assert_allclose(got[i], want, rtol=1e-4, atol=1e-4)
    # The full-logits fallback agrees.
    fallback = TorchScorer(model)
    fallback._keep_supported = False
    np.testing.assert_allclose(fallback.last_logits(b["input_ids"], b["attention_mask"]), got, rtol=1e-5, atol=1e-5)


def test_scorer_restores_training_mode(model):
    model.train()
    try:
        TorchScorer(model).nll(np.ones((1, 4), np.int64), np.ones((1, 4), np.int64), np.ones((1, 4), np.int64))
        assert model.training and all(m.training for m in model.modules())
    finally:
        model.eval()


# ---------------------------------------------------------------------------------------------
# Perplexity
# ---------------------------------------------------------------------------------------------
def brute_force_ppl(model, ids: np.ndarray, seq_len: int, stride: int):
    """HF perplexity guide's loop, each window scored alone, NLL summed by hand in float64."""
    n = len(ids)
    nll, tokens, windows = 0.0, 0, 0
    prev_end = 0
    for begin in range(0, n, stride):
        end = min(begin + seq_len, n)
        trg_len = end - prev_end
        window = ids[begin:end]
        labels = window.copy()
        labels[:-trg_len] = -100
        logp = log_softmax64(model_logits(model, window))[0]
        for t in range(len(window) - 1):
            if labels[t + 1] != -100:
                nll -= logp[t, labels[t + 1]]
                tokens += 1
        windows += 1
        prev_end = end
        if end == n:
            break
    return nll, tokens, windows


@pytest.mark.parametrize("seq_len,stride", [(32, 8), (32, 32), (48, 17), (64, 64)])
def test_perplexity_matches_brute_force(model, scorer, seq_len, stride):
    ids = np.random.default_rng(5).integers(0, VOCAB, 203).astype(np.int64)
    calls = []
    res = perplexity(scorer, ids, seq_len, stride, progress=lambda d, t: calls.append((d, t)), batch_size=3)
    nll, tokens, windows = brute_force_ppl(model, ids, seq_len, stride)
    assert isinstance(res, PerplexityResult)
    assert (res.tokens, res.windows, res.seq_len, res.stride) == (tokens, windows, seq_len, stride)
    assert res.nll_sum == pytest.approx(nll, rel=1e-5)
    assert res.ppl == pytest.approx(math.exp(nll / tokens), rel=1e-5)
    # Scored-token bookkeeping in closed form: overlapping windows score every token but the
    # first; disjoint windows (stride == seq_len) lose each window's first token to the shift.
    assert tokens == (len(ids) - windows if stride == seq_len else len(ids) - 1)
    assert calls[-1] == (windows, windows)


def test_perplexity_batching_does_not_matter(scorer):
    ids = np.random.default_rng(6).integers(0, VOCAB, 150).astype(np.int64)
    a = perplexity(scorer, ids, 40, 10, batch_size=1)
    b = perplexity(scorer, ids, 40, 10, batch_size=8)
    assert (a.tokens, a.windows) == (b.tokens, b.windows)
    assert a.nll_sum == pytest.approx(b.nll_sum, rel=1e-5)


def test_perplexity_with_bos_per_window(model, scorer):
    """prefix=[BOS]: disjoint chunks of 31 text tokens, each scored after a BOS, by hand."""
    bos = 1
    ids = np.random.default_rng(8).integers(2, VOCAB, 100).astype(np.int64)
    res = perplexity(scorer, ids, 32, 31, batch_size=3, prefix=[bos])
    nll, tokens = 0.0, 0
    for begin in range(0, len(ids), 31):
        chunk = ids[begin:begin + 31]
        logp = log_softmax64(model_logits(model, np.concatenate([[bos], chunk])))[0]
        nll -= sum(logp[t, chunk[t]] for t in range(len(chunk)))    # position t predicts chunk[t]
        tokens += len(chunk)
    assert (res.tokens, res.windows, res.seq_len) == (len(ids), 4, 32) and tokens == len(ids)
    assert res.nll_sum == pytest.approx(nll, rel=1e-5)
    with pytest.raises(ValueError):           # stride above the 31 text tokens a window holds
        perplexity(scorer, ids, 32, 32, prefix=[bos])


def test_perplexity_by_position_with_bos(model, scorer):
    """Each position range scored by hand; together the ranges are the whole BOS-window perplexity."""
    bos = 1
    ids = np.random.default_rng(9).integers(2, VOCAB, 100).astype(np.int64)
    ranges = [(1, 5), (5, 20), (20, 32)]
    got = perplexity_by_position(scorer, ids, 32, [bos], ranges, batch_size=3)
    assert list(got) == ["1-4", "5-19", "20-31"]
    whole_nll = 0.0
    for lo, hi in ranges:
        nll, tokens = 0.0, 0
        for begin in range(0, len(ids), 31):
            chunk = ids[begin:begin + 31]
            logp = log_softmax64(model_logits(model, np.concatenate([[bos], chunk])))[0]
            for t in range(len(chunk)):            # chunk[t] sits at window position t + 1
                if lo <= t + 1 < hi:
                    nll -= logp[t, chunk[t]]
                    tokens += 1
        res = got[f"{lo}-{hi - 1}"]
        assert res.tokens == tokens and res.nll_sum == pytest.approx(nll, rel=1e-5)
        whole_nll += res.nll_sum
    whole = perplexity(scorer, ids, 32, 31, batch_size=3, prefix=[bos])
    assert sum(r.tokens for r in got.values()) == whole.tokens
    assert whole_nll == pytest.approx(whole.nll_sum, rel=1e-6)


def test_perplexity_rejects_bad_stride(scorer):
    with pytest.raises(ValueError):
        perplexity(scorer, np.arange(50), 16, 17)
    with pytest.raises(ValueError):
        perplexity(scorer, np.arange(50), 16, 0)


# ---------------------------------------------------------------------------------------------
# MMLU
# ---------------------------------------------------------------------------------------------
FIXTURE = {
    "fixture_one": {
        "dev": [
            ["What is 2+3?", "4", "5", "6", "7", "B"],
            ["What is 1+1?", "2", "3", "4", "5", "A"],
            ["Which is even?", "3", "5", "7", "8", "D"],
        ],
        "val": [
            ["What is 3+3?", "5", "6", "7", "8", "B"],
            ["Pick the vowel.", "b", "c", "e", "d", "C"],
            ["Largest number?", "1", "9", "3", "2", "B"],
        ],
    },
    "fixture_two_b": {
        "dev": [
            ["Color of the sky?", "blue", "red", "green", "black", "A"],
            ["Opposite of hot?", "warm", "cold", "big", "tall", "B"],
            ["Says \"meow\", with a comma", "dog", "cow", "cat", "hen", "C"],
        ],
        "val": [
            ["Water freezes at?", "0 C", "50 C", "100 C", "20 C", "A"],
            ["Opposite of up?", "left", "right", "in", "down", "D"],
            ["A baby cat is a?", "puppy", "kitten", "calf", "foal", "B"],
        ],
    },
}


def write_mmlu(root, data):
    for subject, splits in data.items():
        for split, rows in splits.items():
            d = root / split
            d.mkdir(parents=True, exist_ok=True)
            with (d / f"{subject}_{split}.csv").open("w", newline="") as f:
                csv.writer(f).writerows(rows)
    return root


@pytest.fixture()
def mmlu_dir(tmp_path):
    return write_mmlu(tmp_path / "mmlu", FIXTURE)


@pytest.fixture(scope="module")
def encode():
    if not GPT2_TOKENIZER.is_file():
        pytest.skip(f"GPT-2 tokenizer not found at {GPT2_TOKENIZER}")
    return gpt2_encoder()


@pytest.fixture(scope="module")
def mmlu_model():
    return tiny_gpt2(seed=7, n_positions=256)


def test_format_and_prompt():
    assert format_subject("high_school_biology") == "high school biology"
    shots = FIXTURE["fixture_one"]["dev"][:2]
    q = FIXTURE["fixture_one"]["val"][0]
    assert mmlu_prompt("fixture_one", shots, q) == (
        "The following are multiple choice questions (with answers) about fixture one.\n\n"
        "What is 2+3?\nA. 4\nB. 5\nC. 6\nD. 7\nAnswer: B\n\n"
        "What is 1+1?\nA. 2\nB. 3\nC. 4\nD. 5\nAnswer: A\n\n"
        "What is 3+3?\nA. 5\nB. 6\nC. 7\nD. 8\nAnswer:"
    )


def test_subjects(mmlu_dir):
    assert mmlu_subjects(mmlu_dir) == ["fixture_one", "fixture_two_b"]


def test_real_mmlu_layout(shared_data):
    subjects = mmlu_subjects(shared_data / "mmlu" / "data")
    assert len(subjects) == 57 and "high_school_biology" in subjects


@pytest.mark.parametrize("shots", [0, 2])
def test_mmlu_predictions_match_independent_logits(mmlu_dir, mmlu_model, encode, shots):
    letter_ids = [encode(" " + x)[0] for x in "ABCD"]
    assert letter_ids == [317, 347, 327, 360]
    res = mmlu_eval(TorchScorer(mmlu_model), encode, mmlu_dir, ["fixture_one", "fixture_two_b"], split="val",
                    shots=shots, max_len=256, letter_ids=letter_ids, batch_size=4)
    assert isinstance(res, MMLUResult)
    assert res.n == 6 and res.shots == shots and res.shots_dropped == 0 and res.split == "val"
    assert len({p["prompt_tokens"] for p in res.predictions}) > 1   # unequal lengths were padded together
    for p in res.predictions:
        subject = p["subject"]
        row = FIXTURE[subject]["val"][p["index"]]
        header = f"The following are multiple choice questions (with answers) about {subject.replace('_', ' ')}.\n\n"
        text = header + "".join(
            f"{r[0]}\nA. {r[1]}\nB. {r[2]}\nC. {r[3]}\nD. {r[4]}\nAnswer: {r[5]}\n\n"
            for r in FIXTURE[subject]["dev"][:shots]
        ) + f"{row[0]}\nA. {row[1]}\nB. {row[2]}\nC. {row[3]}\nD. {row[4]}\nAnswer:"
        ids = np.array(encode(text))
        last = model_logits(mmlu_model, ids)[0, -1]
        assert p["prompt_tokens"] == len(ids)
        assert p["pred"] == "ABCD"[int(np.argmax(last[letter_ids]))]
        np.testing.assert_allclose(p["letter_logits"], last[letter_ids], rtol=1e-4, atol=1e-4)
        assert p["answer"] == row[5] and p["correct"] == (p["pred"] == row[5])
    # The letter logits depend on the prompt (non-degenerate model).
    assert np.ptp(np.array([p["letter_logits"] for p in res.predictions]), axis=0).max() > 1e-2


def test_mmlu_default_letter_ids(mmlu_dir, mmlu_model, encode):
    scorer = TorchScorer(mmlu_model)
    a = mmlu_eval(scorer, encode, mmlu_dir, None, shots=1, max_len=256)
    b = mmlu_eval(scorer, encode, mmlu_dir, None, shots=1, max_len=256, letter_ids=[317, 347, 327, 360])
    assert [p["pred"] for p in a.predictions] == [p["pred"] for p in b.predictions]


def test_mmlu_shot_dropping(mmlu_dir, mmlu_model, encode):
    scorer = TorchScorer(mmlu_model)
    subjects = ["fixture_one", "fixture_two_b"]
    lengths = {}
    for k in (0, 1, 2, 3):
        r = mmlu_eval(scorer, encode, mmlu_dir, subjects, shots=k, max_len=256)
        lengths[k] = [p["prompt_tokens"] for p in r.predictions]
    # Pick a max_len that fits every 1-shot prompt but no 2-shot prompt.
    max_len = max(lengths[1])
    assert max_len < min(lengths[2])
    res = mmlu_eval(scorer, encode, mmlu_dir, subjects, shots=3, max_len=max_len)
    assert [p["shots"] for p in res.predictions] == [1] * 6
    assert res.shots == 3 and res.shots_dropped == 6 * 2 and res.truncated == 0
    assert [p["prompt_tokens"] for p in res.predictions] == lengths[1]
    # Too small even for 0-shot: left-truncated and recorded.
    tiny = min(lengths[0]) - 1
    res = mmlu_eval(scorer, encode, mmlu_dir, subjects, shots=2, max_len=tiny)
    assert res.truncated == 6 and res.shots_dropped == 12
    assert all(p["truncated"] and p["prompt_tokens"] == tiny and p["shots"] == 0 for p in res.predictions)
    row = FIXTURE["fixture_one"]["val"][0]
    text = mmlu_prompt("fixture_one", [], row)
    ids = np.array(encode(text))[-tiny:]
    want = "ABCD"[int(np.argmax(model_logits(mmlu_model, ids)[0, -1][[317, 347, 327, 360]]))]
    assert res.predictions[0]["pred"] == want


class AlwaysA:
    """A fake Scorer that always prefers " A"."""

    def nll(self, input_ids, attention_mask, labels):
        raise NotImplementedError

    def last_logits(self, input_ids, attention_mask):
        out = np.zeros((input_ids.shape[0], VOCAB), dtype=np.float32)
        out[:, 317] = 1.0
        return out


def test_micro_macro(tmp_path, encode):
    q = ["q?", "a", "b", "c", "d"]
    data = {
        "s_one": {"dev": [q + ["A"]], "val": [q + ["A"], q + ["A"], q + ["A"], q + ["B"]]},   # 3/4
        "s_two": {"dev": [q + ["A"]], "val": [q + ["B"], q + ["A"]]},                       # 1/2
    }
    root = write_mmlu(tmp_path / "mm", data)
    res = mmlu_eval(AlwaysA(), encode, root, ["s_one", "s_two"], shots=1, max_len=100, letter_ids=[317, 347, 327, 360])
    assert res.n == 6
    assert res.per_subject["s_one"] == {"acc": 0.75, "n": 4, "correct": 3}
    assert res.per_subject["s_two"] == {"acc": 0.5, "n": 2, "correct": 1}
    assert res.micro == pytest.approx(4 / 6)
    assert res.macro == pytest.approx((0.75 + 0.5) / 2)
    lim = mmlu_eval(AlwaysA(), encode, root, ["s_one", "s_two"], shots=0, max_len=100,
                    letter_ids=[317, 347, 327, 360], limit_per_subject=1)
    assert lim.n == 2 and lim.micro == 0.5 and lim.macro == 0.5
