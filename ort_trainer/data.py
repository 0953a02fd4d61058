"""Training data on the device: tokenizer, dataset loading, label masking, batching and order.

Only the standard library, numpy, ``tokenizers`` and jinja2 are used here (no torch, no
transformers): this module runs on the phone.

Tokenizer
---------
:class:`TextTokenizer` wraps the bundle's ``tokenizer/tokenizer.json`` (a HF fast tokenizer) plus
the parts of ``tokenizer_config.json`` the device needs (special tokens, chat template). The
post-processor stored in ``tokenizer.json`` is authoritative for which special tokens
``encode(..., add_special_tokens=True)`` adds; bundles are written with HF ``save_pretrained``,
which bakes ``add_bos_token``/``add_eos_token`` into it. The chat template is taken from
``chat_template.jinja`` (what transformers >= 4.43 writes), else ``tokenizer_config.json``'s
``chat_template``, else ``chat_template.json``. It is rendered like HF ``apply_chat_template``:
jinja2 immutable sandbox, ``trim_blocks``/``lstrip_blocks``, ``raise_exception``, ``tojson``,
``strftime_now``, the ``{% generation %}`` tag, and the special tokens as variables.

Data formats (:func:`load_examples`)
------------------------------------
``.txt``
    Plain text. The file is tokenized in order, in chunks of :data:`TEXT_CHUNK_LINES` lines, without
    special tokens; the special prefix the tokenizer would add (its BOS, e.g. Gemma; nothing for
    GPT-2 or Qwen) is put once at the very start. The token stream is cut into consecutive,
    non-overlapping blocks of exactly ``seq_len`` tokens; the tail shorter than ``seq_len`` is
    dropped (``dropped`` = 1, ``dropped_tokens`` = its length, and a warning). ``labels == input_ids``.
    The chunks (tokenized in parallel with ``encode_batch``) are cut between whole lines, each cut
    moved to a nearby line where tokenizing the surrounding lines in one piece gives the same ids
    as tokenizing the two sides apart; so the result equals tokenizing the whole file at once
    (checked on WikiText-2 with GPT-2 and Qwen2.5). If no such line is found within
    :data:`TEXT_SEAM_SEARCH` lines the cut stays and a warning says so.

``.jsonl`` (one JSON object per line; blank lines are skipped) or ``.json`` (a JSON list of objects)
    Every record of a file is of one kind:

    * instruction: ``{"instruction": str, "input": str (optional), "output": str, "system": str (optional)}``
    * chat: ``{"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}``

    With a chat template, an instruction record becomes the messages
    ``[system?, user: instruction (+ "\\n\\n" + input if non-empty), assistant: output]``.
    Every assistant turn carries loss: the assistant's content *and the end-of-turn text the template
    renders after it* (e.g. Qwen's ``<|im_end|>\\n``); everything else is ``-100``. The split is found
    by rendering prefixes of the conversation: for assistant turn ``i`` the prompt is
    ``render(messages[:i], add_generation_prompt=True)`` and the turn is what
    ``render(messages[:i+1])`` adds to it. Rendered text is tokenized with
    ``add_special_tokens=False`` (the template includes BOS where the model needs one).

    Without a chat template (e.g. GPT-2):

    * instruction records use the Alpaca prompt (:func:`alpaca_prompt`); the prompt (preceded by
      the tokenizer's special prefix, if any) is ``-100``; ``output`` followed by the EOS token
      carries loss;
    * chat records are rendered with :data:`PLAIN_CHAT_TEMPLATE`::

          System: {content}\\n          (system turns)
          User: {content}\\n            (user turns)
          Assistant: {content}<eos>     (assistant turns; " {content}<eos>" carries loss)

      turns are separated by "\\n" and the generation prompt is "Assistant:"; the same prefix
      rule as above decides the loss, so exactly " {content}" + EOS of every assistant turn is
      labelled. :meth:`TextTokenizer.render_chat` uses the same template, so prompts at inference
      match training.

    Label masking is exact on token boundaries because each segment (prompt part / loss part) is
    tokenized separately and the ids are concatenated. Where a boundary falls inside what a
    whole-text tokenization would merge into one token (rare; e.g. an output starting with
    whitespace right after a prompt ending in whitespace) the ids can differ from tokenizing the
    whole rendered text; that is the price of exact masks.

Policy
------
* An example longer than ``seq_len`` is truncated to its first ``seq_len`` tokens (counted in
  ``truncated``, with a warning).
* An example with no loss tokens (after the shift; e.g. a prompt longer than ``seq_len``, or a
  chat without an assistant turn) is dropped (counted in ``dropped``, with a warning).
  ``examples + dropped == records`` for JSON data; ``truncated`` counts kept examples only.
* No examples at all is a :class:`DataError` naming the file and the reason.
* Malformed JSON, missing keys, wrong types, unknown roles, mixed record kinds: :class:`DataError`
  with the file, the 1-based line and the problem. ``{{name}}``-style placeholders in the data are
  plain text (never substituted).

The loss is HF's shifted causal-LM cross-entropy: position ``t`` predicts ``labels[t + 1]`` and
``-100`` is ignored, so the number of tokens a batch's loss averages over is
:func:`loss_token_count` (``labels[..., 1:] != -100``).

Batching: :func:`collate` right-pads; :class:`DataOrder` gives a deterministic, resumable order.
"""
from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import tokenizers

