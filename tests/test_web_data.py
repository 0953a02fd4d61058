"""The phone runner's JS data pipeline (android_runner/web/src/data) equals the Python device side
(ort_trainer.tokenizer, .records, .batching) exactly: token ids and labels on the shared corpora
(WikiText-2 text, the Alpaca and identity SFT sets as instruction and chat records) with GPT-2, Qwen2.5
and Gemma3 tokenizers written as bundles write them, chat-template renders, the DataError messages of malformed files, and the DataOrder
sequence (several seeds, batch sizes, group_by_length, state save/restore in both directions).

One Node process runs the JS side over a job file (android_runner/web/test/data_parity.mjs). Needs node; when
android_runner/web/node_modules lacks the pinned packages, the fixture installs them (npm ci) and fails if
that fails: this test never skips for a missing JS setup.
"""
from __future__ import annotations

import base64
import json
import random
import shutil
import subprocess

import pytest

from ort_trainer.batching import DataOrder, collate
from ort_trainer.records import load_examples
from ort_trainer.tokenizer import DataError, TextTokenizer
from tests.conftest import WEB

TRAIN_LINES, VALID_LINES = 5000, 3000      # > TEXT_CHUNK_LINES: chunked tokenization and its seams are exercised
TEXT_SEQ = 128
SFT_SEQS = (512, 64)                         # 64: many records truncated, some dropped

# Gemma 3's chat template (google/gemma-3 instruct tokenizer_config.json); the GGUF carries none.
GEMMA3_CHAT_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\\n'}}
{%- endif -%}
"""


# ------------------------------------------------------------------------------------------- setup

def _run(cmd, cwd, timeout=900):
    return subprocess.run(cmd, check=False, cwd=cwd, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def tok_dirs(tmp_path_factory, shared_data, gemma3_vocab):
    """Tokenizer directories as bundles carry them (HF save_pretrained): gpt2, qwen2.5, gemma3 (rebuilt
    from the real GGUF, no chat template, as a GGUF bundle has) and gemma3-chat (+ Gemma 3's template)."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("web_data_tok")
    dirs = {}
    for name in ("gpt2", "qwen2.5"):
        AutoTokenizer.from_pretrained(shared_data / "tokenizers" / name).save_pretrained(root / name)
        dirs[name] = root / name
    from artifacts_gen.gguf_tokenizer import build_fast_tokenizer

    build_fast_tokenizer(gemma3_vocab).save_pretrained(root / "gemma3")
    dirs["gemma3"] = root / "gemma3"
    shutil.copytree(root / "gemma3", root / "gemma3-chat")
    (root / "gemma3-chat" / "chat_template.jinja").write_text(GEMMA3_CHAT_TEMPLATE, encoding="utf-8")
    dirs["gemma3-chat"] = root / "gemma3-chat"
    return dirs


def _chat_records(records: list[dict], with_text: bool) -> list[dict]:
    """Multi-turn chats (system + two user/assistant rounds) from consecutive instruction records, and
    now and then a {"text"} record mixed in."""
    out = []
    for i in range(0, len(records) - 1, 2):
        a, b = records[i], records[i + 1]
        msgs = ([{"role": "system", "content": "You are a careful assistant."}] if i % 4 == 0 else [])
        msgs += [{"role": "user", "content": a["instruction"] + ("\n\n" + a["input"] if a.get("input") else "")},
                 {"role": "assistant", "content": a["output"]},
                 {"role": "user", "content": b["instruction"]},
                 {"role": "assistant", "content": b["output"]}]
        out.append({"messages": msgs})
        if with_text and i % 10 == 0:
            out.append({"text": a["output"]})
    return out


@pytest.fixture(scope="module")
def corpora(tmp_path_factory, shared_data):
    root = tmp_path_factory.mktemp("web_data_corpora")
    c = {}
    for name, n in (("train", TRAIN_LINES), ("valid", VALID_LINES)):
        lines = (shared_data / "wikitext2" / f"{name}.txt").read_text(encoding="utf-8").splitlines(keepends=True)
        (root / f"wikitext2-{name}.txt").write_text("".join(lines[:n]), encoding="utf-8")
        c[f"wikitext2-{name}"] = root / f"wikitext2-{name}.txt"
    c["alpaca"] = shared_data / "sft" / "alpaca_en_demo.json"
    c["identity"] = shared_data / "sft" / "identity.json"
    alpaca = json.loads(c["alpaca"].read_text(encoding="utf-8"))
    identity = json.loads(c["identity"].read_text(encoding="utf-8"))
    chat = root / "alpaca-chat.jsonl"
    chat.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in _chat_records(alpaca[:300], True)),
                    encoding="utf-8")
    c["alpaca-chat"] = chat
    ident_chat = root / "identity-chat.json"
    ident_chat.write_text(json.dumps([{"messages": [{"role": "user", "content": r["instruction"]},
                                                    {"role": "assistant", "content": r["output"]}]}
                                      for r in identity], indent=2, ensure_ascii=False), encoding="utf-8")
    c["identity-chat"] = ident_chat
    return c


