"""The safetensors file format, read and written here so that neither `diloco export` nor a Hugging Face import
(islands/models/hf/) needs a runtime dependency for it.

The layout (https://github.com/huggingface/safetensors, "Format"), which is the specification:

    8 bytes      N, the header's length: an unsigned 64-bit little-endian integer
    N bytes      the header: a UTF-8 JSON object
                     {"NAME": {"dtype": "F32", "shape": [d0, d1, ...], "data_offsets": [BEGIN, END]}, ...,
                      "__metadata__": {"KEY": "VALUE", ...}}      (optional; strings to strings)
                 padded with spaces so the data starts at a multiple of 8 bytes
    the rest     the tensors' bytes, row-major, little-endian; tensor NAME is bytes [BEGIN, END) of this part

Tensors lie in name order, each right after the last, so the data has no gap and no overlap (which readers
check), and END - BEGIN is the element count times the dtype's size. Only the dtypes below are written.

`SafetensorsFile` reads a file written by anyone, tensor by tensor (a seek and one read into the array's own
buffer), after checking its header against the file as the reference implementation does (`safetensors`'
`Metadata::validate`): a length of at most `MAX_HEADER` bytes that fits in the file, a JSON object of known dtypes
whose shapes fill exactly their byte ranges, ranges that tile the data part from its first byte to the file's last
without a gap or an overlap. A file that breaks one is refused in one line naming it, before any tensor is read.
"""

from __future__ import annotations

import json
import math
import os
import struct
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, BinaryIO

import ml_dtypes
import numpy as np

from floor.errors import UserError

DTYPES: dict[np.dtype, str] = {
    np.dtype(np.float64): "F64",
    np.dtype(np.float32): "F32",
    np.dtype(np.float16): "F16",
    np.dtype(ml_dtypes.bfloat16): "BF16",
    np.dtype(np.int64): "I64",
    np.dtype(np.int32): "I32",
    np.dtype(np.int16): "I16",
    np.dtype(np.int8): "I8",
    np.dtype(np.uint8): "U8",
    np.dtype(np.bool_): "BOOL",
}
"""numpy dtype -> its safetensors name."""

READ_DTYPES: dict[str, np.dtype] = {
    **{name: dtype for dtype, name in DTYPES.items()},
    "U16": np.dtype(np.uint16),
    "U32": np.dtype(np.uint32),
    "U64": np.dtype(np.uint64),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}
"""safetensors name -> numpy dtype, of every dtype a file may hold that NumPy can hold too (little-endian)."""

MAX_HEADER = 100_000_000
"""The longest header read, in bytes (the reference implementation's bound): a length field beyond it is refused
before anything is allocated for it."""

ALIGN = 8
"""The data part starts at a multiple of this many bytes (the header is padded with spaces)."""


def header(tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None) -> bytes:
    """The 8-byte length and the padded JSON header of `tensors` laid out in name order."""
    entries: dict[str, object] = {}
    if metadata:
        entries["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for name in sorted(tensors):
        array = tensors[name]
        if array.dtype not in DTYPES:
            raise ValueError(f"tensor {name!r} has dtype {array.dtype}, which safetensors does not name here")
        entries[name] = {"dtype": DTYPES[array.dtype], "shape": list(array.shape), "data_offsets": [offset,
                         offset + array.nbytes]}  # fmt: skip
        offset += array.nbytes
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-(len(text) + 8) % ALIGN)
    return struct.pack("<Q", len(text)) + text


