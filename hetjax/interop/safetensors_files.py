"""Reading and writing `.safetensors` files by offset, without loading whole files.

The format is an 8-byte little-endian header length, a JSON header ({name: {dtype, shape,
data_offsets}}, plus an optional `__metadata__`), then the raw row-major tensors. Reading maps
the file (`np.memmap`) so a slice touches only its own bytes; the reader counts the bytes of
every slice it returns, which is how a multi-process load shows each process read only its own
part. bfloat16 comes through `ml_dtypes` (the `safetensors` package's numpy backend has no
bfloat16, and real LLaMA checkpoints are bfloat16).
"""

from __future__ import annotations

import json
import os
import struct

import ml_dtypes
import numpy as np

from hetjax.errors import HetjaxError

DTYPES = {"F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
          "BF16": np.dtype(ml_dtypes.bfloat16), "F64": np.dtype(np.float64),
          "I64": np.dtype(np.int64), "I32": np.dtype(np.int32)}
NAMES = {v: k for k, v in DTYPES.items()}


class SafetensorsDir:
    """The tensors of an HF model directory: `model.safetensors`, or the shards an index file
    (`model.safetensors.index.json`) names. `read(name, slices)` returns one slice."""

    def __init__(self, directory: str):
        self.directory = directory
        self.bytes_read = 0
        index = os.path.join(directory, "model.safetensors.index.json")
        if os.path.isfile(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        elif os.path.isfile(os.path.join(directory, "model.safetensors")):
            weight_map = None
        else:
            raise HetjaxError(f"{directory} holds neither model.safetensors nor "
                              "model.safetensors.index.json; fix: give a directory written with "
                              "save_pretrained(..., safe_serialization=True) or hetjax export")
        files = sorted(set(weight_map.values())) if weight_map else ["model.safetensors"]
        self.entries: dict[str, tuple[str, dict, int]] = {}
        for file in files:
            path = os.path.join(directory, file)
            header, start = read_header(path)
            for name, entry in header.items():
                if name != "__metadata__":
                    self.entries[name] = (path, entry, start)

    def names(self) -> list[str]:
        return sorted(self.entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._entry(name)[1]["shape"])

    def _entry(self, name: str):
        if name not in self.entries:
            raise HetjaxError(f"{self.directory} has no tensor {name!r}; fix: give a checkpoint "
                              "of the architecture its config.json describes")
        return self.entries[name]

    def read(self, name: str, slices: tuple = ()) -> np.ndarray:
        """`tensor[slices]` as a fresh array, reading only the bytes those rows cover."""
        path, entry, start = self._entry(name)
        if entry["dtype"] not in DTYPES:
            raise HetjaxError(f"{path}: tensor {name} has dtype {entry['dtype']}, which hetjax "
                              f"does not read; fix: convert it to one of {', '.join(DTYPES)}")
        dtype, shape = DTYPES[entry["dtype"]], tuple(entry["shape"])
        begin = entry["data_offsets"][0]
        if not shape or 0 in shape:
            return np.zeros(shape, dtype)[slices]
        mm = np.memmap(path, dtype=dtype, mode="r", offset=start + begin, shape=shape)
        out = np.array(mm[slices])
        del mm
        self.bytes_read += out.nbytes
        return out


def read_header(path: str) -> tuple[dict, int]:
    """The JSON header of a safetensors file and the offset where its data starts."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n)), 8 + n


def write_file(path: str, tensors: dict[str, np.ndarray], metadata: dict | None = None) -> None:
    """Write `tensors` (name -> array) as one safetensors file, names sorted, as
    `safetensors.numpy.save_file` lays it out."""
    header, offset = {}, 0
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        header[name] = {"dtype": NAMES[a.dtype], "shape": list(a.shape),
                        "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    header["__metadata__"] = metadata or {"format": "pt"}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name in sorted(tensors):
            f.write(np.ascontiguousarray(tensors[name]).tobytes())
    os.replace(tmp, path)
