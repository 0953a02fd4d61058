"""Build a training bundle: checkpoint -> PEFT LoRA -> ONNX -> graph fixes -> shards -> ORT artifacts -> manifest.

Everything is written into a hidden staging directory beside the output and renamed into
place at the end, so a failed run leaves nothing behind.
"""
from __future__ import annotations

import contextlib
import copy
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from ort_trainer import manifest as mf
from ort_trainer.bundle import sha256_file
from ort_trainer.faults import environment_fault, native_writes
from ort_trainer.optimizer_graph import AdamWSpec, write_adamw
from ort_trainer.versions import tool_versions

from . import decoder, fast_dequant, graph_fixes, head_loss, quantize, recompute, slow_kernels
from .export import CausalLMWithLoss, LoraSettings, export_forward, lora_tensors, make_peft_model, set_placeholders
from .shards import MIN_EXTERNAL_BYTES, write_shards
from .source import load_source, max_positions
from .web_graphs import ROLES as WEB_ROLES, write_web_files

TRACE_LEN_MAX = 32   # the trace length: short, and deliberately not the bundle's seq-len


class BundleExists(FileExistsError):
    pass


@dataclass
class BuildResult:
    manifest: mf.Manifest
    out: Path
    seconds: float
    bundle_bytes: int
    trainable_params: int

    def summary(self) -> str:
        m = self.manifest
        return (
            f"bundle {self.out}\n"
            f"  family {m.family} ({m.model.architecture}), {m.model.num_layers} layers, "
            f"hidden {m.model.hidden_size}, vocab {m.model.vocab_size}\n"
            f"  trainable (LoRA r={m.lora.r}, {m.lora.targets}): {self.trainable_params:,} params "
            f"in {len(m.trainable)} tensors; frozen: {m.model.frozen_params:,} params "
            f"in {len(m.files_with_role('shard'))} shard file(s)\n"
            f"  on disk {self.bundle_bytes / 2**20:.1f} MB, built in {self.seconds:.1f} s"
        )


def check_out_dir(out: Path, force: bool) -> None:
    if not out.exists():
        return
    if not out.is_dir():
        raise BundleExists(f"--out {out}: exists and is not a directory. Choose another --out.")
    if not any(out.iterdir()):
        return
    if force:
        return
    if (out / mf.MANIFEST_NAME).is_file():
        try:
            old = mf.Manifest.load(out)
            what = f"a {old.family} bundle built from {old.model.source}"
        except mf.ManifestError:
            what = "a bundle"
        raise BundleExists(f"--out {out}: already holds {what}. Choose another --out, or pass --force to replace it.")
    raise BundleExists(f"--out {out}: is not empty and is not a bundle. Choose an empty or new directory.")


@contextlib.contextmanager
def _cwd(path: Path):
    old = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(old)


@contextlib.contextmanager
def _native_stderr_to(log_path: Path):
    """Send fd 2 to `log_path` while ORT's C++ gradient builder runs: it logs every graph transformer at
    INFO level whatever the Python-side severity, ~350 lines per build. On failure the log's tail is
    appended to the error, so nothing is hidden."""
    import sys

    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(log_path, "wb") as f:
            os.dup2(f.fileno(), 2)
            try:
                with native_writes(log_path.parent):   # a native write's errno (full disk) is an OSError
                    yield
            except OSError:
                raise
            except Exception as e:
                os.dup2(saved, 2)
                tail = log_path.read_text(errors="replace").splitlines()[-20:]
                raise RuntimeError(f"{e}\nORT's native log ({log_path.name}), last lines:\n" + "\n".join(tail)) from e
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _source_tensors(peft_model) -> dict[str, np.ndarray]:
    """HF key -> frozen weight, PEFT key -> LoRA placeholder; numpy views, no copies."""
    out = {}
    for name, p in peft_model.named_parameters():
        arr = p.detach().numpy()
        if "lora_" in name:
            out[name.replace(".default", "")] = arr
        else:
            out[name.removeprefix("base_model.model.").replace(".base_layer", "")] = arr
    return out


