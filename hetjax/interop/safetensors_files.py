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
from hetjax.files import inside, replace_file

DTYPES = {"F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
          "BF16": np.dtype(ml_dtypes.bfloat16), "F64": np.dtype(np.float64),
          "I64": np.dtype(np.int64), "I32": np.dtype(np.int32)}
NAMES = {v: k for k, v in DTYPES.items()}
# Bytes per element of every dtype the format defines (hetjax reads those in DTYPES); a header
# naming another is not a safetensors file.
ITEM_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2,
              "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "F64": 8, "I64": 8, "U64": 8}
# The safetensors package refuses headers above 100 MB; so does hetjax, before reading one.
MAX_HEADER_BYTES = 100_000_000
INDEX = "model.safetensors.index.json"
FIX = ("fix: download the file again, or give a directory written with "
       "save_pretrained(..., safe_serialization=True) or hetjax export")


class SafetensorsDir:
    """The tensors of an HF model directory: `model.safetensors`, or the shards an index file
    (`model.safetensors.index.json`) names. `read(name, slices)` returns one slice.

    Every header is checked before any tensor is read (`read_header`), and an index may only
    name files inside the directory, so a damaged or hostile download is one error naming the
    file, never a read outside it or an allocation its header made up."""

    def __init__(self, directory: str):
        self.directory = directory
        self.bytes_read = 0
        self.unused: list[str] = []  # tensors a load did not use (hf_checkpoint.load_params)
        index = os.path.join(directory, INDEX)
        if os.path.isfile(index):
            weight_map = read_index(index)
        elif os.path.isfile(os.path.join(directory, "model.safetensors")):
            weight_map = None
        else:
            raise HetjaxError(f"{directory} holds neither model.safetensors nor "
                              "model.safetensors.index.json; fix: give a directory written with "
                              "save_pretrained(..., safe_serialization=True) or hetjax export")
        files = sorted(set(weight_map.values())) if weight_map else ["model.safetensors"]
        self.entries: dict[str, tuple[str, dict, int]] = {}
        for file in files:
            path = inside(directory, file, index, FIX)
            header, start = read_header(path)
            for name, entry in header.items():
                if name != "__metadata__":
                    self.entries[name] = (path, entry, start)
        for name, file in (weight_map or {}).items():
            shard = inside(directory, file, index, FIX)
            if name not in self.entries or self.entries[name][0] != shard:
                raise HetjaxError(f"{index}: names {file} for tensor {name!r}, which that file "
                                  f"does not hold; {FIX}")

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


def read_index(path: str) -> dict[str, str]:
    """The `weight_map` of a sharded checkpoint's index file: tensor name -> shard file name."""
    try:
        with open(path) as f:
            weight_map = json.load(f)["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise HetjaxError(f"{path}: not a safetensors index ({type(e).__name__}: {e}); {FIX}") \
            from None
    if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise HetjaxError(f"{path}: weight_map is not an object of tensor name -> file name; "
                          f"{FIX}")
    return weight_map


def read_header(path: str) -> tuple[dict, int]:
    """The JSON header of a safetensors file and the offset where its data starts, checked
    against the file: its length, that it is a JSON object of entries with a known dtype, a
    shape of non-negative integers whose bytes are the entry's, and data offsets inside the
    file that no two entries share."""
    def bad(problem: str):
        return HetjaxError(f"{path}: {problem}; not a valid safetensors file; {FIX}")

    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise bad(f"{size} bytes, shorter than the 8-byte header length")
            (n,) = struct.unpack("<Q", head)
            if n > min(MAX_HEADER_BYTES, size - 8):
                raise bad(f"its header length is {n} bytes, but the file has {size - 8} after "
                          f"the length (and headers are at most {MAX_HEADER_BYTES:,} bytes)")
            text = f.read(n)
    except OSError as e:
        raise HetjaxError(f"{path}: cannot be read ({e.strerror}); {FIX}") from None
    try:
        header = json.loads(text)
    except (ValueError, UnicodeDecodeError) as e:
        raise bad(f"its header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise bad(f"its header is a JSON {type(header).__name__}, not an object")
    data_bytes, spans = size - 8 - n, []
    for name, entry in header.items():
        if name == "__metadata__":
            if not isinstance(entry, dict) or not all(
                    isinstance(k, str) and isinstance(v, str) for k, v in entry.items()):
                raise bad("__metadata__ is not an object of strings")
            continue
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            raise bad(f"tensor {name!r} is not an object of dtype, shape and data_offsets")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if dtype not in ITEM_BYTES:
            raise bad(f"tensor {name!r} has dtype {dtype!r}, which the format does not define")
        if not isinstance(shape, list) or not all(
                type(d) is int and d >= 0 for d in shape):
            raise bad(f"tensor {name!r} has shape {shape!r}, not a list of integers >= 0")
        if not (isinstance(offsets, list) and len(offsets) == 2
                and all(type(o) is int for o in offsets) and 0 <= offsets[0] <= offsets[1]
                <= data_bytes):
            raise bad(f"tensor {name!r} has data_offsets {offsets!r}, not [begin, end] inside "
                      f"the {data_bytes} data bytes")
        nbytes = ITEM_BYTES[dtype]
        for d in shape:
            nbytes *= d
        if nbytes != offsets[1] - offsets[0]:
            raise bad(f"tensor {name!r} of shape {shape} and dtype {dtype} has "
                      f"{nbytes} bytes, but its data_offsets {offsets} span "
                      f"{offsets[1] - offsets[0]}")
        spans.append((offsets[0], offsets[1], name))
    spans.sort()
    for (_, end, a), (begin, _, b) in zip(spans, spans[1:]):
        if begin < end:
            raise bad(f"tensors {a!r} and {b!r} share data bytes")
    return header, 8 + n


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

    def write(f):
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name in sorted(tensors):
            f.write(np.ascontiguousarray(tensors[name]).tobytes())

    replace_file(path, write)
