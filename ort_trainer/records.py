"""Training records on the device: a ``.txt``, ``.jsonl`` or ``.json`` file becomes `Example`s of at most
seq_len tokens with their labels (-100 where no loss), and a `DataReport` of what was kept, cut and
dropped (`load_examples`). The formats, the label masking and the policy are in docs/DATA.md."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .tokenizer import TEXT_CHUNK_LINES, DataError, TextTokenizer, encode_many, text_ids

IGNORE_INDEX = -100

SUPPORTED_EXTENSIONS = (".txt", ".jsonl", ".json")

CHAT_ROLES = ("system", "user", "assistant")


ALPACA_PROMPT = (
    "Below is an instruction that describes a task. Write a response that appropriately completes "
    "the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n"
)

ALPACA_PROMPT_WITH_INPUT = (
    "Below is an instruction that describes a task. Write a response that appropriately completes "
    "the request.\n\n### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)



def alpaca_prompt(instruction: str, input: str = "") -> str:  # noqa: A002 - the record's key
    """The Alpaca prompt (used without a chat template); the Input block is omitted when empty."""
    if input:
        return ALPACA_PROMPT_WITH_INPUT.format(instruction=instruction, input=input)
    return ALPACA_PROMPT.format(instruction=instruction)



@dataclass
class Example:
    input_ids: np.ndarray   # int64 [L], L <= seq_len
    labels: np.ndarray      # int64 [L], -100 where no loss



@dataclass
class DataReport:
    path: str
    kind: str               # "text" | "instruction" | "chat"
    records: int            # text: lines in the file; JSON: records
    examples: int
    truncated: int          # kept examples that were cut to seq_len
    dropped: int            # JSON: records without loss tokens; text: 1 if a partial tail block was dropped
    tokens: int             # input tokens over all examples
    label_tokens: int       # positions that carry loss after the shift (sum of loss_token_count)
    warnings: list[str]
    seq_len: int = 0
    dropped_tokens: int = 0  # tokens not in any example (text tail, truncated-away, dropped examples)

    def summary(self) -> str:
        return (f"{self.path}: {self.kind}, {self.records} records -> {self.examples} examples "
                f"(seq_len {self.seq_len}; {self.truncated} truncated, {self.dropped} dropped), "
                f"{self.tokens} tokens, {self.label_tokens} loss tokens")



def loss_token_count(labels: np.ndarray) -> int:
    """Number of tokens HF's shifted causal-LM loss averages over: ``labels[..., 1:] != -100``."""
    labels = np.asarray(labels)
    return int(np.count_nonzero(labels[..., 1:] != IGNORE_INDEX))


def load_examples(path, tokenizer: TextTokenizer, seq_len: int) -> tuple[list[Example], DataReport]:
    """Load a ``.txt``, ``.jsonl`` or ``.json`` file into examples of at most ``seq_len`` tokens.

    See docs/DATA.md for the formats, the label masking and the truncate/drop policy.
    """
    p = Path(path)
    ext = p.suffix.lower()
    if ext not in SUPPORTED_EXTENSIONS:
        raise DataError(f"{p}: unsupported file type {p.suffix or '(no extension)'!r}; supported: "
                        ".txt (plain text), .jsonl (one JSON object per line), .json (a JSON list of objects)")
    if not isinstance(seq_len, (int, np.integer)) or seq_len < 2:
        raise DataError(f"{p}: seq_len must be an integer >= 2 (got {seq_len!r})")
    seq_len = int(seq_len)
    if not p.is_file():
        raise DataError(f"{p}: file not found")
    raw = p.read_bytes()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise DataError(f"{p} line {line}: not valid UTF-8 ({e.reason} at byte {e.start}); "
                        "save the file as UTF-8") from e
    text = text.replace("\r\n", "\n").replace("\r", "\n")  # universal newlines, like open()
    if ext == ".txt":
        return _load_text(p, text, tokenizer, seq_len)
    records = _parse_jsonl(p, text) if ext == ".jsonl" else _parse_json_list(p, text)
    return _load_records(p, records, tokenizer, seq_len)



