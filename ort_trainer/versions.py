"""The versions of the tools a result was made with, as every record states them: the bundle manifest's
`tools`, the parity report's `versions`, a bench run's `machine.versions`.

Standard library only (no import of the packages it names), so the device side can call it too.
"""
from __future__ import annotations

from importlib import metadata
from typing import Iterable

# The distributions that make a result: the project, the PyTorch side, the export, ORT (whichever of its
# distributions is installed) and protobuf (which onnx and ORT read models with).
TOOLS = ("pocketlora", "torch", "transformers", "peft", "onnx", "onnxruntime-training", "onnxruntime-training-cpu",
         "onnxruntime", "optimum-onnx", "protobuf")


def tool_versions(packages: Iterable[str] = TOOLS) -> dict[str, str]:
    """{distribution: installed version} for each of `packages` that is installed, in their order."""
    out = {}
    for pkg in packages:
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    return out
