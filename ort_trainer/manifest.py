"""The bundle manifest: the one contract between the workstation (artifacts_gen) and the device.

artifacts_gen writes it; the device validates it (ort_trainer.bundle) before anything runs.
It is plain JSON, versioned by SCHEMA_VERSION. Only the standard library is used here so
that both sides can import it.
"""
from __future__ import annotations

import json
import re
from dataclasses import MISSING, asdict, dataclass, field, fields, is_dataclass
from pathlib import Path
from types import UnionType
from typing import Any, Union, get_args, get_origin, get_type_hints

SCHEMA_VERSION = 1
MANIFEST_NAME = "manifest.json"

# Fixed file names inside a bundle.
TRAINING_MODEL = "training_model.onnx"
EVAL_MODEL = "eval_model.onnx"
OPTIMIZER_MODEL = "optimizer_model.onnx"
CHECKPOINT = "checkpoint"
TOKENIZER_DIR = "tokenizer"
CONFIG = "config.json"
WEB_TRAINING_MODEL = "web_training_model.onnx"   # the web runner's gradient graph (artifacts_gen/web_graphs.py)
WEB_LORA_INIT = "web_lora_init.safetensors"     # the checkpoint's LoRA tensors, for the web runner
DECODER_MODEL = "decoder_model.onnx"            # prefill + decode with a KV cache (artifacts_gen/decoder.py)

# Graph interface (both training and eval models take these inputs).
INPUT_NAMES = ("input_ids", "attention_mask", "labels", "loss_scale")
IGNORE_INDEX = -100


class ManifestError(ValueError):
    """A manifest that cannot be used; the message names the file and the problem."""


@dataclass
class ModelSummary:
    family: str              # "gpt2" | "qwen2" | "gemma3"
    architecture: str        # HF class name, e.g. "Qwen2ForCausalLM"
    num_layers: int
    hidden_size: int
    vocab_size: int
    max_positions: int
    tie_word_embeddings: bool
    frozen_params: int       # number of frozen base-model parameters (elements)
    source: str              # where the weights came from (path, or path + gguf file)


@dataclass
class LoraSpec:
    r: int
    alpha: float
    dropout: float
    targets: str             # what the user asked for: "attn", "all-linear" or a comma list
    target_modules: list[str]  # PEFT's target_modules, exactly as passed to LoraConfig
    fan_in_fan_out: bool     # GPT-2 Conv1D layers store weights as (in, out)

    @property
    def scaling(self) -> float:
        return self.alpha / self.r


@dataclass
class Trainable:
    onnx_name: str           # initializer name in the ONNX graphs and the ORT checkpoint
    peft_key: str            # key in PEFT's adapter_model.safetensors
    shape: list[int]         # shape of the ONNX tensor
    transposed: bool         # ONNX tensor == PEFT tensor transposed (the exporter folds A^T, B^T)


@dataclass
class TensorSpec:
    name: str
    dtype: str               # numpy dtype name: "int64", "float32"
    dims: list[Any]          # ints, or strings for symbolic dimensions


@dataclass
class LossSpec:
    kind: str = "causal_lm_cross_entropy"
    shift: bool = True
    ignore_index: int = IGNORE_INDEX
    reduction: str = "sum_times_loss_scale"
    head_chunks: int = 0     # the training graph computes the LM head and its gradient in up to this many row slices
    head_min_rows: int = 0   # of at least this many labelled rows each
    head_vocab_cols: int = 0  # and within a slice, the vocabulary in slices of at most this many entries
    note: str = (
        "loss = loss_scale * sum over positions t with labels[:, t+1] != -100 of "
        "-log softmax(logits[:, t])[labels[:, t+1]]. With loss_scale = 1/count this is exactly "
        "HF's labels loss; the trainer sets loss_scale = 1/(label tokens of the whole effective "
        "batch) so that accumulated gradients equal one big batch's. The training graph computes the "
        "head and its gradient in up to `head_chunks` slices of at least `head_min_rows` labelled rows, and "
        "within each the vocabulary in slices of at most `head_vocab_cols` entries (an online softmax), so no "
        "[N, vocab] tensor exists in training. The eval model also outputs "
        "`logits` [N, vocab] at the N labelled positions, in row-major (batch, position) order."
    )