def write(path: Path, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None) -> int:
    """Write `tensors` (name -> array) as a safetensors file at `path`, atomically (a temporary file renamed over
    it once complete); returns the bytes written."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(header(tensors, metadata))
        for name in sorted(tensors):
            array = np.ascontiguousarray(tensors[name])
            if sys.byteorder == "big" or array.dtype.byteorder == ">":
                array = array.astype(array.dtype.newbyteorder("<"))
            f.write(array.reshape(-1).view(np.uint8).data)
        size = f.tell()
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return size


class SafetensorsError(UserError, ValueError):
    """A file that is not a valid safetensors file (a truncated or lying header, a tensor outside the file): one line
    naming the file and what is wrong."""


@dataclass(frozen=True)
class Entry:
    """One tensor of a safetensors file, as its header declares it."""

    dtype: np.dtype
    shape: tuple[int, ...]
    begin: int
    """Its first byte, counted from the start of the file."""
    end: int
    """One past its last byte, counted from the start of the file."""


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        twice = next(k for k in keys if keys.count(k) > 1)
        raise ValueError(f"the header names {twice!r} twice")
    return dict(pairs)


def _entry(name: str, raw: object, start: int) -> Entry:
    """The entry `raw` of tensor `name`, its offsets made absolute (`start`: where the data part begins); a
    ValueError saying what is wrong with it."""
    if not isinstance(raw, dict) or set(raw) != {"dtype", "shape", "data_offsets"}:
        raise ValueError(f"tensor {name!r} must have exactly dtype, shape and data_offsets (got {raw!r:.120})")
    dtype, shape, offsets = raw["dtype"], raw["shape"], raw["data_offsets"]
    if dtype not in READ_DTYPES:
        raise ValueError(f"tensor {name!r} has dtype {dtype!r}, which is none of {', '.join(READ_DTYPES)}")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise ValueError(f"tensor {name!r} has shape {shape!r}, not a list of sizes")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int and o >= 0 for o in offsets)):
        raise ValueError(f"tensor {name!r} has data_offsets {offsets!r}, not [begin, end]")
    begin, end = offsets
    nbytes = math.prod(shape) * READ_DTYPES[dtype].itemsize
    if end - begin != nbytes:
        raise ValueError(f"tensor {name!r} is {dtype}{shape} ({nbytes} bytes) but data_offsets span {end - begin}")
    return Entry(READ_DTYPES[dtype], tuple(shape), start + begin, start + end)


def parse_header(f: BinaryIO, size: int) -> tuple[dict[str, Entry], dict[str, str]]:
    """The tensors and the metadata of the safetensors file `f` of `size` bytes, every rule of the module's docstring
    checked; a ValueError saying which one the file breaks."""
    f.seek(0)
    prefix = f.read(8)
    if len(prefix) < 8:
        raise ValueError(f"it is {size} bytes long, shorter than the 8-byte header length")
    (length,) = struct.unpack("<Q", prefix)
    if length > MAX_HEADER or 8 + length > size:
        raise ValueError(f"its header length field says {length} bytes, but the file is {size} bytes long")
    try:
        header = json.loads(f.read(length).decode("utf-8"), object_pairs_hook=_no_duplicates)
    except UnicodeDecodeError:
        raise ValueError("its header is not UTF-8 text") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"its header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise ValueError(f"its header is a JSON {type(header).__name__}, not an object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise ValueError("its __metadata__ is not an object of strings")
    start = 8 + length
    entries = {name: _entry(name, raw, start) for name, raw in header.items()}
    end = start
    for name, entry in sorted(entries.items(), key=lambda kv: (kv[1].begin, kv[1].end)):
        if entry.begin != end:
            what = "overlaps the tensor before it" if entry.begin < end else f"leaves {entry.begin - end} bytes unused"
            raise ValueError(f"tensor {name!r} {what}")
        end = entry.end
    if end != size:
        why = "beyond the file's end" if end > size else f"{size - end} bytes before the file's end"
        raise ValueError(f"its tensors end at byte {end}, {why} ({size} bytes)")
    return entries, metadata


class SafetensorsFile:
    """A safetensors file open for reading: its header checked (`parse_header`), its tensors read one at a time.

    A context manager: `with SafetensorsFile(path) as f: f.read(name)`. Nothing but the header is held; each `read`
    seeks to the tensor and reads its bytes into the array that it returns, so a checkpoint larger than memory is
    read one tensor at a time."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self._file: BinaryIO = open(path, "rb")
        except OSError as exc:
            raise SafetensorsError(f"'{path}' cannot be read ({exc.strerror or exc})") from None
        try:
            self.entries, self.metadata = parse_header(self._file, os.fstat(self._file.fileno()).st_size)
        except ValueError as exc:
            self._file.close()
            raise SafetensorsError(f"'{path}' is not a valid safetensors file: {exc}") from None

    def read(self, name: str) -> np.ndarray:
        """Tensor `name` as a new array of its own dtype and shape (native byte order)."""
        entry = self.entries[name]
        out = np.empty(entry.shape, entry.dtype)
        self._file.seek(entry.begin)
        got = self._file.readinto(memoryview(out.reshape(-1).view(np.uint8)))
        if got != entry.end - entry.begin:
            raise SafetensorsError(f"'{self.path}' ended inside tensor {name!r} (it changed while being read)")
        return out.byteswap() if sys.byteorder == "big" else out  # the file's bytes are little-endian

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()