def _load_text(p: Path, text: str, tokenizer: TextTokenizer, seq_len: int):
    lines_count = len(text.splitlines())
    if not text.strip():
        raise DataError(f"{p}: the file has no text; put plain training text in it")
    ids, unsynced = text_ids(text, tokenizer)
    total = len(ids)
    n_blocks = total // seq_len
    tail = total - n_blocks * seq_len
    if n_blocks == 0:
        raise DataError(f"{p}: the file has {total} tokens, fewer than seq_len={seq_len}, so no training block "
                        "can be made; use a smaller seq_len or more text")
    blocks = ids[: n_blocks * seq_len].reshape(n_blocks, seq_len)
    examples = [Example(input_ids=blocks[i].copy(), labels=blocks[i].copy()) for i in range(n_blocks)]
    warnings = []
    if unsynced:
        warnings.append(f"{unsynced} cuts between tokenizer chunks of {TEXT_CHUNK_LINES} lines found no line where "
                        "cutting leaves the tokens unchanged; a token or two there may differ from tokenizing "
                        "the file in one piece")
    if tail:
        warnings.append(f"the last {tail} tokens (shorter than seq_len={seq_len}) were dropped: text is packed "
                        "into non-overlapping blocks of exactly seq_len tokens")
    report = DataReport(
        path=str(p), kind="text", records=lines_count, examples=n_blocks, truncated=0, dropped=1 if tail else 0,
        tokens=n_blocks * seq_len, label_tokens=n_blocks * (seq_len - 1), warnings=warnings, seq_len=seq_len,
        dropped_tokens=tail,
    )
    return examples, report



def _parse_jsonl(p: Path, text: str) -> list[tuple[int, Any]]:
    out = []
    for lineno, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{p} line {lineno}: invalid JSON ({e.msg} at column {e.colno}); "
                            "a .jsonl file needs exactly one JSON object per line") from e
        out.append((lineno, obj))
    return out



def _parse_json_list(p: Path, text: str) -> list[tuple[int, Any]]:
    """Parse a JSON list, keeping the 1-based line where each element starts."""
    dec = json.JSONDecoder()
    n = len(text)

    def skip_ws(i: int) -> int:
        while i < n and text[i] in " \t\n\r":
            i += 1
        return i

    def line_of(i: int) -> int:
        return text.count("\n", 0, i) + 1

    i = skip_ws(0)
    if i >= n:
        return []
    if text[i] != "[":
        hint = (" (if it has one object per line, name it .jsonl)" if text[i] == "{" else "")
        raise DataError(f"{p} line {line_of(i)}: expected a JSON list of records [{{...}}, ...]{hint}")
    i = skip_ws(i + 1)
    out: list[tuple[int, Any]] = []
    if i < n and text[i] == "]":
        i += 1
    else:
        while True:
            try:
                obj, end = dec.raw_decode(text, i)
            except json.JSONDecodeError as e:
                raise DataError(f"{p} line {e.lineno}: invalid JSON ({e.msg} at column {e.colno})") from e
            out.append((line_of(i), obj))
            i = skip_ws(end)
            if i < n and text[i] == ",":
                i = skip_ws(i + 1)
                continue
            if i < n and text[i] == "]":
                i += 1
                break
            where = line_of(min(i, n))
            raise DataError(f"{p} line {where}: invalid JSON (expected ',' or ']' after a list element)")
    i = skip_ws(i)
    if i < n:
        raise DataError(f"{p} line {line_of(i)}: invalid JSON (extra data after the closing ']')")
    return out