IGNORE_INDEX = -100
TEXT_CHUNK_LINES = 1000
TEXT_SEAM_PROBE = 4      # lines on each side of a cut checked for cross-line merges
TEXT_SEAM_SEARCH = 32    # lines after a nominal cut searched for a safe one
TEXT_SEAM_MAX_WIDEN = 256  # max lines a probe widens over whitespace-only lines
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

# The chat format used when the tokenizer has no chat template (see the module docstring).
PLAIN_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if not loop.first %}{{ '\\n' }}{% endif -%}"
    "{%- if message['role'] == 'system' -%}{{ 'System: ' + message['content'] }}"
    "{%- elif message['role'] == 'user' -%}{{ 'User: ' + message['content'] }}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{{ 'Assistant: ' + message['content'] }}{% if eos_token is defined %}{{ eos_token }}{% endif %}"
    "{%- else -%}{{ raise_exception('unknown role: ' + message['role']) }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{% if messages %}{{ '\\n' }}{% endif %}{{ 'Assistant:' }}{%- endif -%}"
)


class DataError(ValueError):
    """Unusable training data; the message names the file, the line (1-based) when there is one,
    the problem and the fix."""


def alpaca_prompt(instruction: str, input: str = "") -> str:  # noqa: A002 - the record's key
    """The Alpaca prompt (used without a chat template); the Input block is omitted when empty."""
    if input:
        return ALPACA_PROMPT_WITH_INPUT.format(instruction=instruction, input=input)
    return ALPACA_PROMPT.format(instruction=instruction)


# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------

def _token_str(value: Any) -> str | None:
    """A special token from tokenizer_config.json: a string or an AddedToken dict with "content"."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{path}: cannot read ({e}); rebuild the bundle's tokenizer directory") from e
    if not isinstance(data, dict):
        raise DataError(f"{path}: expected a JSON object; rebuild the bundle's tokenizer directory")
    return data


def _pick_template(value: Any) -> str | None:
    """chat_template is a string, or a list of {"name", "template"} (HF multi-template form)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        tpl = named.get("default")
        return tpl if isinstance(tpl, str) else None
    return None


