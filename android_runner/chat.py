"""`pocketlora generate` and `pocketlora chat` on the device: the bundle's KV-cache decoder (ort_trainer.decoder)
with a run's adapter, a PEFT directory's, or none. onnxruntime, numpy and tokenizers only."""
from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from ort_trainer.adapter import lora_from_peft, lora_from_run
from ort_trainer.bundle import Bundle, open_bundle
from ort_trainer.decoder import Decoder, generate
from ort_trainer.sampling import Sampling
from ort_trainer.faults import InputError
from ort_trainer.session import RuntimeOptions
from ort_trainer.tokenizer import TextTokenizer, generation_prompt_ids, turn_end_ids

from .loop import RUN_CONFIG, read_run_config


def run_lora(run: str | Path, bundle: Bundle | None = None, verify: str = "sizes"
             ) -> tuple[Bundle, dict[str, np.ndarray], int]:
    """The latest checkpoint's LoRA tensors of a training run -> (its bundle, or `bundle`; the tensors; the step)."""
    run = Path(run)
    if not (run / RUN_CONFIG).is_file():
        raise InputError(f"--run {run}: not a training run (no {RUN_CONFIG}). Pass the --out of `pocketlora train`.")
    bundle = bundle or open_bundle(read_run_config(run)["bundle"], verify=verify)
    lora, step = lora_from_run(run, bundle.manifest)
    return bundle, lora, step


def open_with_adapter(bundle: str | None, run: str | None, peft: str | None, threads: int = 0
                      ) -> tuple[Decoder, TextTokenizer, str]:
    """The decoder of --bundle (default: the run's bundle) with the adapter of --run or --peft applied."""
    if bundle is None and run is None:
        raise InputError("give --bundle (and --run or --peft for an adapter), or --run alone to use its bundle.")
    if bundle is None and peft is not None:
        raise InputError("--peft needs --bundle: the bundle of the base model the adapter was trained on.")
    b = open_bundle(bundle, verify="sizes") if bundle else None
    lora, what = None, "none (the base model)"
    if run:
        b, lora, step = run_lora(run, b)
        what = f"run {run} (step {step})"
    elif peft:
        lora, what = lora_from_peft(peft, b.manifest), f"PEFT {peft}"
    decoder = Decoder(b, RuntimeOptions(threads=threads))
    decoder.use_adapter(lora, what)
    return decoder, TextTokenizer.from_dir(b.tokenizer_dir), what


def prompt_ids(tok: TextTokenizer, text: str, raw: bool) -> list[int]:
    """A user prompt through the bundle's chat template (the one training used), or with --raw the text with only
    the tokenizer's own special prefix (e.g. Gemma's <bos>)."""
    if not text.strip():
        raise InputError("empty prompt: give some text (--prompt TEXT, a file, or stdin).")
    if raw:
        return tok.prefix_ids + tok.encode(text, add_special_tokens=False)
    return generation_prompt_ids(tok, [{"role": "user", "content": text}])


def read_prompts(prompt: list[str] | None, prompts_file: str | None) -> list[str]:
    """--prompt (repeatable), or --prompts-file (one prompt per line; '-' = stdin)."""
    if prompt:
        return list(prompt)
    if prompts_file is None:
        raise InputError("no prompt: pass --prompt TEXT, or --prompts-file FILE (one per line; - for stdin).")
    if prompts_file == "-":
        text = sys.stdin.read()
    else:
        try:
            text = Path(prompts_file).read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise InputError(f"--prompts-file {prompts_file}: cannot read it ({exc}).") from exc
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        raise InputError(f"--prompts-file {prompts_file}: no prompt in it (one per line).")
    return lines


def generate_texts(decoder: Decoder, tok: TextTokenizer, texts: list[str], sampling: Sampling, raw: bool,
                   stop_strings: tuple[str, ...], as_json: bool, batch_size: int = 8,
                   write: Callable[[str], None] | None = None) -> None:
    """Generate for each prompt, batch_size rows at a time. One prompt without --json streams its text."""
    write = write or _stdout
    stops = turn_end_ids(tok)
    prompts = [prompt_ids(tok, t, raw) for t in texts]
    stream = len(prompts) == 1 and not as_json
    for start in range(0, len(prompts), batch_size):
        rows = prompts[start:start + batch_size]
        out = generate(decoder, rows, sampling, stops, _pad(tok), decode=lambda ids: tok.decode(ids, skip_special_tokens=True),
                       stop_strings=stop_strings, on_text=(lambda _b, piece: write(piece))
                       if stream else None)
        for g in out:
            if as_json:
                write(json.dumps({"token_ids": g.token_ids, "text": g.text}, ensure_ascii=False) + "\n")
            elif stream:
                write("\n")
            else:
                write(g.text + "\n")


def _stdout(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _pad(tok: TextTokenizer) -> int:
    return tok.pad_id if tok.pad_id is not None else (tok.eos_id or 0)


def chat(decoder: Decoder, tok: TextTokenizer, sampling: Sampling, stop_strings: tuple[str, ...] = (),
         read: Callable[[str], str] = input, write: Callable[[str], None] | None = None) -> None:
    """Talk with the model: each line is a user turn, the answer streams back. /reset forgets the conversation,
    /quit (or end of input) leaves. The oldest turns are dropped when the conversation outgrows the context."""
    write = write or _stdout
    history: list[dict] = []
    write(f"chat with {decoder.bundle.path.name}, adapter: {decoder.adapter_name}. /reset forgets, /quit leaves.\n")
    while True:
        try:
            line = read("> " if sys.stdin.isatty() else "")
        except EOFError:
            return
        if line.strip() in ("/quit", "/exit"):
            return
        if line.strip() == "/reset":
            history = []
            write("(conversation forgotten)\n")
            continue
        if not line.strip():
            continue
        t0 = time.perf_counter()
        history, out = reply(decoder, tok, history + [{"role": "user", "content": line}], sampling, stop_strings,
                             on_text=write)
        seconds = time.perf_counter() - t0
        write(f"\n  ({len(out.token_ids)} tokens, {len(out.token_ids) / max(seconds, 1e-9):.1f} tok/s)\n")


def reply(decoder: Decoder, tok: TextTokenizer, history: list[dict], sampling: Sampling,
          stop_strings: tuple[str, ...] = (), on_text: Callable[[str], None] | None = None):
    """The assistant's answer to `history` (ending with a user turn), through the chat template training used; the
    oldest turns are dropped while prompt + new tokens outgrow the context. -> (the history with the answer, the
    Generated)."""
    ids = generation_prompt_ids(tok, history)
    while len(ids) + sampling.max_new_tokens > decoder.max_positions and len(history) > 1:
        history = history[2:]                    # the oldest user turn and its answer
        ids = generation_prompt_ids(tok, history)
    out = generate(decoder, [ids], sampling, turn_end_ids(tok), _pad(tok),
                   decode=lambda i: tok.decode(i, skip_special_tokens=True), stop_strings=stop_strings,
                   on_text=None if on_text is None else lambda _b, piece: on_text(piece))[0]
    return history + [{"role": "assistant", "content": out.text.strip()}], out
