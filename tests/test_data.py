"""ort_trainer.tokenizer, records and batching against independent computations (HF transformers tokenizers, slow pure-Python
tokenizers, character-offset label masks, direct numpy loops)."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from ort_trainer.tokenizer import DataError, TextTokenizer, tokenize_text
from ort_trainer.records import Example, load_examples, loss_token_count
from ort_trainer.batching import collate, DataOrder

import transformers  # noqa: E402  (the `workstation` extra installs it: missing, the tests fail, never skip)

EOT = "<|endoftext|>"
ALPACA_HEAD = ("Below is an instruction that describes a task. Write a response that appropriately "
               "completes the request.\n\n")
SAMPLES = [
    "Hello world!",
    "  leading spaces and trailing   ",
    "Numbers 12345 and 3.14159, punctuation?! (yes) — dashes",
    "Unicode: 戦場のヴァルキュリア3 café naïve 🙂",
    "line one\nline two\n\n\ttabbed",
    f"special {EOT} inside",
    "<|im_start|>user\nhi<|im_end|>\n",
    "",
]


# ----------------------------------------------------------------------------------------------
# fixtures
# ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gpt2_src(shared_data):
    return shared_data / "tokenizers" / "gpt2"


@pytest.fixture(scope="module")
def qwen_src(shared_data):
    return shared_data / "tokenizers" / "qwen2.5"


@pytest.fixture(scope="module")
def hf_gpt2(gpt2_src):
    return transformers.AutoTokenizer.from_pretrained(str(gpt2_src))


@pytest.fixture(scope="module")
def hf_qwen(qwen_src):
    return transformers.AutoTokenizer.from_pretrained(str(qwen_src))


@pytest.fixture(scope="module")
def gpt2_dir(hf_gpt2, tmp_path_factory):
    d = tmp_path_factory.mktemp("gpt2_tok")
    hf_gpt2.save_pretrained(str(d))  # what the bundle builder does
    return d


@pytest.fixture(scope="module")
def qwen_dir(hf_qwen, tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen_tok")
    hf_qwen.save_pretrained(str(d))
    return d


@pytest.fixture(scope="module")
def gpt2(gpt2_dir):
    return TextTokenizer.from_dir(gpt2_dir)


@pytest.fixture(scope="module")
def qwen(qwen_dir):
    return TextTokenizer.from_dir(qwen_dir)


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return path


def runs(mask):
    """Contiguous [start, end) runs where mask is True."""
    out, start = [], None
    for i, m in enumerate(list(mask) + [False]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((start, i))
            start = None
    return out


# ----------------------------------------------------------------------------------------------
# tokenizer
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("which", ["gpt2", "qwen"])
def test_encode_decode_match_hf(which, request):
    ours = request.getfixturevalue(which)
    hf = request.getfixturevalue(f"hf_{which}")
    src = request.getfixturevalue(f"{which}_src")
    slow = transformers.AutoTokenizer.from_pretrained(str(src), use_fast=False)  # pure Python BPE
    assert not slow.is_fast
    for s in SAMPLES:
        for add in (True, False):
            ref = hf.encode(s, add_special_tokens=add)
            assert ours.encode(s, add_special_tokens=add) == ref, (s, add)
            assert slow.encode(s, add_special_tokens=add) == ref, (s, add)
        ids = hf.encode(s, add_special_tokens=False)
        assert ours.decode(ids) == hf.decode(ids)
        assert ours.decode(np.asarray(ids, dtype=np.int64)) == hf.decode(ids)
    assert ours.prefix_ids == [] and ours.suffix_ids == []  # neither GPT-2 nor Qwen adds BOS


def test_special_tokens_from_dir(gpt2, qwen, hf_gpt2, hf_qwen):
    assert (gpt2.bos_token, gpt2.eos_token, gpt2.pad_token) == (EOT, EOT, None)
    assert gpt2.eos_id == hf_gpt2.eos_token_id == 50256
    assert gpt2.pad_id == gpt2.eos_id  # no pad token: falls back to eos
    assert gpt2.chat_template is None and not gpt2.has_chat_template
    assert qwen.bos_token is None and qwen.bos_id is None
    assert (qwen.eos_token, qwen.eos_id) == (hf_qwen.eos_token, hf_qwen.eos_token_id) == ("<|im_end|>", 151645)
    assert (qwen.pad_token, qwen.pad_id) == (hf_qwen.pad_token, hf_qwen.pad_token_id) == (EOT, 151643)
    assert qwen.chat_template == hf_qwen.chat_template


def test_from_dir_config_variants(qwen_dir, tmp_path, hf_qwen):
    """Template inside tokenizer_config.json (no chat_template.jinja), tokens as AddedToken dicts,
    no pad token -> eos; no config at all -> pad 0."""
    d = tmp_path / "tok"
    d.mkdir()
    shutil.copy(qwen_dir / "tokenizer.json", d / "tokenizer.json")
    cfg = {"eos_token": {"__type": "AddedToken", "content": "<|im_end|>", "special": True},
           "bos_token": None, "chat_template": hf_qwen.chat_template}
    (d / "tokenizer_config.json").write_text(json.dumps(cfg), encoding="utf-8")
    t = TextTokenizer.from_dir(d)
    assert t.eos_token == "<|im_end|>" and t.eos_id == 151645
    assert t.pad_token is None and t.pad_id == 151645
    assert t.chat_template == hf_qwen.chat_template
    (d / "tokenizer_config.json").unlink()
    t = TextTokenizer.from_dir(d)
    assert t.eos_id is None and t.pad_id == 0 and t.chat_template is None
    with pytest.raises(DataError, match="tokenizer.json"):
        TextTokenizer.from_dir(tmp_path / "missing")


CONV = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "2+2 = 4."},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "It is 6.\nAnything else?"},
]


@pytest.mark.parametrize("gen", [False, True])
@pytest.mark.parametrize("system", [False, True])
def test_render_chat_matches_hf(qwen, hf_qwen, gen, system):
    msgs = ([{"role": "system", "content": "Be terse."}] if system else []) + CONV
    msgs = msgs[:-1] if gen else msgs  # generation prompt after the last user turn
    ref = hf_qwen.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=False)
    assert qwen.render_chat(msgs, add_generation_prompt=gen) == ref
    # and the full 2-turn conversation with a generation prompt, too
    ref = hf_qwen.apply_chat_template(CONV, add_generation_prompt=gen, tokenize=False)
    assert qwen.render_chat(CONV, gen) == ref


CUSTOM_TEMPLATE = """{% for m in messages %}
  {% if m.role not in ['user', 'assistant', 'system'] %}{{ raise_exception('bad role') }}{% endif %}
  {% if loop.index0 > 8 %}{% break %}{% endif %}
  [{{ m.role | upper }}] {{ m | tojson }}
  {% if m.role == 'assistant' %}{% generation %}{{ m.content }}{{ eos_token }}{% endgeneration %}{% endif %}
{% endfor %}
{% if add_generation_prompt %}[ASSISTANT] {% endif %}"""


@pytest.mark.parametrize("gen", [False, True])
def test_render_custom_template_matches_hf(qwen, hf_qwen, gen):
    """trim_blocks/lstrip_blocks, tojson (non-ASCII kept), loop controls, {% generation %}, eos_token."""
    import dataclasses

    import jinja2

    t = dataclasses.replace(qwen, chat_template=CUSTOM_TEMPLATE)
    msgs = CONV + [{"role": "user", "content": "Ça va? 🙂 <b>"}]
    ref = hf_qwen.apply_chat_template(msgs, chat_template=CUSTOM_TEMPLATE, add_generation_prompt=gen, tokenize=False)
    assert t.render_chat(msgs, add_generation_prompt=gen) == ref
    with pytest.raises(jinja2.TemplateError, match="bad role"):
        t.render_chat([{"role": "tool", "content": "x"}])


def test_render_chat_plain_fallback(gpt2):
    text = gpt2.render_chat([{"role": "system", "content": "S"}] + CONV[:3], add_generation_prompt=True)
    assert text == f"System: S\nUser: What is 2+2?\nAssistant: 2+2 = 4.{EOT}\nUser: And 3+3?\nAssistant:"


# ----------------------------------------------------------------------------------------------
# plain text
# ----------------------------------------------------------------------------------------------

def _check_packing(examples, report, ref_ids, seq_len):
    n = len(ref_ids) // seq_len
    assert report.kind == "text"
    assert report.examples == len(examples) == n
    assert report.dropped_tokens == len(ref_ids) - n * seq_len
    assert report.dropped == (1 if len(ref_ids) % seq_len else 0)
    assert report.tokens == n * seq_len
    assert report.label_tokens == n * (seq_len - 1)
    for i, ex in enumerate(examples):
        assert ex.input_ids.dtype == np.int64 and ex.labels.dtype == np.int64
        np.testing.assert_array_equal(ex.input_ids, ref_ids[i * seq_len:(i + 1) * seq_len])
        np.testing.assert_array_equal(ex.labels, ex.input_ids)


def test_text_packing_small(gpt2, hf_gpt2, shared_data, tmp_path):
    lines = (shared_data / "wikitext2" / "test.txt").read_text(encoding="utf-8").splitlines(keepends=True)
    p = tmp_path / "small.txt"
    p.write_text("".join(lines[:60]), encoding="utf-8")
    ref = np.asarray(hf_gpt2.encode(p.read_text(encoding="utf-8"), add_special_tokens=False))
    seq_len = 64
    assert len(ref) % seq_len, "pick a size with a tail"
    examples, report = load_examples(p, gpt2, seq_len)
    _check_packing(examples, report, ref, seq_len)
    assert report.records == 60
    assert any(f"last {len(ref) % seq_len} tokens" in w for w in report.warnings)


def test_text_packing_across_chunks(qwen, hf_qwen, shared_data, tmp_path):
    """3100 lines = 4 tokenizer chunks at the default size; the result must still be one tokenization
    (Qwen's pre-tokenizer merges whitespace runs across lines: a naive cut at line 3000 differs)."""
    lines = (shared_data / "wikitext2" / "valid.txt").read_text(encoding="utf-8").splitlines(keepends=True)
    p = tmp_path / "v.txt"
    p.write_text("".join(lines[:3100]), encoding="utf-8")
    ref = np.asarray(hf_qwen.encode(p.read_text(encoding="utf-8"), add_special_tokens=False))
    examples, report = load_examples(p, qwen, 256)
    _check_packing(examples, report, ref, 256)


@pytest.mark.parametrize("which", ["gpt2", "qwen"])
def test_text_tiny_chunks_equal_whole_file(which, request, shared_data, tmp_path, monkeypatch):
    """Chunks of 3 lines (many cuts, inside runs of blank lines too) still give the whole-file ids."""
    import ort_trainer.tokenizer as D

    ours, hf = request.getfixturevalue(which), request.getfixturevalue(f"hf_{which}")
    lines = (shared_data / "wikitext2" / "test.txt").read_text(encoding="utf-8").splitlines(keepends=True)
    p = tmp_path / "t.txt"
    p.write_text("".join(lines[900:1300]), encoding="utf-8")
    ref = np.asarray(hf.encode(p.read_text(encoding="utf-8"), add_special_tokens=False))
    monkeypatch.setattr(D, "TEXT_CHUNK_LINES", 3)
    monkeypatch.setattr(D, "TEXT_SEAM_PROBE", 1)
    examples, report = load_examples(p, ours, 32)
    _check_packing(examples, report, ref, 32)
    assert not any("cuts between tokenizer chunks" in w for w in report.warnings)
    # no safe line nearby (a cut at an odd line inside a run of newlines changes the "\n\n" tokens):
    # the cut stays and the report says so
    p.write_text("start\n" + "\n" * 40 + "some words here\n" * 20, encoding="utf-8")
    monkeypatch.setattr(D, "TEXT_CHUNK_LINES", 13)
    monkeypatch.setattr(D, "TEXT_SEAM_SEARCH", 1)
    _, report = load_examples(p, ours, 8)
    assert any("cuts between tokenizer chunks" in w for w in report.warnings)


def test_text_bos_added_once(gpt2_dir, hf_gpt2, tmp_path):
    """A tokenizer whose post-processor adds BOS (like Gemma): BOS once at the start of the stream."""
    from tokenizers import Tokenizer
    from tokenizers.processors import TemplateProcessing

    d = tmp_path / "bos_tok"
    shutil.copytree(gpt2_dir, d)
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    tok.post_processor = TemplateProcessing(single=f"{EOT} $A", special_tokens=[(EOT, 50256)])
    tok.save(str(d / "tokenizer.json"))
    t = TextTokenizer.from_dir(d)
    assert t.prefix_ids == [50256]
    assert t.encode("hi") == [50256] + hf_gpt2.encode("hi")
    body = "One line.\nAnother line here.\n" * 20
    p = tmp_path / "b.txt"
    p.write_text(body, encoding="utf-8")
    ref = np.asarray([50256] + hf_gpt2.encode(body))
    examples, report = load_examples(p, t, 16)
    _check_packing(examples, report, ref, 16)
    stream = tokenize_text(body, t)
    assert stream.dtype == np.int64
    np.testing.assert_array_equal(stream, ref)
    assert int(np.sum(np.concatenate([e.input_ids for e in examples]) == 50256)) == 1
    # instruction records without a template: the prefix goes before the prompt, masked
    q = write_jsonl(tmp_path / "i.jsonl", [{"instruction": "Say hi", "output": "hi"}])
    (ex,), _ = load_examples(q, t, 128)
    assert ex.input_ids[0] == 50256 and ex.labels[0] == -100


def test_text_errors(gpt2, tmp_path):
    p = tmp_path / "empty.txt"
    p.write_text("", encoding="utf-8")
    with pytest.raises(DataError, match=r"empty\.txt.*no text"):
        load_examples(p, gpt2, 16)
    p = tmp_path / "short.txt"
    p.write_text("just a few words\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"short\.txt.*fewer than seq_len=16"):
        load_examples(p, gpt2, 16)
    p = tmp_path / "bad.txt"
    p.write_bytes(b"fine\nfine\n\xff\xfe broken\n")
    with pytest.raises(DataError, match=r"bad\.txt line 3.*UTF-8"):
        load_examples(p, gpt2, 16)
    p = tmp_path / "data.csv"
    p.write_text("a,b\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"data\.csv.*\.txt.*\.jsonl.*\.json"):
        load_examples(p, gpt2, 16)


# ----------------------------------------------------------------------------------------------
# instruction / chat records
# ----------------------------------------------------------------------------------------------

INSTR = [
    {"instruction": "Give three tips for staying healthy.", "input": "",
     "output": "1. Eat well.\n2. Sleep.\n3. Move every day."},
    {"instruction": "Translate to French.", "input": "Good morning, friends!", "output": "Bonjour, les amis !"},
    {"instruction": "Who are you?", "output": "I am {{name}}, made by {{author}}."},  # no "input" key
]


def test_instruction_masking_gpt2(gpt2, hf_gpt2, tmp_path):
    p = write_jsonl(tmp_path / "instr.jsonl", INSTR)
    examples, report = load_examples(p, gpt2, 512)
    assert (report.kind, report.records, report.examples, report.truncated, report.dropped) == \
        ("instruction", 3, 3, 0, 0)
    for rec, ex in zip(INSTR, examples):
        inp = rec.get("input", "")
        prompt = ALPACA_HEAD + f"### Instruction:\n{rec['instruction']}\n\n"
        prompt += (f"### Input:\n{inp}\n\n" if inp else "") + "### Response:\n"
        p_ids = hf_gpt2.encode(prompt)
        a_ids = hf_gpt2.encode(rec["output"]) + [hf_gpt2.eos_token_id]
        np.testing.assert_array_equal(ex.input_ids, p_ids + a_ids)
        np.testing.assert_array_equal(ex.labels, [-100] * len(p_ids) + a_ids)
        answer = ex.input_ids[ex.labels != -100]
        assert gpt2.decode(answer) == rec["output"] + EOT
        assert hf_gpt2.decode(ex.input_ids) == prompt + rec["output"] + EOT
    assert "{{name}}" in gpt2.decode(examples[2].input_ids)  # placeholders are plain text
    assert report.tokens == sum(len(e.input_ids) for e in examples)
    assert report.label_tokens == sum(len(hf_gpt2.encode(r["output"])) + 1 for r in INSTR)


def test_instruction_masking_qwen_template(qwen, hf_qwen, tmp_path):
    p = tmp_path / "instr.json"
    p.write_text(json.dumps(INSTR, indent=2), encoding="utf-8")
    examples, report = load_examples(p, qwen, 512)
    assert report.kind == "instruction" and report.examples == 3
    for rec, ex in zip(INSTR, examples):
        user = rec["instruction"] + (f"\n\n{rec['input']}" if rec.get("input") else "")
        msgs = [{"role": "user", "content": user}, {"role": "assistant", "content": rec["output"]}]
        full = hf_qwen.apply_chat_template(msgs, tokenize=True)
        prompt = hf_qwen.apply_chat_template(msgs[:1], tokenize=True, add_generation_prompt=True)
        np.testing.assert_array_equal(ex.input_ids, full)
        assert (ex.labels[:len(prompt)] == -100).all()
        assert (ex.labels[len(prompt):] != -100).all()
        assert qwen.decode(ex.input_ids[ex.labels != -100]) == rec["output"] + "<|im_end|>\n"


CHATS = [
    {"messages": [{"role": "system", "content": "You are a calculator."}] + CONV},
    {"messages": CONV[:2]},
    {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
                  {"role": "user", "content": "Tell me a joke."},
                  {"role": "assistant", "content": "Why did the chicken cross the road?"},
                  {"role": "user", "content": "Why?"}, {"role": "assistant", "content": "To get to the other side."}]},
]


def test_chat_masking_qwen_multiturn(qwen, hf_qwen, tmp_path):
    """Independent mask: HF renders and tokenizes the whole chat with character offsets; a token
    carries loss iff it lies inside "assistant content + <|im_end|>\\n" of some assistant turn."""
    p = write_jsonl(tmp_path / "chat.jsonl", CHATS)
    examples, report = load_examples(p, qwen, 1024)
    assert report.kind == "chat" and report.examples == len(CHATS)
    for rec, ex in zip(CHATS, examples):
        msgs = rec["messages"]
        text = hf_qwen.apply_chat_template(msgs, tokenize=False)
        enc = hf_qwen(text, add_special_tokens=False, return_offsets_mapping=True)
        np.testing.assert_array_equal(ex.input_ids, enc["input_ids"])
        spans, cursor = [], 0
        for m in msgs:
            if m["role"] == "assistant":
                head = "<|im_start|>assistant\n"
                start = text.index(head + m["content"] + "<|im_end|>\n", cursor) + len(head)
                end = start + len(m["content"]) + len("<|im_end|>\n")
                spans.append((start, end))
                cursor = end
        ref_mask = [any(s <= a and b <= e for s, e in spans) for a, b in enc["offset_mapping"]]
        np.testing.assert_array_equal(ex.labels != -100, ref_mask)
        np.testing.assert_array_equal(ex.labels[ex.labels != -100], ex.input_ids[ex.labels != -100])
        # and, directly: the labelled runs decode to exactly the assistant turns
        assistants = [m["content"] for m in msgs if m["role"] == "assistant"]
        got = [qwen.decode(ex.input_ids[a:b]) for a, b in runs(ex.labels != -100)]
        assert got == [c + "<|im_end|>\n" for c in assistants]


def test_chat_plain_gpt2(gpt2, hf_gpt2, tmp_path):
    p = write_jsonl(tmp_path / "chat.jsonl", CHATS[:1])
    (ex,), report = load_examples(p, gpt2, 1024)
    expected = (f"System: You are a calculator.\nUser: What is 2+2?\nAssistant: 2+2 = 4.{EOT}\n"
                f"User: And 3+3?\nAssistant: It is 6.\nAnything else?{EOT}")
    assert hf_gpt2.decode(ex.input_ids) == expected
    got = [gpt2.decode(ex.input_ids[a:b]) for a, b in runs(ex.labels != -100)]
    assert got == [" 2+2 = 4." + EOT, " It is 6.\nAnything else?" + EOT]


def test_truncation_and_drop(gpt2, hf_gpt2, tmp_path):
    seq_len = 64
    recs = [
        {"instruction": "Say yes.", "output": "Yes."},                                       # kept as is
        {"instruction": "Count.", "output": " ".join(str(i) for i in range(200))},           # truncated
        {"instruction": "Summarise: " + "blah " * 200, "output": "Too long."},               # dropped
        {"instruction": "Short again?", "output": "ok"},                                      # kept
    ]
    p = write_jsonl(tmp_path / "t.jsonl", recs)
    examples, report = load_examples(p, gpt2, seq_len)
    assert (report.records, report.examples, report.truncated, report.dropped) == (4, 3, 1, 1)
    assert [len(e.input_ids) for e in examples][1] == seq_len
    assert all(len(e.input_ids) <= seq_len for e in examples)
    assert any("truncated" in w for w in report.warnings) and any("dropped" in w for w in report.warnings)
    assert gpt2.decode(examples[2].labels[examples[2].labels != -100]) == "ok" + EOT
    assert report.label_tokens == sum(loss_token_count(e.labels) for e in examples)
    long_prompt = ALPACA_HEAD + "### Instruction:\n" + recs[2]["instruction"]
    assert len(hf_gpt2.encode(long_prompt)) > seq_len  # the dropped one really had no room for loss
    # chats without an assistant turn are dropped; if everything is dropped -> error
    p = write_jsonl(tmp_path / "none.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    with pytest.raises(DataError, match=r"none\.jsonl.*all 1 records were dropped"):
        load_examples(p, gpt2, seq_len)


@pytest.mark.parametrize("lines, line, pattern", [
    (['{"instruction": "a", "output": "b"}', '{"instruction": "a", "output": "b"', ""], 2, "invalid JSON"),
    (['{"instruction": "a", "output": "b"}', "", '{"instruction": "a"}'], 3, 'missing key "output"'),
    (['{"instruction": "a", "output": 3}'], 1, '"output" must be a string'),
    (['["not", "an", "object"]'], 1, "expected a JSON object"),
    (['{"messages": [{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}]}'], 1, "unknown role 'bot'"),
    (['{"messages": [{"role": "user"}]}'], 1, 'missing key "content"'),
    (['{"messages": []}'], 1, "non-empty list"),
    (['{"prompt": "a", "completion": "b"}'], 1, "unknown record"),
    (['{"instruction": "a", "output": "b"}', '{"messages": [{"role": "user", "content": "a"}]}'], 2, "one record kind"),
])
def test_jsonl_errors_name_the_line(gpt2, tmp_path, lines, line, pattern):
    p = tmp_path / "data.jsonl"
    p.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(DataError) as ei:
        load_examples(p, gpt2, 64)
    msg = str(ei.value)
    assert f"data.jsonl line {line}:" in msg and pattern in msg, msg


def test_json_list_errors_and_empty(gpt2, tmp_path):
    p = tmp_path / "d.json"
    recs = [{"instruction": "a", "output": "b"}, {"instruction": "c", "output": "d"}, {"instruction": "e"}]
    p.write_text(json.dumps(recs, indent=2), encoding="utf-8")  # 3rd record starts on line 10
    assert p.read_text().splitlines()[9].strip() == "{"
    with pytest.raises(DataError, match=r'd\.json line 10: missing key "output"'):
        load_examples(p, gpt2, 64)
    p.write_text('[{"instruction": "a", "output": "b"},\n {"instruction": "a" "output": "b"}]', encoding="utf-8")
    with pytest.raises(DataError, match=r"d\.json line 2: invalid JSON"):
        load_examples(p, gpt2, 64)
    p.write_text('{"instruction": "a", "output": "b"}\n', encoding="utf-8")
    with pytest.raises(DataError, match=r"d\.json line 1: expected a JSON list.*\.jsonl"):
        load_examples(p, gpt2, 64)
    for name, content in (("e.json", "[]"), ("e.jsonl", "\n\n"), ("f.json", "")):
        q = tmp_path / name
        q.write_text(content, encoding="utf-8")
        with pytest.raises(DataError, match=rf"{name}: no records"):
            load_examples(q, gpt2, 64)


def test_template_without_prefix_property(qwen_dir, tmp_path):
    d = tmp_path / "tok"
    shutil.copytree(qwen_dir, d)
    (d / "chat_template.jinja").write_text(
        "{{ messages | length }}:{% for m in messages %}{{ m.content }}|{% endfor %}", encoding="utf-8")
    t = TextTokenizer.from_dir(d)
    p = write_jsonl(tmp_path / "c.jsonl", CHATS[1:2])
    with pytest.raises(DataError, match=r"c\.jsonl line 1: the chat template does not render conversation prefixes"):
        load_examples(p, t, 128)


def test_alpaca_demo_gpt2(gpt2, hf_gpt2, shared_data):
    """Counts checked against an independent per-record computation with the HF tokenizer."""
    path = shared_data / "sft" / "alpaca_en_demo.json"
    recs = json.loads(path.read_text(encoding="utf-8"))
    seq_len = 128
    examples, report = load_examples(path, gpt2, seq_len)
    prompts = []
    for r in recs:
        prompt = ALPACA_HEAD + f"### Instruction:\n{r['instruction']}\n\n"
        prompts.append(prompt + (f"### Input:\n{r['input']}\n\n" if r["input"] else "") + "### Response:\n")
    n_prompt = [len(x) for x in hf_gpt2(prompts)["input_ids"]]
    n_output = [len(x) for x in hf_gpt2([r["output"] for r in recs])["input_ids"]]
    exp_trunc = exp_drop = exp_label = 0
    for n_p, n_o in zip(n_prompt, n_output):
        n = n_p + n_o + 1
        kept = min(n, seq_len)
        loss = max(0, kept - max(n_p, 1))  # label positions t >= 1 with t >= n_p
        if loss == 0:
            exp_drop += 1
        else:
            exp_trunc += n > seq_len
            exp_label += loss
    assert report.records == len(recs) == 999
    assert report.examples == len(examples) == len(recs) - exp_drop
    assert (report.truncated, report.dropped, report.label_tokens) == (exp_trunc, exp_drop, exp_label)
    assert 0 < report.truncated < report.examples and 0 < report.dropped < 50
    assert report.tokens == sum(len(e.input_ids) for e in examples) <= seq_len * report.examples
    assert all(len(e.input_ids) <= seq_len and (e.labels[1:] != -100).any() for e in examples)


def test_identity_placeholders_kept(qwen, shared_data):
    examples, report = load_examples(shared_data / "sft" / "identity.json", qwen, 256)
    assert report.examples == report.records and report.dropped == 0
    assert "{{name}}" in qwen.decode(examples[0].labels[examples[0].labels != -100])


# ----------------------------------------------------------------------------------------------
# batching
# ----------------------------------------------------------------------------------------------

def _ex(ids, labels):
    return Example(np.asarray(ids, dtype=np.int64), np.asarray(labels, dtype=np.int64))


def test_collate_and_loss_count():
    exs = [_ex([5, 6, 7], [-100, 6, 7]), _ex([8], [8]), _ex([1, 2, 3, 4, 5], [-100, -100, -100, 4, 5])]
    b = collate(exs, pad_id=0)
    assert set(b) == {"input_ids", "attention_mask", "labels"}
    assert all(v.dtype == np.int64 and v.shape == (3, 5) for v in b.values())
    np.testing.assert_array_equal(b["input_ids"], [[5, 6, 7, 0, 0], [8, 0, 0, 0, 0], [1, 2, 3, 4, 5]])
    np.testing.assert_array_equal(b["attention_mask"], [[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1]])
    np.testing.assert_array_equal(b["labels"], [[-100, 6, 7, -100, -100], [8, -100, -100, -100, -100],
                                                [-100, -100, -100, 4, 5]])
    b = collate(exs, pad_id=99, pad_to=8)
    assert b["input_ids"].shape == (3, 8) and (b["input_ids"][1, 1:] == 99).all()
    assert (b["labels"][:, 5:] == -100).all() and (b["attention_mask"][:, 5:] == 0).all()
    with pytest.raises(ValueError):
        collate(exs, pad_id=0, pad_to=4)
    assert loss_token_count(b["labels"]) == 2 + 0 + 2

    rng = np.random.default_rng(0)
    labels = rng.integers(0, 50, size=(4, 33))
    labels[rng.random(labels.shape) < 0.4] = -100
    ref = 0
    for row in labels:  # HF: logits[:, :-1] vs labels[:, 1:], ignore_index -100
        for t in range(labels.shape[1] - 1):
            ref += int(row[t + 1] != -100)
    assert loss_token_count(labels) == ref
    assert loss_token_count(labels[0]) == sum(int(x != -100) for x in labels[0, 1:])


# ----------------------------------------------------------------------------------------------
# order
# ----------------------------------------------------------------------------------------------

def _take(order, k):
    return [order.next_batch() for _ in range(k)]


def test_data_order_deterministic_and_per_epoch():
    n, bs, seed = 10, 3, 7
    a, b, c = DataOrder(n, seed, bs), DataOrder(n, seed, bs), DataOrder(n, seed + 1, bs)
    assert a.steps_per_epoch() == 3
    seq_a, seq_b, seq_c = _take(a, 12), _take(b, 12), _take(c, 12)
    assert seq_a == seq_b and seq_a != seq_c
    for e in range(4):
        batches = [idx for idx, ep in seq_a if ep == e]
        assert len(batches) == 3 and all(len(x) == bs for x in batches)
        flat = [i for x in batches for i in x]
        assert len(set(flat)) == 9  # each index at most once; the partial 4th batch is dropped
        perm = np.random.default_rng([seed, e]).permutation(n)
        assert flat == perm[:9].tolist()
    # divisible n: every index exactly once per epoch
    o = DataOrder(12, 0, 4)
    for e in range(3):
        batches = _take(o, 3)
        assert {ep for _, ep in batches} == {e}
        assert sorted(i for idx, _ in batches for i in idx) == list(range(12))
    # fewer examples than a micro-batch: one short batch per epoch
    o = DataOrder(3, 1, 8)
    assert o.steps_per_epoch() == 1
    (i0, e0), (i1, e1) = _take(o, 2)
    assert sorted(i0) == [0, 1, 2] and (e0, e1) == (0, 1)


def test_data_order_resume():
    n, bs, seed = 23, 4, 123
    ref = DataOrder(n, seed, bs)
    full = _take(ref, 30)
    for k in (0, 1, 5, 6, 17):
        o = DataOrder(n, seed, bs)
        _take(o, k)
        state = json.loads(json.dumps(o.state_dict()))
        assert {"epoch", "position", "seed", "n", "batch_size"} <= set(state)
        r = DataOrder(n, seed, bs)
        r.load_state_dict(state)
        assert _take(r, 30 - k) == full[k:]
    state = DataOrder(n, seed, bs).state_dict()
    with pytest.raises(DataError, match="data changed since the run started"):
        DataOrder(n + 1, seed, bs).load_state_dict(state)
    with pytest.raises(DataError, match="seed"):
        DataOrder(n, seed + 1, bs).load_state_dict(state)
    with pytest.raises(DataError):
        DataOrder(n, seed, bs + 1).load_state_dict(state)


def _padding(batches, lengths):
    return sum(len(b) * max(lengths[i] for i in b) - sum(lengths[i] for i in b) for b, _ in batches)


def test_data_order_group_by_length():
    """Length grouping: each epoch still draws every example at most once (same drop_last count),
    micro-batches hold similar lengths (far less padding than the plain order on a short/long mix),
    and the grouped order is deterministic, resumable, and refused on a resume that changes it."""
    rng = np.random.default_rng(0)
    n, bs, seed = 203, 8, 5
    lengths = np.where(rng.random(n) < 0.2, rng.integers(100, 128, n), rng.integers(15, 30, n)).tolist()
    plain, grouped = DataOrder(n, seed, bs), DataOrder(n, seed, bs, lengths=lengths)
    per_epoch = plain.steps_per_epoch()
    assert grouped.steps_per_epoch() == per_epoch == n // bs
    g_batches = _take(grouped, 3 * per_epoch)
    for e in range(3):
        flat = [i for idx, ep in g_batches if ep == e for i in idx]
        assert len(flat) == per_epoch * bs and len(set(flat)) == len(flat)
    assert [ep for _, ep in g_batches] == [ep for _, ep in _take(plain, 3 * per_epoch)]
    plain = DataOrder(n, seed, bs)
    p_pad, g_pad = _padding(_take(plain, per_epoch), lengths), _padding(g_batches[:per_epoch], lengths)
    assert g_pad < 0.25 * p_pad, (g_pad, p_pad)
    # the micro-batches' order is shuffled: the long ones are not one block at the start of the epoch
    long_steps = [k for k, (idx, _) in enumerate(g_batches[:per_epoch]) if max(lengths[i] for i in idx) >= 100]
    assert long_steps and long_steps != list(range(len(long_steps)))
    # deterministic, exact resume
    for k in (0, 3, per_epoch, per_epoch + 7):
        o = DataOrder(n, seed, bs, lengths=lengths)
        _take(o, k)
        r = DataOrder(n, seed, bs, lengths=lengths)
        r.load_state_dict(json.loads(json.dumps(o.state_dict())))
        assert _take(r, 10) == g_batches[k:k + 10]
    with pytest.raises(DataError, match="length grouping changed"):
        DataOrder(n, seed, bs).load_state_dict(DataOrder(n, seed, bs, lengths=lengths).state_dict())
    with pytest.raises(DataError, match="length grouping changed"):
        DataOrder(n, seed, bs, lengths=lengths).load_state_dict(DataOrder(n, seed, bs).state_dict())


@pytest.mark.parametrize("tok_name", ["gpt2", "qwen2.5"])
def test_generation_prompt_ids_equal_the_trained_prompt(tmp_path, tok_name, shared_data):
    from ort_trainer.tokenizer import generation_prompt_ids

    src = shared_data / "tokenizers" / tok_name
    if tok_name == "qwen2.5":
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(src).save_pretrained(tmp_path / "tok")
        src = tmp_path / "tok"
    tok = TextTokenizer.from_dir(src)
    msgs = [{"role": "user", "content": "What workout did I do on July 4?"}]
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"messages": msgs + [{"role": "assistant", "content": "hiking"}]}) + "\n")
    (ex,), _ = load_examples(path, tok, 64)
    first_loss = int(np.argmax(ex.labels != -100))
    assert generation_prompt_ids(tok, msgs) == ex.input_ids[:first_loss].tolist()


def test_text_records_mix_into_chat_files_with_every_token_labelled(tmp_path, shared_data):
    """Replay: {"text": ...} records among chat records; all their tokens carry loss."""
    from tokenizers import Tokenizer

    tok = TextTokenizer.from_dir(shared_data / "tokenizers" / "gpt2")
    ref = Tokenizer.from_file(str(shared_data / "tokenizers" / "gpt2" / "tokenizer.json"))
    path = tmp_path / "mix.jsonl"
    rows = [{"messages": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}]},
            {"text": "The quick brown fox jumps over the lazy dog."}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    examples, report = load_examples(path, tok, 64)
    assert report.examples == 2
    text_ex = examples[1]
    assert text_ex.input_ids.tolist() == ref.encode("The quick brown fox jumps over the lazy dog.").ids
    assert text_ex.labels.tolist() == text_ex.input_ids.tolist()
    assert (examples[0].labels == -100).any()                       # the chat prompt stays masked
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "  "}) + "\n")
    with pytest.raises(DataError, match="non-empty"):
        load_examples(bad, tok, 64)