def _compile_template(source: str):
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class _GenerationTag(Extension):
        """HF's ``{% generation %}...{% endgeneration %}`` tag; here it just renders its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, "jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


def _encode_many(tok: tokenizers.Tokenizer, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
    if not texts:
        return []
    fast = getattr(tok, "encode_batch_fast", None)  # tokenizers >= 0.20: no offsets, faster
    encs = (fast or tok.encode_batch)(texts, add_special_tokens=add_special_tokens)
    return [e.ids for e in encs]


@dataclass
class TextTokenizer:
    """tokenizers.Tokenizer + the bits of tokenizer_config.json the device needs."""

    tok: tokenizers.Tokenizer
    bos_token: str | None
    eos_token: str | None
    pad_token: str | None
    bos_id: int | None
    eos_id: int | None
    pad_id: int              # pad_token's id, else eos_id, else 0
    chat_template: str | None
    unk_token: str | None = None
    additional_special_tokens: list[str] = field(default_factory=list)
    clean_up_tokenization_spaces: bool = False

    @classmethod
    def from_dir(cls, tokenizer_dir) -> "TextTokenizer":
        d = Path(tokenizer_dir)
        tj = d / "tokenizer.json"
        if not tj.is_file():
            raise DataError(f"{tj}: not found; the bundle's tokenizer directory needs tokenizer.json "
                            "(written by HF save_pretrained of a fast tokenizer); rebuild the bundle")
        try:
            tok = tokenizers.Tokenizer.from_file(str(tj))
        except Exception as e:  # the Rust side raises plain Exception
            raise DataError(f"{tj}: cannot load ({e}); rebuild the bundle with a matching tokenizers version") from e
        # HF applies truncation/padding per call; the device never wants them from the file.
        tok.no_truncation()
        tok.no_padding()

        cfg: dict = {}
        if (d / "tokenizer_config.json").is_file():
            cfg = _read_json(d / "tokenizer_config.json")
        stm: dict = {}
        if (d / "special_tokens_map.json").is_file():
            stm = _read_json(d / "special_tokens_map.json")

        def special(name: str) -> str | None:
            v = _token_str(cfg.get(name))
            return v if v is not None else _token_str(stm.get(name))

        bos, eos, pad, unk = special("bos_token"), special("eos_token"), special("pad_token"), special("unk_token")
        extra = cfg.get("additional_special_tokens", stm.get("additional_special_tokens")) or []
        extra = [t for t in (_token_str(x) for x in extra) if t is not None]

        def tid(t: str | None) -> int | None:
            return None if t is None else tok.token_to_id(t)

        bos_id, eos_id, pad_id = tid(bos), tid(eos), tid(pad)
        if pad_id is None:
            pad_id = eos_id if eos_id is not None else 0

        template = None
        if (d / "chat_template.jinja").is_file():
            template = (d / "chat_template.jinja").read_text(encoding="utf-8")
        if template is None:
            template = _pick_template(cfg.get("chat_template"))
        if template is None and (d / "chat_template.json").is_file():
            template = _pick_template(_read_json(d / "chat_template.json").get("chat_template"))

        return cls(
            tok=tok, bos_token=bos, eos_token=eos, pad_token=pad, bos_id=bos_id, eos_id=eos_id,
            pad_id=int(pad_id), chat_template=template, unk_token=unk, additional_special_tokens=extra,
            clean_up_tokenization_spaces=bool(cfg.get("clean_up_tokenization_spaces", False)),
        )

    # -- encoding -------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        return _encode_many(self.tok, list(texts), add_special_tokens)

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        ids = [int(i) for i in np.asarray(ids).reshape(-1)]
        text = self.tok.decode(ids, skip_special_tokens=skip_special_tokens)
        if self.clean_up_tokenization_spaces:
            for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                         (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
                text = text.replace(a, b)
        return text

    @cached_property
    def _special_affixes(self) -> tuple[list[int], list[int]]:
        probe = "a"
        plain = self.encode(probe, add_special_tokens=False)
        full = self.encode(probe, add_special_tokens=True)
        for k in range(len(full) - len(plain) + 1):
            if full[k:k + len(plain)] == plain:
                return full[:k], full[k + len(plain):]
        return [], []

    @property
    def prefix_ids(self) -> list[int]:
        """Special tokens the post-processor puts before a single sequence (e.g. Gemma's <bos>)."""
        return list(self._special_affixes[0])

    @property
    def suffix_ids(self) -> list[int]:
        """Special tokens the post-processor puts after a single sequence (usually none)."""
        return list(self._special_affixes[1])

    # -- chat -----------------------------------------------------------------------------

    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_template)

    @cached_property
    def _compiled_template(self):
        return _compile_template(self.chat_template or PLAIN_CHAT_TEMPLATE)

    def template_variables(self) -> dict[str, Any]:
        """The special-token variables HF passes to chat templates (None values are left undefined)."""
        out: dict[str, Any] = {}
        for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
            v = getattr(self, name)
            if v is not None:
                out[name] = v
        out["additional_special_tokens"] = list(self.additional_special_tokens)
        return out

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = False, **template_kwargs) -> str:
        """Render messages like HF ``apply_chat_template(..., tokenize=False)``.

        Uses the tokenizer's chat template, or :data:`PLAIN_CHAT_TEMPLATE` when it has none.
        Tokenize the result with ``add_special_tokens=False`` (plus :attr:`prefix_ids` in front
        when there is no chat template). Template errors raise ``jinja2.TemplateError``.
        """
        kwargs = {"tools": None, "documents": None, **self.template_variables(), **template_kwargs}
        return self._compiled_template.render(
            messages=messages, add_generation_prompt=add_generation_prompt, **kwargs
        )


# --------------------------------------------------------------------------------------------
# Examples and reports
# --------------------------------------------------------------------------------------------

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


