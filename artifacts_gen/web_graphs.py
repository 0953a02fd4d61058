"""The web runner's files, derived from a finished bundle (android_runner/web, onnxruntime-web 1.19.2).

onnxruntime-web's TrainingSession cannot mount the bundle's external-data shards, exposes no learning-rate
setter and no optimizer-state read-out, so the web runner does not use it. It runs plain InferenceSessions
of the training WASM build and owns the LoRA tensors, gradients, AdamW moments and step itself:

web_training_model.onnx
    training_model.onnx with ORT's gradient accumulation taken out. The training graph adds each LoRA
    gradient into a `<param>_grad.accumulation.buffer` input with InPlaceAccumulatorV2 (reset by the
    `lazy_reset_grad` input) and outputs only a flag; here every accumulator node is removed and the
    gradient it consumed, `<param>_grad`, is a graph output instead. Inputs: input_ids, attention_mask,
    labels, loss_scale and the LoRA tensors (manifest.trainable order); outputs: loss, then one gradient
    per LoRA tensor in the same order. Everything else (frozen weights in the same shard files, the
    chunked head, recomputation) is the training graph unchanged, so the per-micro-batch gradient is the
    one the Python runner accumulates; the runner sums them itself (float32, the accumulator's arithmetic).

web_lora_init.safetensors
    The LoRA tensors of the bundle's checkpoint (ORT flatbuffer, which the web runner does not parse),
    float32, keyed by ONNX name, in the ONNX layout. safetensors: an 8-byte little-endian header length,
    a JSON header {name: {dtype, shape, data_offsets}}, then the raw bytes.

`pocketlora gen` writes both into every bundle (roles `web_training_model` and `web_lora_init` in the
manifest). `python -m artifacts_gen.web_graphs BUNDLE` adds them to a bundle built before (`add_to_bundle`).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ort_trainer import manifest as mf

ROLES = {mf.WEB_TRAINING_MODEL: "web_training_model", mf.WEB_LORA_INIT: "web_lora_init"}
ACCUMULATOR = "InPlaceAccumulatorV2"
RESET_INPUT = "lazy_reset_grad"


class WebGraphError(ValueError):
    pass


def gradient_graph(training_model, trainable_names: list[str]):
    """The training graph (onnx.ModelProto, external data not loaded) -> the gradient graph, in place."""
    import onnx

    g = training_model.graph
    grad_of: dict[str, str] = {}        # param -> the gradient tensor its accumulator consumed
    drop_inputs, drop_outputs, keep_nodes = {RESET_INPUT}, set(), []
    for node in g.node:
        if node.op_type != ACCUMULATOR:
            keep_nodes.append(node)
            continue
        buffer, grad = node.input[0], node.input[1]
        suffix = "_grad.accumulation.buffer"
        if not buffer.endswith(suffix):
            raise WebGraphError(f"{node.name}: unexpected accumulation buffer name {buffer!r}")
        grad_of[buffer[: -len(suffix)]] = grad
        drop_inputs.add(buffer)
        drop_outputs.update(node.output)
    missing = [n for n in trainable_names if n not in grad_of]
    if missing:
        raise WebGraphError(f"no gradient accumulator for {missing[:3]} ({len(missing)} LoRA tensors)")
    del g.node[:]
    g.node.extend(keep_nodes)
    still_read = {i for n in g.node for i in n.input}
    if still_read & drop_inputs:
        raise WebGraphError(f"inputs still read after removing the accumulators: {sorted(still_read & drop_inputs)[:3]}")
    inputs = [i for i in g.input if i.name not in drop_inputs]
    del g.input[:]
    g.input.extend(inputs)
    outputs = [o for o in g.output if o.name not in drop_outputs]
    shapes = {i.name: i for i in g.input}
    for name in trainable_names:
        src = shapes[name].type.tensor_type
        out_name = name + "_grad"
        if grad_of[name] != out_name:     # give every gradient output the predictable name
            g.node.append(onnx.helper.make_node("Identity", [grad_of[name]], [out_name], name=f"web_grad/{name}"))
        outputs.append(onnx.helper.make_tensor_value_info(
            out_name, src.elem_type, [d.dim_value if d.HasField("dim_value") else d.dim_param for d in src.shape.dim]))
    del g.output[:]
    g.output.extend(outputs)
    return training_model


def write_web_files(bundle_dir: str | Path, trainable_names: list[str]) -> None:
    """Write web_training_model.onnx and web_lora_init.safetensors beside the bundle's training graph and checkpoint."""
    import onnx
    from safetensors.numpy import save_file

    from ort_trainer.ort_training import CheckpointState

    bundle_dir = Path(bundle_dir)
    model = onnx.load(str(bundle_dir / mf.TRAINING_MODEL), load_external_data=False)
    gradient_graph(model, trainable_names)
    onnx.save(model, str(bundle_dir / mf.WEB_TRAINING_MODEL))   # external data stays where it is: same shards
    params = CheckpointState.load_checkpoint(str(bundle_dir / mf.CHECKPOINT)).parameters
    save_file({n: np.ascontiguousarray(params[n].data, dtype=np.float32) for n in trainable_names},
              str(bundle_dir / mf.WEB_LORA_INIT))


def add_to_bundle(bundle_dir: str | Path) -> None:
    """Give a bundle built before the web runner existed its web files, recorded in its manifest."""
    from ort_trainer.bundle import sha256_file

    bundle_dir = Path(bundle_dir)
    man = mf.Manifest.load(bundle_dir)
    write_web_files(bundle_dir, man.trainable_names)
    man.files = [f for f in man.files if f.path not in ROLES] + [
        mf.FileEntry(p, (bundle_dir / p).stat().st_size, sha256_file(bundle_dir / p), role) for p, role in ROLES.items()]
    man.save(bundle_dir)


if __name__ == "__main__":
    import sys

    for d in sys.argv[1:]:
        add_to_bundle(d)
        print(f"{d}: {', '.join(ROLES)} written and recorded in its manifest")