@dataclass
class QuantizedWeight:
    onnx_name: str           # the float32 tensor the graphs compute (DequantizeLinear's output), named as before
    source_key: str          # the source model's parameter (HF key)
    transposed: bool         # onnx tensor == source parameter transposed (nn.Linear's W.T)
    shape: list[int]         # of the onnx tensor
    codes: str               # initializer of the integer codes (in the shards); uint4 codes [N, K] are read by the
                             # training and eval graphs as uint8 [N, K / 2], the same bytes (since 12-07)
    scale: str               # initializer of the scales
    dtype: str               # "int8" | "uint4"
    axis: int                # the axis a scale runs along: 1 per column, 0 per block of rows
    block: int               # entries per scale block along `axis` (0: one scale per column, or per row if axis 0)
    offset: str = ""         # initializer added per block after scaling (a GGUF Q4_K's -dmin * m), or none
    source_format: str = ""  # the GGUF block format kept exactly (--quant keep: Q8_0, Q5_0, Q6_K, Q4_K)
    codes_transposed: bool = False   # codes, scales and offsets hold the onnx tensor's transpose: a linear weight's
                                     # [out, in] with blocks along in (GGUF's and MatMulNBits' layout; since 12-06)


@dataclass
class QuantSpec:
    mode: str = "none"       # none | int8 | int4 | keep (artifacts_gen/quantize.py)
    block: int = 0           # int4's rows per scale block
    weights: list[QuantizedWeight] = field(default_factory=list)
    calibration: str = ""    # int4 codes chosen by GPTQ on calibration text (--quant-calib): what it ran on
    note: str = ("weight = codes * scale (+ offset) per `block` entries along `axis` of the codes (block 0: one scale "
                 "per column, or per row when axis is 0), transposed if codes_transposed, dequantized in the graphs "
                 "just before each use; linear weights: 4-bit codes [out, in] (codes_transposed) with a scale and "
                 "offset per block of inputs (int4: float16), 8-bit codes [in, out] with one scale per output (int8) or per block "
                 "(keep); keep: a GGUF source's blocks as they are; embedding and LM head: int8 per row (keep: "
                 "their GGUF blocks); LoRA, norms and biases are float32")


@dataclass
class DecoderSpec:
    file: str = ""           # "" in bundles built before 2026-12-05, which have no decoder
    num_layers: int = 0
    kv_heads: int = 0
    head_dim: int = 0
    max_positions: int = 0   # prompt + new tokens may not exceed this
    note: str = ("inputs: input_ids [B, S], attention_mask [B, P + S] (left-padded rows), position_ids [B, S], "
                 "past.{i}.key / past.{i}.value [B, kv_heads, P, head_dim] (P = 0 at prefill), and each trainable LoRA "
                 "tensor by its onnx_name (zeros: the base model); outputs: logits [B, vocab] at the last "
                 "position, present.{i}.key / .value [B, kv_heads, P + S, head_dim]. Frozen weights: the shards")


@dataclass
class FileEntry:
    path: str                # relative to the bundle directory
    bytes: int
    sha256: str
    role: str                # training_model | eval_model | optimizer_model | decoder_model | checkpoint | shard | tokenizer | config