def collate(examples: list[Example], pad_id: int, pad_to: int | None = None) -> dict[str, np.ndarray]:
    """Right-pad a micro-batch to its longest example (or to ``pad_to``).

    Returns int64 ``input_ids`` (padding = ``pad_id``), ``attention_mask`` (1 on tokens, 0 on
    padding) and ``labels`` (``-100`` on padding), each ``[B, L]``.
    """
    if not examples:
        raise ValueError("collate: no examples")
    longest = max(len(e.input_ids) for e in examples)
    length = longest if pad_to is None else int(pad_to)
    if length < longest:
        raise ValueError(f"collate: pad_to={pad_to} is shorter than the longest example ({longest} tokens)")
    b = len(examples)
    input_ids = np.full((b, length), int(pad_id), dtype=np.int64)
    attention_mask = np.zeros((b, length), dtype=np.int64)
    labels = np.full((b, length), IGNORE_INDEX, dtype=np.int64)
    for i, e in enumerate(examples):
        n = len(e.input_ids)
        if len(e.labels) != n:
            raise ValueError(f"collate: example {i} has {n} input_ids but {len(e.labels)} labels")
        input_ids[i, :n] = e.input_ids
        attention_mask[i, :n] = 1
        labels[i, :n] = e.labels
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------

def generation_prompt_ids(tokenizer: TextTokenizer, messages: list[dict]) -> list[int]:
    """The ids that training puts before an assistant's answer to `messages` (ending with a user turn):
    use them to generate, so inference sees exactly the prompts the model was trained on."""
    text = tokenizer.render_chat(messages, add_generation_prompt=True)
    prefix = [] if tokenizer.has_chat_template else tokenizer.prefix_ids
    return list(prefix) + tokenizer.encode(text, add_special_tokens=False)