def _check_record(p: Path, lineno: int, rec: Any) -> tuple[str, list[dict] | dict]:
    """Validate one record; returns ("instruction", fields), ("chat", messages) or ("text", text).
    Text records ({"text": ...}: every token carries loss) may be mixed into a file of instruction or
    chat records, e.g. general text replayed so that fine-tuning on a narrow set keeps general ability."""
    where = f"{p} line {lineno}"
    if not isinstance(rec, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(rec).__name__}; records are "
                        '{"instruction": ..., "output": ...} or {"messages": [...]}')
    if "messages" in rec:
        msgs = rec["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise DataError(f'{where}: "messages" must be a non-empty list of {{"role": ..., "content": ...}} objects')
        clean = []
        for j, m in enumerate(msgs):
            if not isinstance(m, dict):
                raise DataError(f'{where}: messages[{j}] must be an object {{"role": ..., "content": ...}}, '
                                f"got {type(m).__name__}")
            for key in ("role", "content"):
                if key not in m:
                    raise DataError(f'{where}: messages[{j}] is missing key "{key}" (chat messages need "role" and "content")')
            if not isinstance(m["role"], str) or m["role"] not in CHAT_ROLES:
                raise DataError(f"{where}: messages[{j}] has unknown role {m['role']!r}; "
                                f"roles must be one of {', '.join(CHAT_ROLES)}")
            if not isinstance(m["content"], str):
                raise DataError(f'{where}: messages[{j}] "content" must be a string, got {type(m["content"]).__name__}')
            clean.append({"role": m["role"], "content": m["content"]})
        return "chat", clean
    if "text" in rec and not ({"messages", "instruction", "output"} & set(rec)):
        if not isinstance(rec["text"], str) or not rec["text"].strip():
            raise DataError(f'{where}: "text" must be a non-empty string')
        return "text", rec["text"]
    if "instruction" in rec or "output" in rec:
        for key in ("instruction", "output"):
            if key not in rec:
                raise DataError(f'{where}: missing key "{key}" (instruction records need "instruction" and "output")')
        fields_ = {}
        for key, required in (("instruction", True), ("output", True), ("input", False), ("system", False)):
            v = rec.get(key)
            if v is None and not required:
                v = ""
            if not isinstance(v, str):
                raise DataError(f'{where}: "{key}" must be a string, got {type(v).__name__}')
            fields_[key] = v
        return "instruction", fields_
    keys = ", ".join(sorted(k if k.isprintable() else repr(k) for k in map(str, rec))) or "none"   # one line
    raise DataError(f'{where}: unknown record (keys: {keys}); use {{"instruction": ..., "input": ..., "output": ...}} '
                    'or {"messages": [{"role": ..., "content": ...}, ...]}')



def _render(tokenizer: TextTokenizer, where: str, messages: list[dict], gen: bool) -> str:
    import jinja2

    try:
        return tokenizer.render_chat(messages, add_generation_prompt=gen)
    except jinja2.TemplateError as e:
        raise DataError(f"{where}: the chat template failed on this record ({e}); fix the record "
                        "(e.g. role order the template accepts)") from e



def _chat_segments(tokenizer: TextTokenizer, where: str, messages: list[dict]) -> list[tuple[str, bool]]:
    """Split the rendered chat into (text, carries_loss) segments by rendering prefixes."""
    segs: list[tuple[str, bool]] = []
    prev = ""
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prompt = _render(tokenizer, where, messages[:i], True)
        full = _render(tokenizer, where, messages[: i + 1], False)
        if not prompt.startswith(prev) or not full.startswith(prompt):
            raise DataError(f"{where}: the chat template does not render conversation prefixes as prefixes of "
                            f"the conversation (at message {i}), so the assistant's tokens cannot be located "
                            "exactly; split multi-turn chats into single-turn records or use another template")
        segs.append((prompt[len(prev):], False))
        segs.append((full[len(prompt):], True))
        prev = full
    full = _render(tokenizer, where, messages, False)
    if not full.startswith(prev):
        raise DataError(f"{where}: the chat template does not render conversation prefixes as prefixes of the "
                        "conversation, so the assistant's tokens cannot be located exactly")
    segs.append((full[len(prev):], False))
    return segs



def _load_records(p: Path, records: list[tuple[int, Any]], tokenizer: TextTokenizer, seq_len: int):
    if not records:
        raise DataError(f"{p}: no records; add instruction records "
                        '{"instruction": ..., "output": ...} or chat records {"messages": [...]}')
    kind = None
    first_line = 0
    checked = []
    for lineno, rec in records:
        k, payload = _check_record(p, lineno, rec)
        if k == "text":
            checked.append((lineno, ("text", payload)))
            continue
        if kind is None:
            kind, first_line = k, lineno
        elif k != kind:
            raise DataError(f"{p} line {lineno}: a {k} record in a file of {kind} records (line {first_line}); "
                            "use one record kind per file")
        checked.append((lineno, payload))

    warnings: list[str] = []
    templated = tokenizer.has_chat_template
    eos_missing = tokenizer.eos_id is None
    # Every record -> (prefix ids, list of (text, carries_loss) segments, eos after); specials added separately.
    kind = kind or "text"
    chat_prefix = [] if templated else tokenizer.prefix_ids
    eos_after_output = kind == "instruction" and not templated and tokenizer.eos_id is not None
    plans: list[tuple[list[int], list[tuple[str, bool]], bool]] = []
    for lineno, payload in checked:
        where = f"{p} line {lineno}"
        if isinstance(payload, tuple) and payload[0] == "text":
            plans.append((tokenizer.prefix_ids, [(payload[1], True)], False))
            continue
        if kind == "instruction" and not templated:
            plans.append((chat_prefix, [(alpaca_prompt(payload["instruction"], payload["input"]), False),
                                        (payload["output"], True)], eos_after_output))
            continue
        if kind == "instruction":
            user = payload["instruction"] + ("\n\n" + payload["input"] if payload["input"] else "")
            messages = ([{"role": "system", "content": payload["system"]}] if payload["system"] else [])
            messages += [{"role": "user", "content": user}, {"role": "assistant", "content": payload["output"]}]
        else:
            messages = payload
        plans.append((chat_prefix, _chat_segments(tokenizer, where, messages), False))

    flat = [t for _, segs, _ in plans for t, _ in segs]
    flat_ids = iter(encode_many(tokenizer.tok, flat, add_special_tokens=False))

    examples: list[Example] = []
    truncated = dropped = tokens = label_tokens = dropped_tokens = 0
    for prefix, segs, eos_after in plans:
        ids: list[int] = list(prefix)
        lab: list[int] = [IGNORE_INDEX] * len(prefix)
        for _text, loss in segs:
            seg = next(flat_ids)
            ids.extend(seg)
            lab.extend(seg if loss else [IGNORE_INDEX] * len(seg))
        if eos_after:
            ids.append(tokenizer.eos_id)
            lab.append(tokenizer.eos_id)
        was_truncated = len(ids) > seq_len
        if was_truncated:
            dropped_tokens += len(ids) - seq_len
            ids, lab = ids[:seq_len], lab[:seq_len]
        labels = np.asarray(lab, dtype=np.int64)
        n_loss = loss_token_count(labels)
        if n_loss == 0:
            dropped += 1
            dropped_tokens += len(ids)
            continue
        truncated += was_truncated
        examples.append(Example(input_ids=np.asarray(ids, dtype=np.int64), labels=labels))
        tokens += len(ids)
        label_tokens += n_loss

    if truncated:
        warnings.append(f"{truncated} of {len(records)} examples were longer than seq_len={seq_len} and were "
                        "truncated to their first seq_len tokens (the end of their answers is not trained on)")
    if dropped:
        warnings.append(f"{dropped} of {len(records)} records were dropped: no loss tokens left (prompt longer "
                        f"than seq_len={seq_len}, or no assistant turn)")
    if eos_missing:
        warnings.append("the tokenizer has no EOS token: answers are trained without an end marker")
    if not examples:
        raise DataError(f"{p}: all {len(records)} records were dropped: none has a loss token within "
                        f"seq_len={seq_len} (prompts too long, or no assistant turns); increase seq_len or "
                        "shorten the prompts")
    report = DataReport(
        path=str(p), kind=kind, records=len(records), examples=len(examples), truncated=truncated,
        dropped=dropped, tokens=tokens, label_tokens=label_tokens, warnings=warnings, seq_len=seq_len,
        dropped_tokens=dropped_tokens,
    )
    return examples, report

