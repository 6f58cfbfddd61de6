"""`diloco bench fuzz-decoders`: coverage-guided fuzzing (atheris, libFuzzer) of the code that reads hostile bytes.

`diloco bench fuzz` throws whole messages at a coordinator process; this one goes underneath, at the functions that
turn an island's bytes into values, with libFuzzer steering the inputs toward code not yet covered. Targets:

  codec      `floor.codec.decode` of a tensor whose codec, dtype, shape, block size, zstd level and payload
             all come from the input
  sparse     `floor.codec.decode` of a sparse tensor whose header is drawn from near-valid choices and whose
             payload has the length that header makes (give or take a byte), so the input reaches the checks of
             scales, indices and codes behind the header and length checks that random bytes rarely pass
  header     `PayloadHeader` parsed from the input, then `chunking.check_header` and a `Reassembler` built on it
  chunk      `wire.parse_push_chunk` (the zero-copy fast path and the protobuf fallback)
  push_meta  `PushMeta` parsed from the input, then `validate.check_push_meta`

A target may refuse an input only with its documented error: `CodecError`, `Rejected` (a gRPC status with a
reason) or protobuf's `DecodeError`. Anything else escaping is a finding: libFuzzer stops, prints the input, and the
run reports it. Every target is a plain function of bytes, so the suite runs them on seeded random inputs without
atheris (`tests/test_fuzz_decoders.py`); the coverage-guided run is this benchmark:

    diloco bench fuzz-decoders [--targets codec,sparse,header,chunk,push_meta] [--runs N] [--seconds S]

It runs each target in its own process (`python -m diloco.bench.fuzz_entry TARGET -runs=N ...`, the libFuzzer
command line) and prints JSON: per target the executions, the coverage libFuzzer reached, and any finding.
"""

from __future__ import annotations

import re
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from google.protobuf.message import DecodeError

from diloco.bench.errors import BenchError
from floor.codec import (
    DTYPES,
    KINDS,
    SPARSE_HEADER_NBYTES,
    CodecError,
    CodecSpec,
    EncodedTensor,
    decode,
    index_bits,
    sparse_payload_nbytes,
)
from transport import diloco_pb2 as pb
from transport.chunking import Reassembler, check_header
from transport.errors import Rejected
from transport.tensors import known_codecs
from transport.validate import check_push_meta
from transport.wire import parse_push_chunk

MAX_PAYLOAD = 1 << 20
"""Payload and decoded-size cap the targets run under (as a coordinator would, only smaller, to stay fast)."""

EXPECTED: tuple[type[BaseException], ...] = (CodecError, Rejected, DecodeError)


class _Bytes:
    """Draws small values from the front of the input and leaves the rest as a payload (libFuzzer-friendly: a
    mutation of one byte changes one choice)."""

    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def byte(self) -> int:
        value = self.data[self.pos] if self.pos < len(self.data) else 0
        self.pos += 1
        return value

    def pick(self, options: tuple[Any, ...]) -> Any:
        return options[self.byte() % len(options)]

    def rest(self) -> bytes:
        return self.data[self.pos :]


FP32 = CodecSpec(kind="fp32")
"""The uplink codec push_meta checks against: a push of int8 tensors is refused for it."""


def codec_target(data: bytes) -> None:
    r = _Bytes(data)
    shape = tuple(r.byte() % 9 for _ in range(r.byte() % 4))
    tensor = EncodedTensor(
        name="fuzz",
        codec=r.pick(tuple(KINDS) + ("int2",)),
        dtype=r.pick(tuple(DTYPES) + ("int64",)),
        shape=shape,
        block_size=r.pick((0, 1, 3, 8, 256, 1 << 17)),
        zstd_level=r.pick((0, 0, 1, 3)),
        payload=r.rest(),
    )
    try:
        decode(tensor, max_dense_nbytes=MAX_PAYLOAD)
    except EXPECTED:
        pass


