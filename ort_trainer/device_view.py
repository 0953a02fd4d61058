"""The device's view of this Python: the workstation's packages cannot be imported, as on a phone.

onnxruntime-training's `import onnxruntime.training` imports torch whenever it is installed (its ORTModule check):
~200 MB of RSS and seconds of start-up that a device never pays. `as_on_device()` makes `import torch` (and
transformers, peft, optimum) fail with ModuleNotFoundError in this process, for the names not already imported.

It is a finder at the front of sys.meta_path, not a None in sys.modules: libraries that probe sys.modules for
torch (scipy's array-API helpers, which dp-accounting reaches) would take a None there for the module and fail.
`importlib.util.find_spec` raises ModuleNotFoundError for these names; `torch_importable()` answers the question.
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys

WORKSTATION = ("torch", "transformers", "peft", "optimum")


class _NotOnDevice(importlib.abc.MetaPathFinder):
    def __init__(self):
        self.names: set[str] = set()

    def find_spec(self, fullname, path=None, target=None):
        if fullname.partition(".")[0] in self.names:
            raise ModuleNotFoundError(f"No module named {fullname!r} (the device side runs without it)",
                                      name=fullname)
        return None


def _finder() -> _NotOnDevice:
    for f in sys.meta_path:
        if isinstance(f, _NotOnDevice):
            return f
    f = _NotOnDevice()
    sys.meta_path.insert(0, f)
    return f


def as_on_device() -> None:
    """From now on the workstation packages not yet imported here cannot be imported (where this process already
    has torch, as in a test run, nothing changes for it)."""
    finder = _finder()
    for name in WORKSTATION:
        if name not in sys.modules and not any(m.startswith(name + ".") for m in sys.modules):
            finder.names.add(name)


def torch_importable() -> bool:
    try:
        return importlib.util.find_spec("torch") is not None
    except (ModuleNotFoundError, ValueError):
        return False