# ------------------------------------------------------------------------------------ error cases

def _error_cases() -> list[tuple[str, str, bytes, int]]:
    """(tokenizer, file name, bytes, seq_len): malformed or edge-case files, hand-written and fuzzed."""
    inst = {"instruction": "Say hi", "input": "", "output": "Hi there!"}
    chat = {"messages": [{"role": "user", "content": "Hi 🙂"}, {"role": "assistant", "content": "Hello."}]}
    J = lambda v: json.dumps(v, ensure_ascii=False).encode()
    cases = [
        ("gpt2", "data.csv", b"a,b\n", 16), ("gpt2", "data", b"x", 16), ("gpt2", "a.JSON", J([inst]), 64),
        ("gpt2", "d.json", J([inst]), 1),
        ("gpt2", "bad.jsonl", b'{"instruction": "a", "output": "\xff"}\n', 64),
        ("gpt2", "bad2.json", b'[{"instruction": "caf\xc3\xa9",\n "output": "\xe2\x82"}]', 64),
        ("gpt2", "bad3.txt", b"\xef\xbb\xbfline one\nline two \xed\xa0\x80\n", 16),
        ("gpt2", "bad4.txt", b"ok\n\xf0\x9f\x99", 16), ("gpt2", "bad5.txt", b"\xc0\xaf", 16),
        ("gpt2", "bom.json", b"\xef\xbb\xbf" + J([inst]), 64),
        ("gpt2", "empty.txt", b"", 16), ("gpt2", "blank.txt", b" \n\t\n\x1c\n", 16),
        ("gpt2", "short.txt", b"just a few words", 64), ("gemma3", "short.txt", b"a b c d", 5),
        ("gpt2", "crlf.txt", b"one two three\r\nfour five\rsix seven eight nine ten\r\n", 3),
        ("gpt2", "empty.json", b"  \n", 64), ("gpt2", "empty.jsonl", b"\n\n", 64),
        ("gpt2", "obj.json", J(inst), 64), ("gpt2", "num.json", b"[1, 2]", 64), ("gpt2", "nothing.json", b"[{}]", 64),
        ("gpt2", "keys.json", J([{"prompt": 1, "Zeta": 2, "alpha": 3, "é": 4}]), 64),
        ("gpt2", "miss.json", J([{"instruction": "a"}]), 64), ("gpt2", "miss2.json", J([{"output": "a"}]), 64),
        ("gpt2", "type.json", J([{"instruction": "a", "output": 5}]), 64),
        ("gpt2", "type2.json", b'[{"instruction": "a", "output": "b", "system": 1.5e300}]', 64),
        ("gpt2", "type3.json", J([{"instruction": None, "output": "b"}]), 64),
        ("gpt2", "none.json", J([{"instruction": "a", "output": "b", "input": None, "system": None}]), 64),
        ("gpt2", "msgs.json", J([{"messages": []}]), 64), ("gpt2", "msgs2.json", J([{"messages": "hi"}]), 64),
        ("gpt2", "msgs3.json", J([{"messages": ["hi"]}]), 64),
        ("gpt2", "msgs4.json", J([{"messages": [{"role": "user"}]}]), 64),
        ("gpt2", "msgs5.json", J([{"messages": [{"content": "x"}]}]), 64),
        ("gpt2", "role.json", J([{"messages": [{"role": "bot", "content": "x"}]}]), 64),
        ("gpt2", "role2.json", b'[{"messages": [{"role": 1e16, "content": "x"}]}]', 64),
        ("gpt2", "role3.json", J([{"messages": [{"role": ["it's", {"a": None, "b": True}], "content": "x"}]}]), 64),
        ("gpt2", "role4.json", J([{"messages": [{"role": "us\ter\u00e9\u200b", "content": "x"}]}]), 64),
        ("gpt2", "content.json", J([{"messages": [{"role": "user", "content": ["x"]}]}]), 64),
        ("gpt2", "mixed.json", J([inst, chat]), 64), ("gpt2", "mixed.jsonl", J(chat) + b"\n\n" + J(inst) + b"\n", 64),
        ("gpt2", "text.json", J([{"text": "   "}]), 64), ("gpt2", "text2.json", J([{"text": 3}]), 64),
        ("gpt2", "text3.jsonl", J({"text": "plain text record"}) + b"\n" + J(chat) + b"\n" + J({"text": "more"}), 64),
        ("qwen2.5", "text4.json", J([{"text": "only text here"}, {"text": "and here"}]), 64),
        ("gpt2", "noasst.json", J([{"messages": [{"role": "user", "content": "x"}]}, chat]), 64),
        ("gpt2", "noasst2.json", J([{"messages": [{"role": "user", "content": "x"}]}]), 64),
        ("gpt2", "drop.json", J([inst] * 3), 8), ("qwen2.5", "drop.json", J([inst, inst]), 12),
        ("qwen2.5", "asstfirst.json", J([{"messages": [{"role": "assistant", "content": "x"}]}]), 64),
        ("gpt2", "asstfirst.json", J([{"messages": [{"role": "assistant", "content": "x"}]}]), 64),
        ("gemma3-chat", "order.json", J([{"messages": [{"role": "assistant", "content": "x"},
                                                      {"role": "user", "content": "y"}]}]), 64),
        ("gemma3-chat", "sys.json", J([{"instruction": "a", "output": "b", "system": "Be brief."}]), 64),
        ("gemma3", "plainchat.jsonl", J(chat) + b"\n", 64), ("gemma3", "alp.json", J([inst]), 64),
        ("gpt2", "trail.json", J([inst])[:-1] + b",]", 64), ("gpt2", "extra.json", J([inst]) + b" x", 64),
        ("gpt2", "extra2.json", J([inst]) + b"]", 64), ("gpt2", "comma.json", b"[{}\n{}]", 64),
        ("gpt2", "unterminated.json", b'[{"instruction": "abc', 64), ("gpt2", "esc.json", b'[{"a\\q": 1}]', 64),
        ("gpt2", "uesc.json", b'[{"a": "\\u12x4"}]', 64), ("gpt2", "ctrl.json", b'[{"a": "x\ty"}]', 64),
        ("gpt2", "astral.json", '[{"instruction": "🙂🙂🙂", "output": "y" "z"}]'.encode(), 64),
        ("gpt2", "astral.jsonl", '{"instruction": "🙂", "output": tru}\n'.encode(), 64),
        ("gpt2", "bomline.jsonl", J(inst) + b"\n\xef\xbb\xbf" + J(inst) + b"\n", 64),
        ("gpt2", "nan.json", b'[{"instruction": "a", "output": NaN}]', 64),
        ("gpt2", "proto.json", b'[{"__proto__": "x", "instruction": "a", "output": "b"}]', 64),
        ("gpt2", "surr.json", b'[{"instruction": "\\ud83d\\ude42 ok", "output": "b\\u00e9"}]', 64),
    ]
    # Fuzzed: random edits of small valid files.
    rng = random.Random(1234)
    bases = [("f.json", json.dumps([inst, {"instruction": "Two", "input": "x", "output": "y"}], indent=1)),
             ("f.jsonl", json.dumps(chat, ensure_ascii=False) + "\n" + json.dumps(chat) + "\n")]
    alphabet = list('{}[]",:\\ \n\tau01-.eE') + ["true", "null", "\\u", "🙂"]
    for k in range(400):
        name, text = bases[k % 2]
        for _ in range(rng.randint(1, 3)):
            i = rng.randrange(len(text) + 1)
            op = rng.random()
            if op < 0.4:
                text = text[:i] + text[i + 1:]
            elif op < 0.8:
                text = text[:i] + rng.choice(alphabet) + text[i:]
            else:
                j = rng.randrange(len(text) + 1)
                text = text[:min(i, j)] + text[max(i, j):]
        cases.append(("gpt2", f"fuzz{k}-{name}", text.encode("utf-8", "surrogatepass"), 64))
    return cases


