"""ONNX Runtime behind one small class: the training Module, the Optimizer, the CheckpointState,
and a separate inference session for evaluation, created only when it is needed.

Gradients accumulate in ORT's buffers across calls of `forward_backward` (ORT sums them; the
loss_scale input makes the sum the mean over the effective batch) and are consumed by `step`.
"""
from __future__ import annotations

import contextlib
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort
from .ort_training import CheckpointState, Module, Optimizer

from . import manifest as mf
from .bundle import Bundle, blame_damage
from .optimizer_graph import AdamWSpec, is_order_dependent, write_adamw

MEMORY_MODES = ("normal", "low")


@dataclass(frozen=True)
class RuntimeOptions:
    threads: int = 0            # 0: ORT's default (one per physical core)
    memory: str = "normal"      # "low": frozen weights stay file-backed (no prepacked copies)

    def session_options(self, *, training: bool = False) -> ort.SessionOptions:
        if self.memory not in MEMORY_MODES:
            raise ValueError(f"--memory {self.memory!r}: use one of {', '.join(MEMORY_MODES)}")
        so = ort.SessionOptions()
        so.log_severity_level = 3
        # Flush denormals to zero (x86 FTZ/DAZ; a no-op elsewhere). Masked attention scores (finfo.min) make
        # MLAS's exp produce denormals, and an x86 core takes ~7x longer over them: a [8, 14, 128, 128]
        # causal Softmax took 4.0-4.9 ms instead of 0.68 ms. Only values below 1.2e-38 change. ORT applies
        # this to its pool threads, and to the calling thread only from the first session of the process.
        so.add_session_config_entry("session.set_denormal_as_zero", "1")
        # No QDQ graph transformers: the graphs hold no quantized operators, only a quantized base's just-in-time
        # DequantizeLinear nodes, and EnsureUniqueDQForNodeUnit would copy each DQ once per reader (the LM head's
        # vocabulary slices feed two Gemms: twice the dequantization per step).
        so.add_session_config_entry("session.disable_quant_qdq", "1")
        if training:
            # ORT's planner lets a later tensor reuse a freed buffer. In the training graph that tensor is
            # often an activation kept for the backward pass, so a large buffer stays alive for a small
            # tensor: with reuse, ORT held ~90% of all forward outputs at the end of the forward pass
            # (Qwen2.5-0.5B, 528 of 606 MB at micro-batch 1, RSS with glibc returning every free).
            # Without it, the allocator (arena) places tensors: peak RSS at micro-batch 1 x accum 8
            # GPT-2 767 -> 682, Gemma3 1,649 -> 1,557, Qwen2.5 2,657 -> 2,452 MiB; GPT-2 at micro-batch 8
            # 1,996 -> 1,323 MiB. Step times were the same or faster (GPT-2 8x1 4.67/4.57 -> 4.37/4.28 s).
            so.enable_mem_reuse = False
        if self.threads:
            so.intra_op_num_threads = self.threads
            so.inter_op_num_threads = 1
        if self.memory == "low":
            # Prepacking copies every MatMul weight to the heap; without it the memory-mapped
            # external data is used in place, so the base model stays in the page cache. (ORT's training
            # Module disables prepacking itself, so for the training session this only restates it; it
            # matters for eval sessions. In training, low mode changes what --memory-budget counts.)
            # The CPU arena stays on: without it, activations in malloc'd blocks took more anonymous memory
            # (Qwen2.5-0.5B, worst-case pass of 1 / 2 / 4 sequences: 460 / 865 / 1,599 MiB against 336 / 557 /
            # 1,014 with the arena), which in low mode is what must fit beside the weights' page cache.
            # Under a cgroup cap of 60% of its weights, 2 x 4 steps took 18.6 / 20.4 s with the arena against
            # 20.1 / 22.0 s without (alternating), and 4 x 2 completed (17.6 s) where it had been OOM-killed.
            so.add_session_config_entry("session.disable_prepacking", "1")
        return so


def feeds(batch: dict[str, np.ndarray], loss_scale: float) -> list[np.ndarray]:
    return [
        np.ascontiguousarray(batch["input_ids"], dtype=np.int64),
        np.ascontiguousarray(batch["attention_mask"], dtype=np.int64),
        np.ascontiguousarray(batch["labels"], dtype=np.int64),
        np.asarray(loss_scale, dtype=np.float32),
    ]