def sparse_target(data: bytes) -> None:
    r = _Bytes(data)
    chunk = r.pick((2, 6, 8, 64))
    numel = r.byte() % 130
    width = index_bits(chunk) if r.byte() % 8 else r.byte() % 17
    bits, kept, kept_last = r.pick((2, 3, 4, 8, 9)), r.byte() % 9, r.byte() % 9
    chunks = -(-numel // chunk)
    total = (chunks - 1) * kept + kept_last if chunks else 0
    size = sparse_payload_nbytes(chunks, total, width, bits) - SPARSE_HEADER_NBYTES + r.pick((0, 0, 0, -1, 1))
    length = max(size, 0)
    body = r.rest()[:length]
    header = struct.pack("<BBHII", bits, width, 0, kept, kept_last)
    tensor = EncodedTensor("fuzz", "sparse", "float32", (numel,), chunk, 0, header + body + bytes(length - len(body)))
    try:
        decode(tensor, max_dense_nbytes=MAX_PAYLOAD)
    except EXPECTED:
        pass


def header_target(data: bytes) -> None:
    try:
        header = pb.PayloadHeader.FromString(data)
        check_header(header, MAX_PAYLOAD, 64, known_codecs())
        Reassembler(header, MAX_PAYLOAD, 64, known_codecs()).close()
    except EXPECTED:
        pass


def chunk_target(data: bytes) -> None:
    try:
        parse_push_chunk(data)
    except EXPECTED:
        pass


def push_meta_target(data: bytes) -> None:
    try:
        meta = pb.PushMeta.FromString(data)
        check_push_meta(meta, [pb.TensorMeta(name="w", codec="int8")], {"w": ((4,), "float32")}, FP32)
    except EXPECTED:
        pass


TARGETS: dict[str, Callable[[bytes], None]] = {
    "codec": codec_target,
    "sparse": sparse_target,
    "header": header_target,
    "chunk": chunk_target,
    "push_meta": push_meta_target,
}


def _fuzz_one(target: str, runs: int, seconds: int) -> dict[str, Any]:
    cmd = [
        sys.executable,
        "-m",
        "diloco.bench.fuzz_entry",
        target,
        f"-runs={runs}",
        f"-max_total_time={seconds}",
        "-max_len=4096",
        "-print_final_stats=1",
    ]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 120)
    out = proc.stdout + proc.stderr
    stats = dict(re.findall(r"stat::(\w+):\s+(\d+)", out))
    coverage = re.findall(r"cov: (\d+) ft: (\d+)", out)
    finding = next((ln for ln in out.splitlines() if "Uncaught Python exception" in ln or "ERROR:" in ln), None)
    return {
        "executions": int(stats.get("number_of_executed_units", 0)),
        "coverage_edges": int(coverage[-1][0]) if coverage else None,
        "features": int(coverage[-1][1]) if coverage else None,
        "finding": None if proc.returncode == 0 else (finding or out.strip().splitlines()[-1:] or ["?"])[0][:500],
        "exit_code": proc.returncode,
        "seconds": round(time.monotonic() - t0, 1),
    }


def run_fuzz_decoders(targets: list[str], runs: int, seconds: int) -> dict[str, Any]:
    unknown = sorted(set(targets) - set(TARGETS))
    if unknown:
        raise BenchError(f"unknown fuzz target(s) {', '.join(unknown)} (targets: {', '.join(TARGETS)})")
    try:
        import atheris  # noqa: F401  (only checked here; the children import it)
    except ImportError:
        raise BenchError("diloco bench fuzz-decoders needs atheris: pip install -e '.[dev]'") from None
    results = {name: _fuzz_one(name, runs, seconds) for name in targets}
    return {
        "bench": "fuzz-decoders",
        "runs_per_target": runs,
        "seconds_per_target": seconds,
        "targets": results,
        "findings": sum(r["finding"] is not None for r in results.values()),
    }
