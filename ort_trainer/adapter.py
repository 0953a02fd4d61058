"""Get a trained adapter out: a PEFT directory, or one ONNX model for plain onnxruntime.

PEFT: adapter_config.json + adapter_model.safetensors, loadable by
`peft.PeftModel.from_pretrained(base_model, OUT_DIR)`. The ONNX tensors are mapped back to
PEFT's keys and layout through the manifest.

ONNX: the eval graph with the trained LoRA tensors baked in as constants and the frozen weights
written beside it as `<name>.onnx.data`, so the file set runs on its own with
`onnxruntime.InferenceSession`. Same inputs as the bundle's eval model; see `manifest.LossSpec`
for how `labels` selects the positions whose logits are returned.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from . import manifest as mf
from .bundle import Bundle
from .faults import InputError, native_writes, write_atomic


def load_lora(checkpoint: str | Path, manifest: mf.Manifest) -> dict[str, np.ndarray]:
    """ONNX name -> trained tensor, read from an ORT checkpoint (no session needed), or from the web runner's
    safetensors checkpoint (the LoRA tensors by ONNX name, beside AdamW's moments)."""
    if Path(checkpoint).suffix == ".safetensors":
        from safetensors.numpy import load_file

        tensors = load_file(str(checkpoint))
        return {n: tensors[n] for n in manifest.trainable_names}
    from .ort_training import CheckpointState

    params = CheckpointState.load_checkpoint(str(checkpoint)).parameters
    return {n: params[n].data for n in manifest.trainable_names}


def read_safetensors(path: str | Path) -> dict[str, np.ndarray]:
    """A safetensors file's tensors, or InputError naming the file when it is not a readable one."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    try:
        return load_file(str(path))
    except SafetensorError as exc:
        raise InputError(f"{path}: not a readable safetensors file ({exc}). It is damaged or incomplete: copy "
                         "it again.") from exc


def to_peft(manifest: mf.Manifest, lora: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {
        t.peft_key: np.ascontiguousarray(lora[t.onnx_name].T if t.transposed else lora[t.onnx_name])
        for t in manifest.trainable
    }


def adapter_config(manifest: mf.Manifest) -> dict:
    lora = manifest.lora
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": manifest.model.source,
        "r": lora.r,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": lora.target_modules,
        "fan_in_fan_out": lora.fan_in_fan_out,
        "bias": "none",
        "inference_mode": True,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
    }


def export_peft(manifest: mf.Manifest, lora: dict[str, np.ndarray], out_dir: str | Path) -> Path:
    from safetensors.numpy import save_file

    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"--peft {out}: exists and is not a directory. Choose another path.")
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / ".adapter_model.safetensors.tmp"
    try:
        with native_writes(out / "adapter_model.safetensors"):     # safetensors reports a full disk in its text
            save_file(to_peft(manifest, lora), str(tmp), metadata={"format": "pt"})
        os.replace(tmp, out / "adapter_model.safetensors")
    finally:
        tmp.unlink(missing_ok=True)
    write_atomic(out / "adapter_config.json", json.dumps(adapter_config(manifest), indent=2) + "\n")
    return out


def export_onnx(bundle: Bundle, lora: dict[str, np.ndarray], out_path: str | Path) -> Path:
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    model = onnx.load(str(bundle.file(mf.EVAL_MODEL)), load_external_data=True)
    names = set(lora)
    inputs = [i for i in model.graph.input if i.name not in names]
    del model.graph.input[:]
    model.graph.input.extend(inputs)
    model.graph.initializer.extend(
        numpy_helper.from_array(np.ascontiguousarray(v, dtype=np.float32), n) for n, v in lora.items()
    )
    data_name = out.name + ".data"
    # Both files are written in a directory beside them and renamed into place: a full disk or a kill leaves
    # the previous export (or none), never a model whose data file is cut short.
    stage = None
    try:
        stage = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
        onnx.save(model, str(stage / out.name), save_as_external_data=True, all_tensors_to_one_file=True,
                  location=data_name, size_threshold=1024)
        os.replace(stage / data_name, out.parent / data_name)
        os.replace(stage / out.name, out)
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror, str(out)) from exc
    finally:
        if stage is not None:
            shutil.rmtree(stage, ignore_errors=True)
    return out
