"""Hand-rolled protobuf wire encoding for the hot path: data-only chunks.

A data chunk after the first is just ``index`` (varint, field 1), ``data`` (bytes, field 4 in ``PushChunk``,
field 3 in ``PullChunk``) and, on the last chunk only, the payload ``digest`` trailer (bytes, field 5 in
``PushChunk``, field 4 in ``PullChunk``: always the field after ``data``). Building it through the protobuf
runtime costs three 1 MiB copies per chunk on the sender and one extra on the receiver; encoding it directly
costs one, and parsing it directly hands the receiver a zero-copy view of gRPC's buffer. The bytes are exactly
what protobuf would produce (a test checks ``FromString`` agrees), and anything that is not a plain data
chunk -- including every first chunk and every malformed message -- goes through the real protobuf parser.

The server parses requests with `tolerant` parsers: bytes that do not parse become an `Undecodable` value
instead of an exception. gRPC answers a deserializer's exception itself, with INTERNAL and a logged traceback,
before any handler runs, so the refusal could be neither explained nor counted; the handler refuses an
`Undecodable` with INVALID_ARGUMENT and reports it like any other rejected message.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from transport import diloco_pb2 as pb

T = TypeVar("T")

PUSH_DATA_FIELD = 4
PULL_DATA_FIELD = 3
_INDEX_TAG = 0x08  # field 1, varint


def _len_tag(field: int) -> int:
    """Tag byte of a length-delimited field (fields 1-15 fit in one byte)."""
    return field << 3 | 2


def _digest_field(data_field: int) -> int:
    """The trailer's field number: the one after ``data`` in both chunk messages."""
    return data_field + 1


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while pos < len(buf) and shift < 64:
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
    raise ValueError("truncated varint")


def encode_data_chunk(data_field: int, index: int, *pieces: memoryview | bytes, digest: bytes = b"") -> bytes:
    """Serialized ``{index, data, digest}`` chunk (data = the pieces joined), identical to protobuf's output.

    ``digest`` is the payload trailer (last chunk only; empty otherwise). One copy of the data: the final join.
    """
    n = sum(memoryview(p).nbytes for p in pieces)
    parts: list[bytes | memoryview] = [bytes([_INDEX_TAG]) + _varint(index)] if index else []  # proto3 omits 0
    if n:
        parts += [bytes([_len_tag(data_field)]), _varint(n), *pieces]
    if digest:
        parts += [bytes([_len_tag(_digest_field(data_field))]), _varint(len(digest)), digest]
    return b"".join(parts)


def serialize_chunk(message: Any) -> bytes:
    """gRPC serializer for chunk streams: pre-encoded ``bytes`` pass through, messages are serialized."""
    return message if isinstance(message, bytes) else message.SerializeToString()


@dataclass(frozen=True)
class DataChunk:
    """A parsed data-only chunk whose ``data`` is a view of the received bytes (duck-types the message)."""

    index: int
    data: memoryview
    digest: bytes = b""

    def HasField(self, name: str) -> bool:  # noqa: N802 - mirrors the protobuf message API
        """Data chunks carry no message fields."""
        return False


def _fast_parse(raw: bytes, data_field: int) -> DataChunk | None:
    buf = memoryview(raw)
    pos, index = 0, 0
    try:
        if len(buf) and buf[0] == _INDEX_TAG:
            index, pos = _read_varint(buf, 1)
        if pos >= len(buf) or buf[pos] != _len_tag(data_field):
            return None
        n, pos = _read_varint(buf, pos + 1)
        end = pos + n
        digest = b""
        if end < len(buf):  # anything after the data must be exactly the digest trailer
            if buf[end] != _len_tag(_digest_field(data_field)):
                return None
            m, start = _read_varint(buf, end + 1)
            if start + m != len(buf):
                return None
            digest = bytes(buf[start:])
    except ValueError:
        return None
    if index >= 1 << 32 or end > len(buf):
        return None
    return DataChunk(index, buf[pos:end], digest)


def chunk_parser(message: Any, data_field: int) -> Callable[[bytes], Any]:
    """A gRPC deserializer: plain data chunks parsed zero-copy, everything else by protobuf."""

    def parse(raw: bytes) -> Any:
        return _fast_parse(raw, data_field) or message.FromString(raw)

    return parse


parse_push_chunk = chunk_parser(pb.PushChunk, PUSH_DATA_FIELD)
parse_pull_chunk = chunk_parser(pb.PullChunk, PULL_DATA_FIELD)


@dataclass(frozen=True)
class Undecodable:
    """Request bytes that are not a valid ``expected`` message, as a tolerant parser hands them to the handler."""

    expected: str
    """The message type the bytes should have been."""
    error: str
    """The parser's complaint (attacker-shaped: printed only through ``transport.validate.printable``)."""


def tolerant(parse: Callable[[bytes], T], expected: str) -> Callable[[bytes], T | Undecodable]:
    """``parse`` as a server-side gRPC deserializer that never raises: a failure becomes an `Undecodable`."""

    def parse_or_flag(raw: bytes) -> T | Undecodable:
        try:
            return parse(raw)
        except Exception as e:  # protobuf's DecodeError, or anything a hostile byte string provokes
            return Undecodable(expected, f"{type(e).__name__}: {str(e)[:200]}")

    return parse_or_flag
