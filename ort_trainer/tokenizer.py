"""The bundle's tokenizer on the device: `TextTokenizer` (tokenizer.json + the special tokens and chat
template of tokenizer_config.json, rendered like HF `apply_chat_template`), plain text tokenized in
parallel chunks exactly as in one piece (`tokenize_text`), and the prompt ids of a chat
(`generation_prompt_ids`). The rules are written out in docs/DATA.md."""
from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import tokenizers

TEXT_CHUNK_LINES = 1000

TEXT_SEAM_PROBE = 4      # lines on each side of a cut checked for cross-line merges

TEXT_SEAM_SEARCH = 32    # lines after a nominal cut searched for a safe one

TEXT_SEAM_MAX_WIDEN = 256  # max lines a probe widens over whitespace-only lines


# The chat format used when the tokenizer has no chat template (see docs/DATA.md).
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



def encode_many(tok: tokenizers.Tokenizer, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
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
        return encode_many(self.tok, list(texts), add_special_tokens)

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



def generation_prompt_ids(tokenizer: TextTokenizer, messages: list[dict]) -> list[int]:
    """The ids that training puts before an assistant's answer to `messages` (ending with a user turn):
    use them to generate, so inference sees exactly the prompts the model was trained on."""
    text = tokenizer.render_chat(messages, add_generation_prompt=True)
    prefix = [] if tokenizer.has_chat_template else tokenizer.prefix_ids
    return list(prefix) + tokenizer.encode(text, add_special_tokens=False)



def turn_end_ids(tokenizer: TextTokenizer) -> set[int]:
    """Token ids that end the model's turn: the eos token, and the special token the chat template writes right after
    an assistant's message (Gemma's <end_of_turn>, Qwen's <|im_end|>)."""
    ends = {tokenizer.eos_id} if tokenizer.eos_id is not None else set()
    marker = "\x00answer\x00"
    text = tokenizer.render_chat([{"role": "user", "content": "q"}, {"role": "assistant", "content": marker}])
    after = text[text.find(marker) + len(marker):] if marker in text else ""
    first = tokenizer.encode(after, add_special_tokens=False)[:1]
    if first and tokenizer.decode(first, skip_special_tokens=True) == "":
        ends.add(first[0])
    return ends


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
        ids = encode_many(tok, texts, add_special_tokens=False)
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
    return encode_many(tok, chunks, add_special_tokens=False), unsafe



def text_ids(text: str, tokenizer: TextTokenizer) -> tuple[np.ndarray, int]:
    """The int64 token stream of a plain text exactly as the ``.txt`` path builds it (before
    packing): the tokenizer's special prefix (e.g. BOS) once, then the text without special tokens,
    tokenized in parallel chunks equal to tokenizing it in one piece. Also returns the number of
    chunk cuts for which no safe line was found (see :func:`_tokenize_text`)."""
    pieces, unsafe = _tokenize_text(tokenizer.tok, text)
    prefix = tokenizer.prefix_ids
    total = len(prefix) + sum(len(x) for x in pieces)
    ids = np.fromiter(itertools.chain(prefix, itertools.chain.from_iterable(pieces)), dtype=np.int64, count=total)
    return ids, unsafe


def tokenize_text(text: str, tokenizer: TextTokenizer) -> np.ndarray:
    """:func:`text_ids` without the count of unsafe cuts."""
    return text_ids(text, tokenizer)[0]
