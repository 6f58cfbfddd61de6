"""The safetensors file format, written here so that `diloco export` needs no runtime dependency for it.

The layout (https://github.com/huggingface/safetensors, "Format"), which is the specification:

    8 bytes      N, the header's length: an unsigned 64-bit little-endian integer
    N bytes      the header: a UTF-8 JSON object
                     {"NAME": {"dtype": "F32", "shape": [d0, d1, ...], "data_offsets": [BEGIN, END]}, ...,
                      "__metadata__": {"KEY": "VALUE", ...}}      (optional; strings to strings)
                 padded with spaces so the data starts at a multiple of 8 bytes
    the rest     the tensors' bytes, row-major, little-endian; tensor NAME is bytes [BEGIN, END) of this part

Tensors lie in name order, each right after the last, so the data has no gap and no overlap (which readers
check), and END - BEGIN is the element count times the dtype's size. Only the dtypes below are written.
"""

from __future__ import annotations

import json
import os
import struct
import sys
from collections.abc import Mapping
from pathlib import Path

import ml_dtypes
import numpy as np

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
