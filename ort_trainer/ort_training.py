"""ORT's on-device training API, importable without torch.

onnxruntime-training 1.19's `onnxruntime/training/__init__.py` imports its torch-based `optim`
and `amp` helpers, so on a device without torch even `import onnxruntime.training.api` fails.
The pieces the device needs (`training.api`: CheckpointState, Module, Optimizer; and
`training.onnxblock`, to rebuild an optimizer graph) use only the C bindings, numpy and onnx.
Where torch is missing we register the `onnxruntime.training` package without running its
__init__, then import those two sub-packages normally.
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from pathlib import Path

import onnxruntime

from .device_view import torch_importable


def _training_package() -> None:
    if "onnxruntime.training" in sys.modules or torch_importable():
        return
    pkg = types.ModuleType("onnxruntime.training")
    pkg.__path__ = [str(Path(onnxruntime.__file__).parent / "training")]
    pkg.__package__ = "onnxruntime.training"
    sys.modules["onnxruntime.training"] = pkg


_training_package()
api = importlib.import_module("onnxruntime.training.api")
CheckpointState = api.CheckpointState
Module = api.Module
Optimizer = api.Optimizer


def onnxblock():
    return importlib.import_module("onnxruntime.training.onnxblock")