@dataclass
class Manifest:
    family: str
    model: ModelSummary
    seq_len: int             # the default block length for data; graphs accept any length <= max_positions
    traced_seq_len: int      # the length used when tracing (tests run other lengths too)
    opset: int
    lora: LoraSpec
    optimizer: dict[str, Any]        # ort_trainer.optimizer_graph.AdamWSpec baked into optimizer_model.onnx
    trainable: list[Trainable]
    inputs: list[TensorSpec]
    train_outputs: list[str]
    eval_outputs: list[str]
    loss: LossSpec
    special_tokens: dict[str, Any]   # bos/eos/pad token strings and ids, chat_template present?
    files: list[FileEntry]
    tools: dict[str, str]            # versions of what built the bundle
    base_dropout_disabled: bool = True   # base-model dropouts are off (eval mode); LoRA dropout follows lora.dropout
    # The graphs drop padding (attention_mask 0) before the first layer: per-token work scales with the real
    # tokens, not batch x seq. A label whose predicting position is padding counts for nothing (right padding
    # never has one). False in bundles built before 2026-12-01, which compute every padded position.
    padding_free: bool = False
    quant: QuantSpec = field(default_factory=QuantSpec)    # the frozen base's quantization (none before 2026-12-04)
    decoder: DecoderSpec = field(default_factory=DecoderSpec)   # the KV-cache decoder (none before 2026-12-05)
    schema_version: int = SCHEMA_VERSION
    created_by: str = "pocketlora artifacts_gen"

    # -- serialisation -------------------------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=False) + "\n"

    def save(self, bundle_dir: str | Path) -> Path:
        path = Path(bundle_dir) / MANIFEST_NAME
        path.write_text(self.to_json())
        return path

    @classmethod
    def from_dict(cls, data: dict[str, Any], origin: str = MANIFEST_NAME) -> "Manifest":
        if not isinstance(data, dict):
            raise ManifestError(f"{origin}: expected a JSON object at the top level")
        version = data.get("schema_version")
        if version != SCHEMA_VERSION:
            raise ManifestError(
                f"{origin}: schema_version {version!r} is not supported by this trainer "
                f"(it reads version {SCHEMA_VERSION}). Rebuild the bundle with the matching "
                "`pocketlora gen`, or update the device package."
            )
        try:
            kw = _take(cls, data, origin)
            kw["model"] = ModelSummary(**_take(ModelSummary, data["model"], f"{origin}: model"))
            kw["lora"] = LoraSpec(**_take(LoraSpec, data["lora"], f"{origin}: lora"))
            kw["loss"] = LossSpec(**_take(LossSpec, data["loss"], f"{origin}: loss"))
            kw["trainable"] = [Trainable(**_take(Trainable, t, f"{origin}: trainable")) for t in data["trainable"]]
            kw["inputs"] = [TensorSpec(**_take(TensorSpec, t, f"{origin}: inputs")) for t in data["inputs"]]
            kw["files"] = [FileEntry(**_take(FileEntry, f, f"{origin}: files")) for f in data["files"]]
            if "quant" in data:
                q = _take(QuantSpec, data["quant"], f"{origin}: quant")
                q["weights"] = [QuantizedWeight(**_take(QuantizedWeight, w, f"{origin}: quant.weights"))
                                for w in q.get("weights", [])]
                kw["quant"] = QuantSpec(**q)
            if "decoder" in data:
                kw["decoder"] = DecoderSpec(**_take(DecoderSpec, data["decoder"], f"{origin}: decoder"))
        except (TypeError, KeyError) as exc:
            raise ManifestError(f"{origin}: malformed manifest ({exc}); rebuild the bundle") from exc
        for f in kw["files"]:
            parts = f.path.split("/")
            if not f.path or f.path.startswith("/") or "\0" in f.path or "\\" in f.path or ".." in parts:
                raise ManifestError(f"{origin}: files: {f.path!r} is not a path inside the bundle; rebuild the bundle")
        return cls(**kw)

    @classmethod
    def load(cls, bundle_dir: str | Path) -> "Manifest":
        path = Path(bundle_dir) / MANIFEST_NAME
        if not path.is_file():
            raise ManifestError(
                f"{path}: no manifest. Is {bundle_dir} a bundle made by `pocketlora gen`?"
            )
        try:
            data = json.loads(path.read_bytes())
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ManifestError(f"{path}: not valid JSON ({exc}); the bundle is damaged, rebuild it") from exc
        return cls.from_dict(data, str(path))

    # -- convenience ---------------------------------------------------------------------------
    def files_with_role(self, role: str) -> list[FileEntry]:
        return [f for f in self.files if f.role == role]

    @property
    def trainable_names(self) -> list[str]:
        return [t.onnx_name for t in self.trainable]


def _take(cls, data: dict[str, Any], origin: str) -> dict[str, Any]:
    """The known fields of `cls` from `data`; a missing required field is an error."""
    if not isinstance(data, dict):
        raise ManifestError(f"{origin}: expected an object, got {type(data).__name__}")
    missing = [f.name for f in fields(cls) if f.name not in data and f.default is MISSING and f.default_factory is MISSING]
    if missing:
        raise ManifestError(f"{origin}: missing field(s) {', '.join(missing)}; rebuild the bundle")
    kw = {f.name: data[f.name] for f in fields(cls) if f.name in data}
    hints = get_type_hints(cls)
    for name, value in kw.items():
        if not _fits(value, hints[name]):
            shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:40] + "..."
            raise ManifestError(f"{origin}: {name} is {shown}, not of type {_type_name(hints[name])}; the manifest "
                                "is damaged: rebuild the bundle")
    return kw


def _fits(value: Any, tp: Any) -> bool:
    """Whether a JSON value has the field's declared type (nested dataclasses are checked when built)."""
    if tp is Any or is_dataclass(tp):
        return True
    origin, args = get_origin(tp), get_args(tp)
    if origin in (Union, UnionType):
        return any(_fits(value, a) for a in args)
    if origin is list:
        return isinstance(value, list) and (not args or all(_fits(v, args[0]) for v in value))
    if origin is dict:
        return isinstance(value, dict) and all(_fits(k, args[0]) and _fits(v, args[1]) for k, v in value.items())
    if tp is type(None):
        return value is None
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, tp)


def _type_name(tp: Any) -> str:
    return re.sub(r"\b(?:\w+\.)+(\w+)", r"\1", getattr(tp, "__name__", None) if get_origin(tp) is None else str(tp))