def build_bundle(
    model_path: str | os.PathLike,
    out: str | os.PathLike,
    *,
    gguf_file: str | None = None,
    lora: LoraSettings | None = None,
    seq_len: int = 128,
    shard_mb: int = 256,
    head_chunks: int | None = None,
    head_min_rows: int | None = None,
    head_vocab_cols: int | None = None,
    quant: str | None = None,
    quant_block: int = quantize.INT4_BLOCK,
    quant_calib: str | os.PathLike | None = None,
    quant_calib_tokens: int | None = None,
    force: bool = False,
    log=print,
) -> BuildResult:
    lora = lora or LoraSettings()
    out = Path(out).absolute()
    t0 = time.time()
    plain_log = log

    def log(msg: str) -> None:
        plain_log(f"{msg}  [{time.time() - t0:.0f} s]" if msg.startswith("[") else msg)
    check_out_dir(out, force)
    if lora.r < 1 or lora.alpha <= 0 or not 0 <= lora.dropout < 1:
        raise ValueError(f"LoRA settings r={lora.r} alpha={lora.alpha} dropout={lora.dropout}: need r >= 1, alpha > 0, 0 <= dropout < 1.")

    head_chunks = head_loss.DEFAULT_CHUNKS if head_chunks is None else head_chunks
    if not 1 <= head_chunks <= 64:
        raise ValueError(f"--head-chunks {head_chunks}: use 1 to 64 (1 = the whole head at once, fastest; more = less memory).")
    head_min_rows = head_loss.MIN_ROWS if head_min_rows is None else head_min_rows
    if head_min_rows < 1:
        raise ValueError(f"--head-min-rows {head_min_rows}: use 1 or more (default {head_loss.MIN_ROWS}; fewer rows "
                         "per slice = less memory, more passes over the head weight).")
    head_vocab_cols = head_loss.VOCAB_COLS if head_vocab_cols is None else head_vocab_cols
    if head_vocab_cols < head_loss.VOCAB_ALIGN:
        raise ValueError(f"--head-vocab-cols {head_vocab_cols}: use {head_loss.VOCAB_ALIGN} or more (default "
                         f"{head_loss.VOCAB_COLS}; fewer = less memory, smaller GEMMs).")

    if quant is not None:
        quantize.check_mode(quant, quant_block)
    calib = quantize.calibration_source(quant, quant_calib, quant_calib_tokens)   # int4 is never a default mode

    log("[1/5] loading checkpoint")
    src = load_source(model_path, gguf_file, seq_len)
    quant = quant or (quantize.DEFAULT_FOR_GGUF if src.gguf_file else "none")
    exact = None
    if quant == "keep":
        if not src.gguf_file:
            raise quantize.QuantError(f"--quant keep: {src.description} is not a GGUF file; keep holds a GGUF's own "
                                      "blocks. Use --quant int8 or int4 (or none).")
        from .gguf_exact import read_exact

        exact = read_exact(Path(src.path) / src.gguf_file)
    calibration = None
    if calib is not None:
        from .gptq import calibrate

        log(f"      calibrating int4 (GPTQ): {'text sampled from the model' if calib == quantize.SELF_CALIB else calib}")
        calibration = calibrate(src.model, src.tokenizer, calib, seq_len, quant_calib_tokens)
        log(f"      {calibration.description}, {len(calibration.hessians)} layers' inputs")
    fam, config = src.family, src.model.config
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        for left in _leftovers(out):
            log(f"      removing {left.name}, left by an interrupted build")
            shutil.rmtree(left, ignore_errors=True)
        stage = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-{os.getpid()}-", dir=out.parent))
    except OSError as exc:
        if environment_fault(exc):       # e.g. a read-only --out: name it, not the staging directory
            raise OSError(exc.errno, exc.strerror, str(out)) from exc
        raise
    stage.chmod(0o755)
    try:
        log(f"[2/5] exporting {fam.name} with LoRA r={lora.r} on {lora.targets} (opset {fam.opset})")
        peft_model, peft_config = make_peft_model(src.model, fam, lora)
        initial = lora_tensors(peft_model)            # PEFT's own init: A Kaiming-uniform, B zero
        set_placeholders(peft_model, lora.seed)
        traced_len = min(TRACE_LEN_MAX, max(8, seq_len // 2))
        trace_dir = stage / "trace"
        trace_dir.mkdir()
        export_forward(CausalLMWithLoss(peft_model, fam), fam, trace_dir / "forward.onnx", traced_len)
        forward = onnx.load(str(trace_dir / "forward.onnx"))

        log("[3/5] graph checks and fixes")
        n_split = len(graph_fixes.split_value_merges(forward))
        naming = graph_fixes.name_initializers(forward, _source_tensors(peft_model))
        untied = graph_fixes.untie_head(forward)
        graph_fixes.constants_to_initializers(forward, MIN_EXTERNAL_BYTES)
        n_where = graph_fixes.drop_causal_where(forward)
        n_ln = graph_fixes.layernorm_stats(forward)
        train = graph_fixes.trainables(naming, list(initial), forward)
        graph_fixes.write_initial_lora(forward, train, initial)
        frozen_params = sum(p.numel() for n, p in peft_model.named_parameters() if "lora_" not in n)
        log(f"      {len(naming.renamed)} weights named, {len(train)} LoRA tensors one-for-one with PEFT, "
            f"LM head as Gemm(h, W[V, H]): {bool(untied)}, LayerNorm stats added: {n_ln}, "
            f"redundant causal Where removed: {n_where}"
            + (f", equal-valued weights kept distinct: {n_split}" if n_split else ""))

        forward, quantized = quantize.quantize_forward(forward, quant, quant_block, {t.onnx_name for t in train},
                                                       graph_fixes.TRANSPOSED, exact, calibration)
        if quantized:
            log(f"      {quantize.describe(quant, quant_block, quantized)}, dequantized just in time")

        log("[4/5] writing shards and ORT training artifacts")
        plan = write_shards(forward, stage, {t.onnx_name for t in train}, shard_mb)
        graph_fixes.check_untied_head(forward)
        if plan.oversize:
            log(f"      note: {', '.join(plan.oversize)} exceed(s) --shard-mb {shard_mb}; ONNX external data cannot "
                "split a tensor, so each is stored alone in its own shard file")
        log("      decoder graph: prefill and decode with a KV cache, over the same shards")
        _write_decoder(peft_model, fam, stage, trace_dir, forward, train, quant, quant_block, exact, calibration)
        del peft_model, src.model
        shutil.rmtree(trace_dir)
        softcap = getattr(config, fam.softcap_key, None) if fam.softcap_key else None
        log(f"      training graph: LM head + loss in up to {head_chunks} slices of >= {head_min_rows} labelled rows, "
            f"vocabulary in slices of <= {head_vocab_cols}")
        _generate_artifacts(forward, stage, [t.onnx_name for t in train], head_chunks, head_min_rows, head_vocab_cols,
                            float(softcap) if softcap else None, quantized)
        _check_artifacts(stage, plan.files)
        write_web_files(stage, [t.onnx_name for t in train])     # the web runner's gradient graph + initial LoRA

        log("[5/5] tokenizer, config and manifest")
        src.tokenizer.save_pretrained(stage / mf.TOKENIZER_DIR)
        config.to_json_file(stage / mf.CONFIG)
        manifest = mf.Manifest(
            family=fam.name,
            model=mf.ModelSummary(
                family=fam.name,
                architecture=fam.architectures[0],
                num_layers=int(config.num_hidden_layers),
                hidden_size=int(config.hidden_size),
                vocab_size=int(config.vocab_size),
                max_positions=max_positions(fam, config),
                tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", True)),
                frozen_params=int(frozen_params),
                source=src.description,
            ),
            seq_len=seq_len,
            traced_seq_len=traced_len,
            padding_free=True,              # export.CausalLMWithLoss + packing.py
            opset=next(o.version for o in forward.opset_import if o.domain in ("", "ai.onnx")),
            lora=mf.LoraSpec(
                r=lora.r,
                alpha=float(lora.alpha),
                dropout=float(lora.dropout),
                targets=lora.targets,
                target_modules=sorted(peft_config.target_modules),
                fan_in_fan_out=fam.fan_in_fan_out,
            ),
            trainable=train,
            inputs=[
                mf.TensorSpec("input_ids", "int64", ["batch", "seq"]),
                mf.TensorSpec("attention_mask", "int64", ["batch", "seq"]),
                mf.TensorSpec("labels", "int64", ["batch", "seq"]),
                mf.TensorSpec("loss_scale", "float32", []),
            ],
            optimizer=AdamWSpec().to_dict(),
            train_outputs=["loss"],
            eval_outputs=["loss", "logits"],
            loss=mf.LossSpec(head_chunks=head_chunks, head_min_rows=head_min_rows, head_vocab_cols=head_vocab_cols),
            quant=mf.QuantSpec(mode=quant, block=quant_block if quant == "int4" else 0, weights=quantized,
                               calibration=calibration.description if calibration else ""),
            decoder=decoder.decoder_spec(config, max_positions(fam, config)),
            special_tokens=_special_tokens(src.tokenizer),
            files=_file_entries(stage),
            tools=tool_versions(),
        )
        manifest.save(stage)
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        if out.exists():                  # --force: the old bundle steps aside, the new one takes its name
            os.replace(out, old)
        os.replace(stage, out)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException as exc:
        shutil.rmtree(stage, ignore_errors=True)
        if environment_fault(exc):       # name --out, not the staging file (often no file: a buffered write)
            raise OSError(exc.errno, exc.strerror, str(out)) from exc
        raise
    total = sum(f.bytes for f in manifest.files)
    return BuildResult(manifest, out, time.time() - t0, total, int(sum(np.prod(t.shape) for t in train)))


def _leftovers(out: Path) -> list[Path]:
    """Staging (and replaced) directories of `out` whose build was killed: their process is gone."""
    found, prefix = [], f".{out.name}."
    for path in out.parent.iterdir():
        if not path.name.startswith(prefix):
            continue
        kind, _, rest = path.name[len(prefix):].partition("-")
        pid = rest.split("-")[0]
        if kind in ("partial", "old") and pid.isdigit() and not _alive(int(pid)):
            found.append(path)
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _write_decoder(peft_model, fam, stage: Path, trace_dir: Path, sharded: onnx.ModelProto, train: list[mf.Trainable],
                   quant: str, quant_block: int, exact: dict | None, calibration=None) -> None:
    """Trace the decoder from the same PEFT model (its LoRA still holds the placeholders the forward was traced with,
    so names match by value), fix and quantize it like the forward, and point its weights at the shards."""
    decoder.export_decoder(peft_model, fam, trace_dir / "decoder.onnx")
    model = onnx.load(str(trace_dir / "decoder.onnx"))
    model = decoder.fix_decoder(model, _source_tensors(peft_model), train, quant, quant_block, exact, calibration)
    decoder.link_to_shards(model, sharded, stage, {t.onnx_name for t in train})
    onnx.save(model, str(stage / mf.DECODER_MODEL))


def _generate_artifacts(forward: onnx.ModelProto, stage: Path, requires_grad: list[str], head_chunks: int,
                        head_min_rows: int, head_vocab_cols: int, softcap: float | None,
                        quantized: list[mf.QuantizedWeight]) -> None:
    """ORT builds the training and optimizer models from the forward with its head in row and vocabulary
    slices (head_loss.chunk_head_loss; only the loss is a training output). The eval model is the plain
    forward, which also outputs the logits at the labelled positions.

    The frozen weights are neither requires_grad nor frozen_params, so they stay graph
    initializers (pointing at the shards) and the checkpoint holds the LoRA tensors only.
    """
    import onnxruntime
    from onnxruntime.training import artifacts
    from onnxruntime.training.onnxblock import _training_graph_utils as tgu

    onnxruntime.set_default_logger_severity(3)
    eval_model = copy.deepcopy(forward)           # weights are external by now: a small proto
    train_forward = copy.deepcopy(forward)
    outputs = [o for o in train_forward.graph.output if o.name != "logits"]
    del train_forward.graph.output[:]
    train_forward.graph.output.extend(outputs)
    head_loss.chunk_head_loss(train_forward, head_chunks, head_min_rows, softcap, head_vocab_cols)
    train_forward = graph_fixes.known_shapes(train_forward)
    log_path = stage / "ort-native.log"   # removed below; on failure with the staging directory
    with _cwd(stage), _native_stderr_to(log_path):   # external data locations are relative to the staging dir
        artifacts.generate_artifacts(
            train_forward,
            requires_grad=requires_grad,
            frozen_params=[],
            loss=None,
            optimizer=None,
            artifact_directory=".",
        )
    log_path.unlink(missing_ok=True)
    train_path = stage / mf.TRAINING_MODEL
    training = onnx.load(str(train_path), load_external_data=False)
    changed = any(slow_kernels.replace_slow_kernels(training).values())
    changed |= recompute.recompute_activations(training) > 0      # after them: it reads their backward nodes
    changed |= quantize.recompute_dequantized(training, [q.onnx_name for q in quantized]) > 0
    changed |= quantize.fuse_transposes(training) > 0             # the recomputed copies' Transposes too
    linear_codes = {q.codes for q in quantized if not quantize.is_vocab(q)}
    changed |= fast_dequant.rewrite(training, linear_codes, str(stage)) > 0    # last: every copy's dequantization
    if changed:
        onnx.save(training, str(train_path))
    write_adamw(stage / mf.OPTIMIZER_MODEL, AdamWSpec())
    # What generate_artifacts does to its eval model: trainable initializers become inputs, training mode off.
    tgu._move_initializers_to_inputs(eval_model, set(requires_grad))
    tgu._disable_training_mode(eval_model)
    quantize.fuse_transposes(eval_model)
    fast_dequant.rewrite(eval_model, linear_codes, str(stage))
    onnx.save(eval_model, str(stage / mf.EVAL_MODEL))


def _check_artifacts(stage: Path, shard_files: list[str]) -> None:
    """Both graphs reference the shards for every large weight (no inlined base model), and ORT
    loads the artifacts the way the device will. (onnx.checker cannot judge the training graph:
    ORT's fusions add contrib ops such as SimplifiedLayerNormalization.)"""
    for name in (mf.TRAINING_MODEL, mf.EVAL_MODEL, mf.DECODER_MODEL):
        model = onnx.load(str(stage / name), load_external_data=False)
        inline = [i.name for i in model.graph.initializer
                  if i.data_location != onnx.TensorProto.EXTERNAL and numpy_helper.to_array(i).nbytes >= (1 << 20)]
        if inline:
            raise RuntimeError(f"{name}: {len(inline)} large initializers are inline, e.g. {inline[0]}")
        missing = {e.value for i in model.graph.initializer for e in i.external_data if e.key == "location"} - set(shard_files)
        if missing:
            raise RuntimeError(f"{name}: external data points at unknown files {sorted(missing)}")
    onnx.checker.check_model(str(stage / mf.EVAL_MODEL))
    from onnxruntime.training.api import CheckpointState, Module, Optimizer

    state = CheckpointState.load_checkpoint(str(stage / mf.CHECKPOINT))
    module = Module(str(stage / mf.TRAINING_MODEL), state, str(stage / mf.EVAL_MODEL))
    Optimizer(str(stage / mf.OPTIMIZER_MODEL), module)
    del module, state
    import onnxruntime

    onnxruntime.InferenceSession(str(stage / mf.DECODER_MODEL), providers=["CPUExecutionProvider"])


def _special_tokens(tok) -> dict:
    out = {"chat_template": bool(getattr(tok, "chat_template", None))}
    for kind in ("bos", "eos", "pad", "unk"):
        token = getattr(tok, f"{kind}_token", None)
        out[f"{kind}_token"] = token
        out[f"{kind}_id"] = tok.convert_tokens_to_ids(token) if token is not None else None
    return out


ROLES = {
    mf.TRAINING_MODEL: "training_model",
    mf.EVAL_MODEL: "eval_model",
    mf.OPTIMIZER_MODEL: "optimizer_model",
    mf.DECODER_MODEL: "decoder_model",
    mf.CHECKPOINT: "checkpoint",
    mf.CONFIG: "config",
    **WEB_ROLES,
}


def _file_entries(stage: Path) -> list[mf.FileEntry]:
    entries = []
    for path in sorted(p for p in stage.rglob("*") if p.is_file()):
        rel = path.relative_to(stage).as_posix()
        role = ROLES.get(rel) or ("shard" if rel.startswith("weights-") else "tokenizer" if rel.startswith(mf.TOKENIZER_DIR + "/") else None)
        if role is None:
            raise RuntimeError(f"unexpected file in bundle: {rel}")
        entries.append(mf.FileEntry(rel, path.stat().st_size, sha256_file(path), role))
    return entries
