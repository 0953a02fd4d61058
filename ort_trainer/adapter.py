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
from . import checkpoint
from .bundle import Bundle
from .faults import InputError, native_writes, write_atomic


def load_lora(checkpoint: str | Path, manifest: mf.Manifest) -> dict[str, np.ndarray]:
    """ONNX name -> trained tensor, read from an ORT checkpoint (no session needed), or from the web runner's
    safetensors checkpoint (the LoRA tensors by ONNX name, beside AdamW's moments)."""
    if Path(checkpoint).suffix == ".safetensors":
        from safetensors.numpy import load_file

        tensors = load_file(str(checkpoint))
        get = tensors.__getitem__
        names = set(tensors)
    else:
        from .ort_training import CheckpointState

        params = CheckpointState.load_checkpoint(str(checkpoint)).parameters
        get = lambda n: params[n].data           # noqa: E731
        names = {n for n in manifest.trainable_names if n in params}
    missing = [n for n in manifest.trainable_names if n not in names]
    if missing:
        raise InputError(f"{checkpoint}: has no LoRA tensor {missing[0]} ({len(missing)} missing): it was trained on a "
                         "bundle with other LoRA targets. Use the bundle the run was trained on.")
    return {n: get(n) for n in manifest.trainable_names}


def read_safetensors(path: str | Path) -> dict[str, np.ndarray]:
    """A safetensors file's tensors, or InputError naming the file when it is not a readable one."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    try:
        return load_file(str(path))
    except SafetensorError as exc:
        raise InputError(f"{path}: not a readable safetensors file ({exc}). It is damaged or incomplete: copy "
                         "it again.") from exc


# ------------------------------------------------------------------ where an adapter comes from
def initial_lora(bundle: Bundle) -> dict[str, np.ndarray]:
    """The bundle's initial checkpoint (PEFT's init: B = 0, so exactly the base model)."""
    return load_lora(bundle.file(mf.CHECKPOINT), bundle.manifest)


def _check_run_bundle(run_dir: Path, manifest: mf.Manifest) -> None:
    """A run trained on another bundle may have tensors of the same shapes but another LoRA scaling or
    targets: refuse it when the run's own bundle (run.json) is still there and differs."""
    try:
        run_bundle = json.loads((run_dir / "run.json").read_text())["bundle"]
        theirs = mf.Manifest.load(run_bundle)
    except (OSError, KeyError, ValueError):
        return                                   # no run.json or its bundle moved: shapes are still checked
    if (theirs.lora.r, theirs.lora.alpha, theirs.lora.target_modules, theirs.trainable_names, theirs.model.source) != \
            (manifest.lora.r, manifest.lora.alpha, manifest.lora.target_modules, manifest.trainable_names,
             manifest.model.source):
        raise ValueError(f"{run_dir} was trained on the bundle {run_bundle}, whose model or LoRA settings differ from "
                         "--bundle's; pass the bundle the run was trained on")


def lora_from_run(run_dir: str | Path, manifest: mf.Manifest, warn=print) -> tuple[dict[str, np.ndarray], int]:
    """(ONNX name -> tensor, step) from the newest good checkpoint of a `pocketlora train` run."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"{run_dir}: no such run directory (the --out of `pocketlora train`)")
    _check_run_bundle(run_dir, manifest)
    found = checkpoint.latest(run_dir, warn=warn)
    if found is None:
        raise FileNotFoundError(f"{run_dir}: no checkpoint yet; train at least one step first")
    path, state = found
    return load_lora(checkpoint.weights_file(path, state), manifest), int(state["step"])


def _check_adapter_config(cfg: dict, manifest: mf.Manifest, origin: str) -> None:
    """The eval graph bakes in r and alpha/r (the targeted modules are checked through the keys)."""
    lora = manifest.lora
    problems = []
    if cfg.get("peft_type", "LORA") != "LORA":
        problems.append(f"peft_type {cfg.get('peft_type')!r} is not LORA")
    if "r" in cfg and int(cfg["r"]) != lora.r:
        problems.append(f"r={cfg['r']} but the bundle has r={lora.r}")
    if "lora_alpha" in cfg and float(cfg["lora_alpha"]) != float(lora.alpha):
        problems.append(f"lora_alpha={cfg['lora_alpha']} but the bundle has alpha={lora.alpha}")
    for flag in ("use_rslora", "use_dora", "rank_pattern", "alpha_pattern"):
        if cfg.get(flag):
            problems.append(f"{flag}={cfg[flag]!r} is not supported by the bundle's graphs")
    if problems:
        raise ValueError(f"{origin}: adapter does not fit this bundle: {'; '.join(problems)}")


def _few(keys: list[str]) -> str:
    return ", ".join(keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "") if keys else "none"


def lora_from_peft(peft_dir: str | Path, manifest: mf.Manifest) -> dict[str, np.ndarray]:
    """ONNX name -> tensor (ONNX layout) from a PEFT directory (adapter_model.safetensors).

    Keys are mapped through the manifest's `trainable` list; tensors marked `transposed` are
    transposed. The adapter must have exactly the bundle's LoRA tensors with matching shapes and
    the same r / alpha (they are baked into the graph).
    """
    from ort_trainer.adapter import read_safetensors
    from ort_trainer.faults import read_json

    d = Path(peft_dir)
    weights = d / "adapter_model.safetensors"
    if not weights.is_file():
        raise FileNotFoundError(f"{weights}: not found; --peft takes a PEFT adapter directory "
                                "(adapter_config.json + adapter_model.safetensors)")
    if (d / "adapter_config.json").is_file():
        _check_adapter_config(read_json(d / "adapter_config.json"), manifest, str(d))
    state = read_safetensors(weights)
    # PEFT saves keys without the adapter name; tolerate a ".default" left in by hand-made files.
    state = {k.replace(".default.", "."): v for k, v in state.items()}
    want = {t.peft_key: t for t in manifest.trainable}
    unknown = sorted(set(state) - set(want))
    missing = sorted(set(want) - set(state))
    if unknown or missing:
        raise ValueError(f"{weights}: LoRA keys do not match the bundle: missing {_few(missing)}, "
                         f"unknown {_few(unknown)}")
    out = {}
    for key, t in want.items():
        arr = np.asarray(state[key], dtype=np.float32)
        arr = arr.T if t.transposed else arr
        if list(arr.shape) != list(t.shape):
            raise ValueError(f"{weights}: {key} has shape {list(state[key].shape)}, the bundle expects "
                             f"{t.shape[::-1] if t.transposed else t.shape}")
        out[t.onnx_name] = np.ascontiguousarray(arr)
    return out


def resolve_lora(bundle: Bundle, run: str | Path | None = None, peft: str | Path | None = None,
                 warn=print) -> tuple[dict[str, np.ndarray], str]:
    """LoRA (ONNX names) for --run / --peft / neither (the bundle's initial weights), and a label."""
    if run is not None and peft is not None:
        raise ValueError("give at most one of --run and --peft")
    if run is not None:
        lora, step = lora_from_run(run, bundle.manifest, warn=warn)
        return lora, f"run {run} (step {step})"
    if peft is not None:
        return lora_from_peft(peft, bundle.manifest), f"PEFT adapter {peft}"
    return initial_lora(bundle), "bundle initial weights (base model)"


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