# --------------------------------------------------------------------------------------- the run

def _py_order(n, seed, bs, lengths, steps, resume_at):
    o = DataOrder(n, seed, bs, lengths=lengths)
    seq, state = [], None
    for k in range(steps):
        if k == resume_at:
            state = o.state_dict()
        idx, ep = o.next_batch()
        seq.append([idx, ep])
    r = DataOrder(n, seed, bs, lengths=lengths)
    r.load_state_dict(state)
    tail = [list(r.next_batch()) for _ in range(resume_at, steps)]
    return {"seq": seq, "state": state, "tail": tail, "epoch_progress": o.epoch_progress,
            "steps_per_epoch": o.steps_per_epoch()}


@pytest.fixture(scope="module")
def run(node_web, tok_dirs, corpora, tmp_path_factory):
    root = tmp_path_factory.mktemp("web_data_run")
    py_toks = {name: TextTokenizer.from_dir(d) for name, d in tok_dirs.items()}
    loads = []
    for tok in tok_dirs:
        for corpus in ("wikitext2-train", "wikitext2-valid"):
            loads.append({"id": f"{tok}|{corpus}|{TEXT_SEQ}", "tokenizer": tok, "path": str(corpora[corpus]),
                          "seq_len": TEXT_SEQ})
        for corpus in ("alpaca", "identity", "alpaca-chat", "identity-chat"):
            for seq in SFT_SEQS:
                loads.append({"id": f"{tok}|{corpus}|{seq}", "tokenizer": tok, "path": str(corpora[corpus]),
                              "seq_len": seq})

    errors = []
    err_dir = root / "errors"
    err_dir.mkdir()
    for k, (tok, name, data, seq) in enumerate(_error_cases()):
        path = err_dir / f"{k:03d}-{name}" if "/" not in name else err_dir / name
        path.write_bytes(data)
        errors.append({"id": str(k), "tokenizer": tok, "name": str(path), "data_b64": base64.b64encode(data).decode(),
                       "seq_len": seq})

    conversations = [
        [{"role": "user", "content": "Hi"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "  Hi  "},
         {"role": "assistant", "content": " Hello! "}, {"role": "user", "content": "Bye"}],
        [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
        [{"role": "assistant", "content": "first"}],
        [],
    ]
    renders = [{"id": f"{tok}|{i}|{gen}", "tokenizer": tok, "messages": m, "gen": gen}
               for tok in tok_dirs for i, m in enumerate(conversations) for gen in (False, True)]

    alpaca_examples, _ = load_examples(corpora["alpaca"], py_toks["gpt2"], 512)
    alpaca_lengths = [len(e.input_ids) for e in alpaca_examples]
    orders, py_orders = [], {}
    configs = [(999, 0, 4, None), (999, 1, 8, None), (999, 42, 16, None), (999, 2**32 + 7, 4, None),
               (999, 2**63 + 5, 3, None), (7, 3, 16, None), (1, 5, 1, None), (100, 123456789, 1, None),
               (999, 0, 4, alpaca_lengths), (999, 7, 8, alpaca_lengths), (999, 99, 1, alpaca_lengths),
               (60, 11, 4, alpaca_lengths[:60]), (5, 2, 8, [3, 1, 4, 1, 5])]
    for k, (n, seed, bs, lengths) in enumerate(configs):
        steps = min(2000, 3 * max(1, n // bs) + 5)
        resume_at = steps // 2 + 1
        oid = f"{k}:n={n},seed={seed},bs={bs},grouped={lengths is not None}"
        py_orders[oid] = _py_order(n, seed, bs, lengths, steps, resume_at)
        orders.append({"id": oid, "n": n, "seed": str(seed), "batch_size": bs, "lengths": lengths, "steps": steps,
                       "resume_at": resume_at,  # JSON numbers lose a seed beyond 2**53: states carry it as a string
                       "py_state": {**py_orders[oid]["state"], "seed": str(seed)}})

    collates = [{"id": f"{tok}|alpaca|{idx}", "tokenizer": tok, "path": str(corpora["alpaca"]), "seq_len": 512,
                 "indices": idx} for tok in tok_dirs for idx in ([0, 1, 2, 3], [10], [998, 5, 500])]

    job = {"tokenizers": {k: str(v) for k, v in tok_dirs.items()}, "loads": loads, "errors": errors,
           "renders": renders, "orders": orders, "collates": collates, "tokenizer_info": list(tok_dirs)}
    (root / "job.json").write_text(json.dumps(job), encoding="utf-8")
    r = _run([shutil.which("node"), str(WEB / "test" / "data_parity.mjs"), str(root / "job.json"), str(root / "out.json")], WEB,
             timeout=1800)
    assert r.returncode == 0, f"node failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    out = json.loads((root / "out.json").read_text(encoding="utf-8"))
    return {"job": job, "out": out, "py_toks": py_toks, "py_orders": py_orders, "conversations": conversations}


# --------------------------------------------------------------------------------------- the tests

def _report_dict(rep) -> dict:
    return {k: getattr(rep, k) for k in ("path", "kind", "records", "examples", "truncated", "dropped", "tokens",
                                         "label_tokens", "warnings", "seq_len", "dropped_tokens")}


def _first_diff(a: list, b: list) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


_PY_LOADS: dict = {}


def _py_examples(path, tok, seq_len):
    key = (str(path), id(tok), seq_len)
    if key not in _PY_LOADS:
        _PY_LOADS[key] = load_examples(path, tok, seq_len)
    return _PY_LOADS[key]


def _py_load(path, tok, seq_len):
    try:
        exs, rep = _py_examples(path, tok, seq_len)
    except DataError as e:
        return {"error": str(e)}
    return {"input_ids": [e.input_ids.tolist() for e in exs], "labels": [e.labels.tolist() for e in exs],
            "report": _report_dict(rep)}


def test_examples_equal_python(run):
    """Token ids, labels and the report of every corpus x tokenizer x seq_len equal Python's."""
    stats = []
    for spec in run["job"]["loads"]:
        js = run["out"]["loads"][spec["id"]]
        py = _py_load(spec["path"], run["py_toks"][spec["tokenizer"]], spec["seq_len"])
        assert "error" not in py and "error" not in js, (spec["id"], py.get("error"), js.get("error"))
        assert len(js["input_ids"]) == len(py["input_ids"]), (spec["id"], len(js["input_ids"]), len(py["input_ids"]))
        for i, (a, b) in enumerate(zip(js["input_ids"], py["input_ids"])):
            k = _first_diff(a, b)
            assert a == b, f"{spec['id']}: example {i} input_ids differ at {k}: js {a[max(0, k - 3):k + 5]} py {b[max(0, k - 3):k + 5]}"
        for i, (a, b) in enumerate(zip(js["labels"], py["labels"])):
            k = _first_diff(a, b)
            assert a == b, f"{spec['id']}: example {i} labels differ at {k}: js {a[max(0, k - 3):k + 5]} py {b[max(0, k - 3):k + 5]}"
        assert js["report"] == py["report"], spec["id"]
        stats.append((spec["id"], py["report"]["examples"], py["report"]["tokens"], py["report"]["label_tokens"]))
    print("\n".join(f"{i}: {e} examples, {t} tokens, {l} loss tokens: equal" for i, e, t, l in stats))


def test_error_messages_equal_python(run):
    """Malformed and edge-case files: the same DataError message (or the same examples) as Python."""
    n_err = 0
    for spec in run["job"]["errors"]:
        js = run["out"]["errors"][spec["id"]]
        assert "crash" not in js, (spec["name"], js)
        py = _py_load(spec["name"], run["py_toks"][spec["tokenizer"]], spec["seq_len"])
        if "error" in py:
            n_err += 1
            assert js.get("error") == py["error"], (spec["name"], js.get("error"), py["error"])
        else:
            assert "error" not in js, (spec["name"], js["error"])
            assert js["input_ids"] == py["input_ids"] and js["labels"] == py["labels"], spec["name"]
            assert js["report"] == py["report"], spec["name"]
    assert n_err > 250, n_err


def test_chat_renders_equal_python(run):
    for spec in run["job"]["renders"]:
        js = run["out"]["renders"][spec["id"]]
        try:
            py = {"text": run["py_toks"][spec["tokenizer"]].render_chat(spec["messages"], add_generation_prompt=spec["gen"])}
        except Exception as e:  # noqa: BLE001 - the template's own failure
            py = {"error": str(e)}
        assert js == py, spec["id"]


def test_tokenizer_specials_equal_python(run):
    for name, info in run["out"]["tokenizer_info"].items():
        t = run["py_toks"][name]
        assert info == {"bos_token": t.bos_token, "eos_token": t.eos_token, "pad_token": t.pad_token,
                        "unk_token": t.unk_token, "bos_id": t.bos_id, "eos_id": t.eos_id, "pad_id": t.pad_id,
                        "prefix_ids": t.prefix_ids, "suffix_ids": t.suffix_ids,
                        "has_chat_template": t.has_chat_template,
                        "additional_special_tokens": t.additional_special_tokens}, name
    assert run["out"]["tokenizer_info"]["gemma3"]["prefix_ids"] == [2]          # Gemma's BOS, once
    assert run["out"]["tokenizer_info"]["gpt2"]["prefix_ids"] == []


def test_data_order_equals_python(run):
    """The same micro-batch sequence for the same seed (plain and group_by_length), the same state dict,
    and resuming from either side's state continues identically."""
    for spec in run["job"]["orders"]:
        js, py = run["out"]["orders"][spec["id"]], run["py_orders"][spec["id"]]
        k = _first_diff(js["seq"], py["seq"])
        assert js["seq"] == py["seq"], f"{spec['id']}: step {k}: js {js['seq'][k:k + 1]} py {py['seq'][k:k + 1]}"
        assert js["state"] == {**py["state"], "seed": str(py["state"]["seed"])}, spec["id"]
        assert js["tail"] == py["tail"] == py["seq"][spec["resume_at"]:], spec["id"]
        assert js["py_tail"] == py["tail"], spec["id"]
        assert js["epoch_progress"] == pytest.approx(py["epoch_progress"]) and js["steps_per_epoch"] == py["steps_per_epoch"]


def test_collate_equals_python(run):
    for spec in run["job"]["collates"]:
        exs, _ = _py_examples(spec["path"], run["py_toks"][spec["tokenizer"]], spec["seq_len"])
        b = collate([exs[i] for i in spec["indices"]], run["py_toks"][spec["tokenizer"]].pad_id)
        js = run["out"]["collates"][spec["id"]]
        assert js["dims"] == list(b["input_ids"].shape), spec["id"]
        for key in ("input_ids", "attention_mask", "labels"):
            assert js[key] == b[key].reshape(-1).tolist(), (spec["id"], key)
