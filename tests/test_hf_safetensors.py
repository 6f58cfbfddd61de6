"""floor/safetensors.py's reader: what the writer (and the real `safetensors` package) writes reads back bit for bit,
and every way a header can lie about its file is one line naming the file, before a tensor is read."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from floor import safetensors
from floor.safetensors import SafetensorsError, SafetensorsFile

TENSORS = {
    "a": np.arange(6, dtype=np.float32).reshape(2, 3),
    "b": np.array([1.5, -2.25], dtype=ml_dtypes.bfloat16),
    "c": np.zeros((0, 4), np.float16),
    "d": np.array([[7]], np.int64),
}


def test_what_is_written_reads_back_bit_for_bit(tmp_path: Path) -> None:
    path = tmp_path / "t.safetensors"
    safetensors.write(path, TENSORS, {"format": "pt"})
    with SafetensorsFile(path) as f:
        assert f.metadata == {"format": "pt"} and sorted(f.entries) == sorted(TENSORS)
        for name, array in TENSORS.items():
            got = f.read(name)
            assert got.dtype == array.dtype and got.shape == array.shape and got.tobytes() == array.tobytes()


def test_reads_what_the_real_package_writes(tmp_path: Path) -> None:
    from safetensors.numpy import save_file

    path = tmp_path / "real.safetensors"
    arrays = {"w": np.random.default_rng(0).normal(size=(3, 5)).astype(np.float32), "i": np.arange(4, dtype=np.int32)}
    save_file(arrays, str(path), metadata={"format": "np"})
    with SafetensorsFile(path) as f:
        assert all(np.array_equal(f.read(name), array) for name, array in arrays.items())


def raw_file(header: dict | bytes, data: bytes, length: int | None = None) -> bytes:
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(text) if length is None else length) + text + data


GOOD = {"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "y": {"dtype": "U8", "shape": [4], "data_offsets": [8, 12]}}  # fmt: skip
CASES = {
    "truncated": (b"\x10\x00\x00", "shorter than the 8-byte header length"),
    "length beyond the file": (raw_file(GOOD, bytes(12), length=10**6), "header length field says 1000000 bytes"),
    "length beyond any header": (raw_file(GOOD, bytes(12), length=2**63), "header length field says"),
    "not json": (raw_file(b"{not json", bytes(12)), "is not JSON"),
    "not an object": (raw_file(b"[1, 2]", b""), "not an object"),
    "not utf-8": (raw_file(b'{"\xff": 1}', b""), "not UTF-8"),
    "unknown dtype": (raw_file({"x": {"dtype": "F4", "shape": [1], "data_offsets": [0, 4]}}, bytes(4)), "dtype 'F4'"),
    "span lies": (raw_file({"x": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, bytes(8)), "but data_offsets span 8"),
    "negative size": (raw_file({"x": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, bytes(4)), "not a list of sizes"),
    "beyond the file": (raw_file(GOOD, bytes(11)), "beyond the file's end"),
    "trailing bytes": (raw_file(GOOD, bytes(13)), "1 bytes before the file's end"),
    "overlap": (raw_file({**GOOD, "y": {"dtype": "U8", "shape": [4], "data_offsets": [4, 8]}}, bytes(8)), "overlaps"),
    "gap": (raw_file({**GOOD, "y": {"dtype": "U8", "shape": [4], "data_offsets": [12, 16]}}, bytes(16)), "unused"),
    "a name twice": (raw_file(b'{"x": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}, "x": {"dtype": "U8", "shape": [1], "data_offsets": [1, 2]}}', bytes(2)), "names 'x' twice"),  # fmt: skip
    "extra key": (raw_file({"x": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1], "z": 1}}, bytes(1)), "exactly dtype"),
    "bad metadata": (raw_file({"__metadata__": {"k": 1}}, b""), "__metadata__"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_lying_header_is_one_line_naming_the_file(tmp_path: Path, case: str) -> None:
    content, expected = CASES[case]
    path = tmp_path / "bad.safetensors"
    path.write_bytes(content)
    with pytest.raises(SafetensorsError) as info:
        SafetensorsFile(path)
    message = str(info.value)
    assert expected in message and str(path) in message and "\n" not in message


def test_the_good_header_of_the_cases_reads(tmp_path: Path) -> None:
    """The cases above differ from this valid file by the one thing each breaks."""
    path = tmp_path / "good.safetensors"
    path.write_bytes(raw_file(GOOD, np.array([1.0, 2.0], np.float32).tobytes() + bytes([1, 2, 3, 4])))
    with SafetensorsFile(path) as f:
        assert f.read("x").tolist() == [1.0, 2.0] and f.read("y").tolist() == [1, 2, 3, 4]