class TrainSession:
    def __init__(
        self,
        bundle: Bundle,
        checkpoint: str | Path | None = None,
        adamw: AdamWSpec | None = None,
        options: RuntimeOptions = RuntimeOptions(),
        work_dir: str | Path | None = None,
    ):
        self.bundle = bundle
        self.work_dir = Path(work_dir) if work_dir else None     # the run's directory (scratch files go there)
        self.names = bundle.manifest.trainable_names
        with blame_damage(bundle):
            self.state = CheckpointState.load_checkpoint(str(checkpoint or bundle.file(mf.CHECKPOINT)))
            self.module = Module(str(bundle.file(mf.TRAINING_MODEL)), self.state, None, "cpu",
                                 options.session_options(training=True))
        optimizer_path = bundle.file(mf.OPTIMIZER_MODEL)
        self.adamw = adamw or AdamWSpec(**bundle.manifest.optimizer)
        with tempfile.TemporaryDirectory(prefix="pocketlora-optimizer-") as scratch:
            if self.adamw.to_dict() != bundle.manifest.optimizer or is_order_dependent(optimizer_path):
                # The run asks for other hyperparameters than the bundle baked in, or the bundle's graph clips in
                # a process-dependent order (built before 2026-12-06): build the run's own graph (in the run's
                # directory, else a scratch one: never into the bundle, which may be read-only or shared).
                optimizer_path = Path(work_dir or scratch) / "optimizer_model.run.onnx"
                write_adamw(optimizer_path, self.adamw)
            with blame_damage(bundle):
                self.optimizer = Optimizer(str(optimizer_path), self.module)
        self.module.train()

    # -- one micro-batch / one optimizer step -------------------------------------------------
    def forward_backward(self, batch: dict[str, np.ndarray], loss_scale: float) -> float:
        """Run forward and backward; gradients add into the accumulation buffers."""
        return float(self.module(*feeds(batch, loss_scale)))

    def grads(self) -> dict[str, np.ndarray]:
        params = self.state.parameters
        return {n: params[n].grad for n in self.names}

    def grad_norm(self) -> float:
        return float(np.sqrt(sum(float(np.dot(g.ravel(), g.ravel())) for g in self.grads().values())))

    def drop_grads(self) -> None:
        """The next forward_backward overwrites the accumulation buffers instead of adding to them."""
        self.module.lazy_reset_grad()

    def step(self, lr: float) -> None:
        """Clip, AdamW update (ORT's optimizer graph), then clear the accumulated gradients."""
        self.optimizer.set_learning_rate(lr)
        self.optimizer.step()
        self.drop_grads()

    # -- weights --------------------------------------------------------------------------------
    def lora(self) -> dict[str, np.ndarray]:
        params = self.state.parameters
        return {n: params[n].data for n in self.names}

    def set_lora(self, values: dict[str, np.ndarray]) -> None:
        params = self.state.parameters
        for n in self.names:
            params[n].data = np.ascontiguousarray(values[n], dtype=np.float32)

    def save(self, path: str | Path) -> None:
        CheckpointState.save_checkpoint(self.state, os.fspath(path), include_optimizer_state=True)


class EvalSession:
    """The eval graph on plain ORT inference, with the LoRA weights fed as inputs; or any model with the
    same interface and the adapter baked in (ort_trainer.adapter.export_onnx), with `lora` empty."""

    def __init__(self, bundle: Bundle | None, lora: dict[str, np.ndarray], options: RuntimeOptions = RuntimeOptions(),
                 model_path: str | Path | None = None):
        path = model_path or bundle.file(mf.EVAL_MODEL)
        with blame_damage(bundle) if bundle is not None else contextlib.nullcontext():
            self.session = ort.InferenceSession(str(path), options.session_options(),
                                                providers=["CPUExecutionProvider"])
        self.lora = {n: np.ascontiguousarray(v, dtype=np.float32) for n, v in lora.items()}

    @classmethod
    def from_model(cls, model_path: str | Path, options: RuntimeOptions = RuntimeOptions()) -> "EvalSession":
        return cls(None, {}, options, model_path=model_path)

    def run(self, batch: dict[str, np.ndarray], loss_scale: float = 1.0) -> tuple[float, np.ndarray]:
        """(loss_scale * summed NLL, logits [N, V] at the N labelled positions)."""
        inputs = dict(zip(mf.INPUT_NAMES, feeds(batch, loss_scale)))
        loss, logits = self.session.run(["loss", "logits"], {**inputs, **self.lora})
        return float(loss), logits