def load_examples(path, tokenizer: TextTokenizer, seq_len: int) -> tuple[list[Example], DataReport]:
    """Load a ``.txt``, ``.jsonl`` or ``.json`` file into examples of at most ``seq_len`` tokens.

    See the module docstring for the formats, the label masking and the truncate/drop policy.
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


def _probe_window(lines: list[str], c: int) -> tuple[str, str] | None:
    """The text around a cut before line c: TEXT_SEAM_PROBE lines each side, widened until both
    ends are lines with non-whitespace (or the file's ends), so that whitespace runs crossing the
    cut are inside it. None if that needs more than TEXT_SEAM_MAX_WIDEN lines (no safe cut here)."""
    k = max(1, TEXT_SEAM_PROBE)
    lo = max(0, c - k)
    while lo > 0 and not lines[lo].strip():
        lo -= 1
        if c - lo > TEXT_SEAM_MAX_WIDEN:
            return None
    hi = min(len(lines), c + k)
    while hi < len(lines) and not lines[hi - 1].strip():
        hi += 1
        if hi - c > TEXT_SEAM_MAX_WIDEN:
            return None
    return "".join(lines[lo:c]), "".join(lines[c:hi])


def _safe_seams(tok: tokenizers.Tokenizer, lines: list[str], nominal: list[int]) -> tuple[list[int], int]:
    """For each nominal cut (a line index), the first line at or after it (within TEXT_SEAM_SEARCH
    lines) where cutting does not change the tokens: the text around it tokenizes in one piece
    exactly as its two halves do. Returns the cuts and how many found none (those stay nominal)."""
    chosen: dict[int, int] = {}
    for r in range(max(1, TEXT_SEAM_SEARCH)):
        todo = [b for b in nominal if b not in chosen and b + r < len(lines)]
        if not todo:
            break
        probes = [(b, _probe_window(lines, b + r)) for b in todo]
        probes = [(b, w) for b, w in probes if w is not None]
        texts = [t for _, (left, right) in probes for t in (left + right, left, right)]
        ids = _encode_many(tok, texts, add_special_tokens=False)
        for i, (b, _) in enumerate(probes):
            if ids[3 * i] == ids[3 * i + 1] + ids[3 * i + 2]:
                chosen[b] = b + r
    return [chosen.get(b, b) for b in nominal], sum(b not in chosen for b in nominal)


def _tokenize_text(tok: tokenizers.Tokenizer, text: str) -> tuple[list[list[int]], int]:
    """Tokenize a long text (no special tokens) as if in one piece, in parallel chunks of lines.

    Chunks are about TEXT_CHUNK_LINES lines; each cut is moved to a nearby line boundary where
    cutting does not change the tokens locally (see :func:`_safe_seams`), so tokens that a
    whole-text tokenization merges across lines (e.g. whitespace runs) come out the same. Returns
    the id pieces in order and the number of cuts for which no safe line was found.
    """
    lines = text.splitlines(keepends=True)
    c = max(1, TEXT_CHUNK_LINES)
    if len(lines) <= c:
        return [tok.encode(text, add_special_tokens=False).ids], 0
    seams, unsafe = _safe_seams(tok, lines, list(range(c, len(lines), c)))
    bounds = sorted({0, *seams, len(lines)})  # a moved cut may pass the next one: keep a partition
    chunks = ["".join(lines[lo:hi]) for lo, hi in zip(bounds[:-1], bounds[1:])]
    return _encode_many(tok, chunks, add_special_tokens=False), unsafe


def tokenize_text(text: str, tokenizer: TextTokenizer) -> np.ndarray:
    """The int64 token stream of a plain text exactly as the ``.txt`` path builds it (before
    packing): the tokenizer's special prefix (e.g. BOS) once, then the text without special tokens,
    tokenized in parallel chunks equal to tokenizing it in one piece."""
    pieces, _ = _tokenize_text(tokenizer.tok, text)
    prefix = tokenizer.prefix_ids
    total = len(prefix) + sum(len(x) for x in pieces)
    return np.fromiter(itertools.chain(prefix, itertools.chain.from_iterable(pieces)), dtype=np.int64, count=total)


def _load_text(p: Path, text: str, tokenizer: TextTokenizer, seq_len: int):
    lines_count = len(text.splitlines())
    if not text.strip():
        raise DataError(f"{p}: the file has no text; put plain training text in it")
    encoded, unsynced = _tokenize_text(tokenizer.tok, text)
    prefix = tokenizer.prefix_ids
    total = len(prefix) + sum(len(x) for x in encoded)
    ids = np.fromiter(itertools.chain(prefix, itertools.chain.from_iterable(encoded)), dtype=np.int64, count=total)
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
    keys = ", ".join(sorted(map(str, rec))) or "none"
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
    flat_ids = iter(_encode_many(tokenizer.tok, flat, add_special_tokens=False))

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


# --------------------------------------------------------------------------------------------
# Order
# --------------------------------------------------------------------------------------------

class DataOrder:
    """Deterministic, resumable order over examples: epoch e uses
    ``np.random.default_rng([seed, e]).permutation(n)``.

    Micro-batches are consecutive slices of that permutation. Policy: ``drop_last`` — when
    ``n >= batch_size`` the last partial micro-batch of an epoch is skipped (each epoch has
    ``n // batch_size`` micro-batches of exactly ``batch_size``; the skipped examples differ from
    epoch to epoch). When ``n < batch_size`` every epoch is one short micro-batch of all ``n``
    examples. Epochs roll over without end. The state (``epoch``, ``position`` = examples already
    taken in the current epoch) always points at the next micro-batch, so after the last batch of
    an epoch it reads ``epoch + 1, position 0``.

    ``lengths`` (token count per example) turns on length grouping, as transformers'
    ``group_by_length``: the epoch's permutation is cut into mega-batches of ``GROUP_BATCHES``
    micro-batches, each sorted by length (longest first) and cut into micro-batches whose order is
    then shuffled with the same generator. A micro-batch is padded to its longest example, so
    mixing 20- and 120-token examples otherwise spends most of the step on padding. The grouped
    order is still a pure function of (seed, epoch, lengths): resume stays exact.
    """

    GROUP_BATCHES = 32

    VERSION = 1

    def __init__(self, n: int, seed: int, batch_size: int, lengths: Sequence[int] | None = None):
        if int(n) < 1:
            raise DataError(f"DataOrder: no examples (n={n})")
        if int(batch_size) < 1:
            raise ValueError(f"DataOrder: batch_size must be >= 1 (got {batch_size})")
        self.n = int(n)
        self.seed = int(seed)
        self.batch_size = int(batch_size)
        if lengths is not None and len(lengths) != self.n:
            raise ValueError(f"DataOrder: {len(lengths)} lengths for {self.n} examples")
        self.lengths = None if lengths is None else np.asarray(lengths, dtype=np.int64)
        self.epoch = 0
        self.position = 0
        self._perm_epoch = -1
        self._perm: np.ndarray | None = None

    @property
    def _take(self) -> int:
        return min(self.batch_size, self.n)

    def steps_per_epoch(self) -> int:
        """Micro-batches per epoch (``n // batch_size``, at least 1)."""
        return max(1, self.n // self.batch_size)

    @property
    def step_in_epoch(self) -> int:
        return self.position // self._take

    @property
    def epoch_progress(self) -> float:
        """Epochs done as a float (e.g. 1.5 = halfway through the second epoch)."""
        return self.epoch + self.step_in_epoch / self.steps_per_epoch()

    def permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            rng = np.random.default_rng([self.seed, int(epoch)])
            perm = rng.permutation(self.n)
            self._perm = perm if self.lengths is None else self._grouped(perm, rng)
            self._perm_epoch = epoch
        return self._perm

    def _grouped(self, perm: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        take, mega = self._take, self._take * self.GROUP_BATCHES
        out = []
        for m in range(0, len(perm), mega):
            chunk = perm[m:m + mega]
            chunk = chunk[np.argsort(-self.lengths[chunk], kind="stable")]
            batches = [chunk[i:i + take] for i in range(0, len(chunk), take)]
            full = [b for b in batches if len(b) == take]
            out += [full[i] for i in rng.permutation(len(full))] + [b for b in batches if len(b) < take]
        return np.concatenate(out)

    def next_batch(self) -> tuple[list[int], int]:
        """Indices of the next micro-batch and the epoch it belongs to."""
        take = self._take
        epoch = self.epoch
        perm = self.permutation(epoch)
        idx = [int(i) for i in perm[self.position:self.position + take]]
        self.position += take
        if self.position + take > self.n:
            self.epoch += 1
            self.position = 0
        return idx, epoch

    def state_dict(self) -> dict:
        return {"version": self.VERSION, "epoch": self.epoch, "position": self.position, "seed": self.seed,
                "n": self.n, "batch_size": self.batch_size, "group_by_length": self.lengths is not None}

    def load_state_dict(self, d: dict) -> None:
        try:
            n, seed, bs = int(d["n"]), int(d["seed"]), int(d["batch_size"])
            epoch, position = int(d["epoch"]), int(d["position"])
        except (KeyError, TypeError, ValueError) as e:
            raise DataError(f"data order state is incomplete or malformed ({e!r}); it needs epoch, position, "
                            "seed, n and batch_size") from e
        if n != self.n:
            raise DataError(f"the data changed since the run started: the checkpoint's data order has n={n} "
                            f"examples, the data now gives {self.n}; resume with the same data file, tokenizer "
                            "and seq_len, or start a new run")
        if seed != self.seed:
            raise DataError(f"the data order changed since the run started: the checkpoint used seed={seed}, "
                            f"now seed={self.seed}; resume with the same seed, or start a new run")
        if bs != self.batch_size:
            raise DataError(f"the micro-batch size changed since the run started (checkpoint {bs}, now "
                            f"{self.batch_size}); resume with the same batch size, or start a new run")
        if bool(d.get("group_by_length", False)) != (self.lengths is not None):
            raise DataError(f"length grouping changed since the run started (checkpoint "
                            f"group_by_length={bool(d.get('group_by_length', False))}); resume with the same "
                            "setting, or start a new run")
        if epoch < 0 or position < 0 or position % self._take or position + self._take > self.n:
            raise DataError(f"data order state is inconsistent (epoch={epoch}, position={position}, n={n}, "
                            f"batch_size={bs})")
        self.epoch, self.position = epoch, position


def data_order(examples: Sequence[Example], seed: int, micro_batch: int, group_by_length: bool = False) -> DataOrder:
    """The order a run takes its micro-batches in (length grouping uses each example's token count)."""
    return DataOrder(len(examples), seed, micro_batch,
                     lengths=[len(e.input_ids) for e in examples] if group_by_length else None)


def step_batches(examples: Sequence[Example], order: DataOrder, accum: int, pad_id: int) -> list[dict[str, np.ndarray]]:
    """The micro-batches of one optimizer step: the next `accum` micro-batches of `order`, collated."""
    return [collate([examples[i] for i in order.next_batch()[0]], pad_id) for _ in range(accum)]


__all__ = [
    "ALPACA_PROMPT", "ALPACA_PROMPT_WITH_INPUT", "CHAT_ROLES", "DataError", "DataOrder", "DataReport", "Example",
    "IGNORE_INDEX", "PLAIN_CHAT_TEMPLATE", "SUPPORTED_EXTENSIONS", "TEXT_CHUNK_LINES", "TextTokenizer",
    "alpaca_prompt", "collate", "data_order", "load_examples", "loss_token_count", "step_batches",
    "tokenize_text",
]
