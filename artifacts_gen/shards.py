"""Move the frozen weights of a graph into shard files of ONNX external data.

Each tensor is written once; the training and eval models both point at the same
(file, offset, length), so the base model exists once on disk and, memory-mapped, once in RAM.
Large tensors start on 64 KiB boundaries so ORT can map them straight from the file
(page sizes on Android arm64 are 4 or 16 KiB; 64 KiB is a multiple of both).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import onnx
from onnx import TensorProto, numpy_helper
from tqdm import tqdm

ALIGN_LARGE = 64 * 1024
ALIGN_SMALL = 64
MIN_EXTERNAL_BYTES = 1024     # smaller constants (shapes, scalars) stay inside the graph


@dataclass
class ShardPlan:
    files: list[str]
    tensors: int
    bytes: int
    oversize: list[str]      # tensors larger than --shard-mb, each alone in its shard


def _raw(init: TensorProto) -> bytes:
    return init.raw_data if init.HasField("raw_data") else numpy_helper.to_array(init).tobytes()


def _nbytes(init: TensorProto) -> int:
    return len(init.raw_data) if init.HasField("raw_data") else numpy_helper.to_array(init).nbytes


def _align(offset: int, size: int) -> int:
    a = ALIGN_LARGE if size >= ALIGN_LARGE else ALIGN_SMALL
    return (offset + a - 1) // a * a


def write_shards(model: onnx.ModelProto, out_dir: Path, keep_inline: set[str], shard_mb: int) -> ShardPlan:
    """Externalize every initializer of >= MIN_EXTERNAL_BYTES not in `keep_inline`, in graph order."""
    limit = shard_mb * 1024 * 1024
    chosen = [i for i in model.graph.initializer if i.name not in keep_inline and _nbytes(i) >= MIN_EXTERNAL_BYTES]
    oversize = [i.name for i in chosen if _nbytes(i) > limit]
    # Plan: fill shards in order, so a tensor never straddles two files.
    # ONNX external data cannot split one tensor across files: a tensor larger than the limit
    # gets a shard of its own (reported in ShardPlan.oversize).
    groups: list[list[TensorProto]] = [[]]
    size = 0
    for init in chosen:
        n = _nbytes(init)
        if groups[-1] and (_align(size, n) + n > limit or n > limit):
            groups.append([])
            size = 0
        groups[-1].append(init)
        size = _align(size, n) + n
    names = [f"weights-{k + 1:05d}-of-{len(groups):05d}.bin" for k in range(len(groups))]
    total = sum(_nbytes(i) for i in chosen)
    with tqdm(total=total, unit="B", unit_scale=True, desc="writing shards", leave=False) as bar:
        for name, group in zip(names, groups):
            with open(out_dir / name, "wb") as f:
                offset = 0
                for init in group:
                    data = _raw(init)
                    start = _align(offset, len(data))
                    f.write(b"\0" * (start - offset))
                    f.write(data)
                    offset = start + len(data)
                    _point_to(init, name, start, len(data))
                    bar.update(len(data))
    return ShardPlan(files=names if chosen else [], tensors=len(chosen), bytes=total, oversize=oversize)


def _point_to(init: TensorProto, location: str, offset: int, length: int) -> None:
    for field in ("raw_data", "float_data", "int32_data", "int64_data", "double_data"):
        init.ClearField(field)
    init.data_location = TensorProto.EXTERNAL
    del init.external_data[:]
    for k, v in (("location", location), ("offset", str(offset)), ("length", str(length))):
        entry = init.external_data.add()
        entry.key, entry.value = k, v
