"""Give freed heap memory back to the OS.

The tokenizer (a Rust object; ~100 MB for Qwen2.5's 151k vocabulary) is only needed to prepare the
data. Dropping it frees its memory into the C allocator, which keeps it: measured here, RSS did not
fall after `del`, and fell by ~105 MB after glibc's malloc_trim, which returns free heap pages. Other C
libraries (Android's bionic/scudo) have no such call, and there this is a no-op.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import gc


def trim_heap() -> bool:
    """Collect unreachable Python objects (a session in a reference cycle holds its native memory until then), then
    malloc_trim(0) where the C library has it; True if it ran."""
    gc.collect()
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes = [ctypes.c_size_t]
    trim(0)
    return True
