"""`diloco bench fuzz`: a hostile client against a real `diloco coordinator`; nothing it sends may crash, starve or
grow the coordinator, or be answered with anything but a status that says why.

Two runs of one tiny config (synthetic data, a one-layer transformer, two islands; `load.load_config_text`): with
island secrets ("auth") and without ("open"). Each starts the coordinator as the user would (`diloco coordinator`,
through `diloco.harness.procs.Federation`), then:

1. opens a flood of calls that send nothing (push streams under every kind of name, and heartbeats under an
   insider's valid credentials), times a Status and a heartbeat of a real island while they hang, and waits for
   the server to cut them (the run sets 3 s first-message and idle timeouts);
2. fires the run's share of ``--messages`` hostile messages from a few client threads, each a raw call whose bytes
   the fuzzer chose (`Forge`): every RPC, under real, wrong, missing and invented identities, with lies in every field
   (NaN, infinite, huge finite and subnormal numbers, texts from empty to 1 MiB, JSON nested 100,000 deep, fragments and
   rounds that do not exist), malformed headers (sizes that do not match shapes, absurd totals and counts, unknown
   codecs, pieces of any rank anywhere), broken chunk streams (reordered, repeated, truncated, forged digests, bytes
   that are not protobuf), "insider" pushes that pass every wire check but carry huge finite or subnormal values, and
   the operator's calls (Admit, Retire) under the operator's real, a wrong, a missing or an island's credential, with
   invented names, digests of every length and hostile reasons; and the corpus's chunks (the run samples them:
   data.sampling = "chunks"): leases for zero, a round's worth plus one and 2^64 - 1 sequences, and pushes whose chunk
   spans claim another island's chunk (a lease claimed twice), run past a chunk's end, overlap what is pending, name
   chunks that do not exist or thousands of spans, or disagree with their token weight;
3. starts the run's two real islands and waits for a round they push to be committed.

Reported (JSON): per run the messages sent, the histogram of status codes (in all and per RPC), the UNKNOWN and
INTERNAL answers (must be 0; the first few shots that caused one are named), the calls that hit the client's own
deadline (the server starving), what happened to the idle flood, the Status/heartbeat latency during it, whether
the coordinator is alive, its RSS before and after the fuzz and its peak (/proc/PID/status), the growth of its
metrics.jsonl in bytes, and whether a legitimate round completed afterwards.

Run: ``diloco bench fuzz [--messages 5000] [--seed 0] [--run-dir DIR]`` (JSON on stdout).
"""

from __future__ import annotations

import json
import math
import secrets
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from diloco import RELEASE
from diloco.bench.errors import BenchError
from diloco.bench.federation import _federation
from diloco.bench.load import load_config_text, proc_memory_kib
from diloco.config import RunConfig, config_digest, load_config
from diloco.harness.procs import Federation, FederationError, log_lines
from floor.codec import EncodedTensor
from transport import diloco_pb2 as pb
from transport.auth import OPERATOR_KEY, call_metadata
from transport.client_core import push_wire_chunks
from transport.config import TransportConfig
from transport.errors import TransportError
from transport.grpc_client import GrpcTransport

SERVICE = "/diloco.v1.Diloco/"
CALL_TIMEOUT_S = 30.0
"""A hostile call's own deadline: a call that reaches it means the server was starved (reported apart)."""
FUZZ_OVERRIDES = [
    "train.rounds=1000",  # never done while fuzzed
    "quorum.min_islands=1",
    "quorum.lease_s=60",
    "quorum.max_deadline_s=60",
    "network.pull_wait_s=1",  # a hostile pull of the open round waits this long for the commit
    "transport.first_message_timeout_s=3",  # the idle flood is cut during the run
    "transport.idle_timeout_s=3",
    "data.sampling=chunks",  # the Lease RPC and the pushes' chunk spans meet a real ledger
]
HUGE_JSON = "[" * 100_000 + "]" * 100_000
NUMBERS = [math.nan, math.inf, -math.inf, 1e308, -1e308, 3.4e38, -3.4e38, 5e-324, 1e-40, -0.0, 0.0, -1.0, 1e9 + 1]


@dataclass(frozen=True)
class Shot:
    """One hostile call: which RPC, the bytes it sends (one message, or a stream of them), under which metadata."""

    rpc: str
    label: str
    payload: bytes | list[bytes]
    metadata: tuple[tuple[str, str], ...]


class Forge:
    """Makes hostile shots for one run: knows the run's names, secrets and model, as an attacker could learn them
    (an insider holds an island's secret and pulls θ; anyone can read a config's names)."""

    def __init__(
        self,
        cfg: RunConfig,
        island_secrets: dict[str, str] | None,
        full: Any,
        rng: np.random.Generator,
        operator: str = "",
        leased: list[tuple[int, int, int]] = (),
    ):
        """`operator`: the operator's secret, which the fuzzer holds as an insider would (it admits invented names
        and retires names that are not the run's islands, so that the run's real islands still complete a round)."""
        self.cfg, self.secrets, self.rng, self.operator = cfg, island_secrets, rng, operator
        self.names = list(cfg.islands.island_names)
        self.shapes = {t.name: tuple(t.shape) for t in full.tensors}
        self.base_digest, self.round = full.param_digest, full.round
        self.digest = bytes.fromhex(config_digest(cfg))
        self.leased = list(leased)
        """The chunk spans the first island (an insider) was really leased: what its pushes claim, honestly or not."""
        self.per_round = cfg.train.inner_steps * cfg.train.batch_size

    # -- fuzzed values -------------------------------------------------------------------------------------------

    def pick(self, options: list[Any]) -> Any:
        return options[int(self.rng.integers(len(options)))]

    def text(self) -> str:
        return self.pick(
            [
                "",
                self.pick(self.names),
                self.cfg.run.name,
                "\x00\x1b[31m\n\r",
                "é" * 50,
                "🏝" * 300,
                "x" * int(self.rng.integers(1, 300_000)),
                "".join(map(chr, self.rng.integers(32, 0x2FFF, 40))),
            ]
        )

    def or_text(self, real: str) -> str:
        """``real`` half the time, else a fuzzed text."""
        return real if self.rng.random() < 0.5 else self.text()

    def number(self) -> float:
        return float(self.pick([*NUMBERS, float(self.rng.normal() * 10.0 ** int(self.rng.integers(-40, 40)))]))

    def uint(self, bits: int) -> int:
        return int(self.pick([0, 1, 2**bits - 1, int(self.rng.integers(0, 2**31)), self.round, self.round + 1]))

    def who(self) -> tuple[str, tuple[tuple[str, str], ...]]:
        """(name the messages claim, call metadata): an insider, a wrong secret, no credentials, an invented name."""
        name = self.pick(self.names)
        secret = self.secrets.get(name) if self.secrets else None
        roll = self.rng.random()
        if roll < 0.5:
            return name, call_metadata(name, secret)
        if roll < 0.65:
            return name, call_metadata(name, "wrong-" + str(self.rng.integers(1e9)))
        if roll < 0.75:
            return name, ()
        invented = self.pick(["evil", "island-9", "", "x" * 4000, "island-0 ", "ISLAND-0", "../../etc"])
        return invented, call_metadata(invented, secret)  # metadata values are printable ASCII on the wire

    # -- shots ---------------------------------------------------------------------------------------------------

    def shot(self) -> Shot:
        kind = self.pick(
            [
                "join",
                "heartbeat",
                "leave",
                "status",
                "pull",
                "push_meta",
                "push_header",
                "push_chunks",
                "push_values",
                "raw",
                "admit",
                "retire",
                "lease",
                "push_spans",
            ]
        )
        return getattr(self, f"_{kind}")()

    def operator_metadata(self) -> tuple[tuple[str, str], ...]:
        """The operator's credential, a wrong one, none, or an island's in its place."""
        roll = self.rng.random()
        if roll < 0.5 and self.operator:
            return ((OPERATOR_KEY, self.operator),)
        if roll < 0.7:
            return ((OPERATOR_KEY, "wrong-" + str(self.rng.integers(1e9))),)
        if roll < 0.85:
            return ()
        return self.who()[1]

    def invented(self) -> str:
        """A name that is none of the run's islands, valid or not (a fuzzed text may be a real name: not here)."""
        name = self.pick([f"joiner-{int(self.rng.integers(1e6))}", "", "x" * 65, "../../etc", "evil\x00", self.text()])
        return f"not-{name}" if name in self.names else name

    def _admit(self) -> Shot:
        name = self.pick([self.invented(), self.pick(self.names)])
        digest = self.pick([self.rng.bytes(32), b"", self.rng.bytes(int(self.rng.integers(1, 100))), b"\0" * 32])
        req = pb.AdmitRequest(run_id=self.or_text(self.cfg.run.name), island=name, secret_sha256=digest)
        return self._unary("Admit", req, f"admit digest[{len(digest)}]", self.operator_metadata())

    def _retire(self) -> Shot:
        md = self.operator_metadata()
        operator = any(key == OPERATOR_KEY and value == self.operator for key, value in md)
        # The operator's real credential retires only invented names, and an island's real one never its own island
        # (both would retire a real island for good, as they should); under anything else, any name is tried.
        others = [n for n in self.names if md != call_metadata(n, self.secrets.get(n) if self.secrets else None)]
        name = self.invented() if operator else self.pick([self.invented(), self.pick(others)])
        req = pb.RetireRequest(run_id=self.or_text(self.cfg.run.name), island=name, reason=self.text())
        return self._unary("Retire", req, f"retire reason[{len(req.reason)}]", md)

    def _unary(self, rpc: str, message: Any, label: str, md: tuple) -> Shot:
        return Shot(rpc, label, message.SerializeToString(), md)

    def _join(self) -> Shot:
        name, md = self.who()
        config_json = self.pick(
            ["", "{}", "[1]", HUGE_JSON, "x" * (2 << 20), self.text(), json.dumps({"train": {"rounds": self.number()}})]
        )
        req = pb.JoinRequest(
            run_id=self.or_text(self.cfg.run.name),
            island=self.or_text(name),
            config_digest=self.pick([self.digest, b"", self.rng.bytes(32)]),
            config_json=config_json,
            last_round=self.pick([-1, -(2**63), 2**63 - 1, self.round]),
            devices=self.uint(32),
            release=self.pick([RELEASE, "", self.text()]),
        )
        return self._unary("Join", req, f"join config_json[{len(config_json)}]", md)

    def _heartbeat(self) -> Shot:
        name, md = self.who()
        req = pb.HeartbeatRequest(
            run_id=self.or_text(self.cfg.run.name), island=self.or_text(name), round=self.uint(64), step=self.uint(64)
        )
        return self._unary("Heartbeat", req, "heartbeat", md)

    def _leave(self) -> Shot:
        name, md = self.who()
        req = pb.LeaveRequest(run_id=self.cfg.run.name, island=self.or_text(name), reason=self.text())
        return self._unary("Leave", req, f"leave reason[{len(req.reason)}]", md)

    def _status(self) -> Shot:
        _, md = self.who()
        return Shot("Status", "status", self.pick([b"", self.rng.bytes(int(self.rng.integers(1, 64)))]), md)

    def _pull(self) -> Shot:
        name, md = self.who()
        req = pb.PullRequest(
            run_id=self.or_text(self.cfg.run.name),
            island=self.or_text(name),
            have_round=self.pick([-1, -(2**63), 2**63 - 1, self.round, self.round - 1]),
            fragment=self.pick([0, 1, 2**32 - 1]),
            full=bool(self.rng.random() < 0.5),
        )
        return self._unary("PullGlobal", req, f"pull fragment={req.fragment}", md)

    def _lease(self) -> Shot:
        name, md = self.who()
        sequences = self.pick([0, 1, self.per_round, self.per_round + 1, 2**31, 2**64 - 1])
        req = pb.LeaseRequest(
            run_id=self.or_text(self.cfg.run.name), island=self.or_text(name), round=self.uint(64), sequences=sequences
        )
        return self._unary("Lease", req, f"lease sequences={sequences}", md)

    def _spans(self) -> tuple[str, list[pb.ChunkSpan]]:
        """Chunk spans a push claims: the insider's real lease, or a lie about it."""
        real = [pb.ChunkSpan(chunk=c, start=s, end=e) for c, s, e in self.leased] or [pb.ChunkSpan(end=1)]
        what = self.pick(["honest", "stolen", "beyond_end", "overlap", "bogus_chunk", "many", "none", "backwards"])
        spans = [pb.ChunkSpan(chunk=x.chunk, start=x.start, end=x.end) for x in real]
        if what == "beyond_end":
            spans[-1].end = self.pick([spans[-1].end + 1, 2**32 - 1, 10**6])
        elif what == "overlap":
            spans.append(pb.ChunkSpan(chunk=spans[0].chunk, start=spans[0].start, end=spans[0].end))
        elif what == "bogus_chunk":
            spans[0].chunk = self.pick([2**64 - 1, 10**9, spans[0].chunk + 10**6])
        elif what == "many":
            spans = [pb.ChunkSpan(chunk=i, start=0, end=1) for i in range(int(self.pick([5, 4097, 20_000])))]
        elif what == "none":
            spans = []
        elif what == "backwards":
            spans[0].start, spans[0].end = spans[0].end, spans[0].start
        return what, spans

    def _push_spans(self) -> Shot:
        """An insider's push whose chunk spans are its real lease or a lie about it; "stolen": another insider
        claims the first one's chunks (a lease claimed twice)."""
        what, spans = self._spans()
        name = self.names[1 if what == "stolen" and len(self.names) > 1 else 0]
        md = call_metadata(name, self.secrets.get(name) if self.secrets else None)
        meta = self._meta(name)
        del meta.chunks[:]
        meta.chunks.extend(spans)
        if self.rng.random() < 0.2:
            meta.tokens = self.uint(64) or 1  # a token weight that does not match the spans
        chunks = self._stream(meta, self._tensors(np.zeros))
        return Shot("PushPseudoGrad", f"push spans {what}", self._bytes(chunks), md)

    def _meta(self, name: str) -> pb.PushMeta:
        sequences = sum(e - s for _, s, e in self.leased) or 1
        return pb.PushMeta(
            run_id=self.cfg.run.name,
            island=name,
            round=self.round,
            fragment=0,
            tokens=sequences * self.cfg.model.seq_len,
            chunks=[pb.ChunkSpan(chunk=c, start=s, end=e) for c, s, e in self.leased],
            inner_steps=1,
            base_digest=self.base_digest,
            loss=1.0,
            compute_s=1.0,
            wall_s=2.0,
        )

    def _tensors(self, fill: Callable[[tuple[int, ...]], np.ndarray]) -> list[EncodedTensor]:
        return [
            EncodedTensor(n, "fp32", "float32", s, 0, 0, fill(s).astype("<f4").tobytes())
            for n, s in sorted(self.shapes.items())
        ]

    def _stream(self, meta: pb.PushMeta, tensors: list[EncodedTensor]) -> list[Any]:
        return list(push_wire_chunks(meta, tensors, int(self.pick([1024, 4096, 1 << 20]))))

    @staticmethod
    def _bytes(chunks: list[Any]) -> list[bytes]:
        return [c if isinstance(c, bytes) else c.SerializeToString() for c in chunks]

    def _push_meta(self) -> Shot:
        name, md = self.who()
        meta = self._meta(name)
        key = self.pick(["loss", "compute_s", "wall_s", "tokens", "fragment", "round", "base_digest", "run_id"])
        value = {
            "tokens": self.uint(64),
            "fragment": self.uint(32),
            "round": self.uint(64),
            "base_digest": self.rng.bytes(32),
            "run_id": self.text(),
        }.get(key, self.number())
        setattr(meta, key, value)
        chunks = self._stream(meta, self._tensors(np.zeros))
        return Shot("PushPseudoGrad", f"push {key}={str(value)[:40]}", self._bytes(chunks), md)

    def _push_header(self) -> Shot:
        name, md = self.who()
        chunks = self._stream(self._meta(name), self._tensors(np.zeros))
        header, t = chunks[0].header, chunks[0].header.tensors[0]
        what = self.pick(
            ["nbytes", "total", "count", "codec", "dims", "zstd", "block", "many", "dtype", "name", "offset"]
        )
        if what == "nbytes":
            t.nbytes = self.uint(64)
        elif what == "total":
            header.total_bytes = self.pick([2**63, 2**40, header.total_bytes + 1])
        elif what == "count":
            header.chunk_count = self.pick([0, 2**32 - 1, header.chunk_count + 1])
        elif what == "codec":
            t.codec = self.pick(["int4", "int8", "bf16", "rot13", ""])
        elif what == "dims":
            t.shape.extend([2**40] * int(self.rng.integers(1, 60)))
        elif what == "zstd":
            t.zstd_level = self.pick([1, 99, -5])
        elif what == "block":
            t.codec, t.block_size = "int8", self.pick([0, 1, 2**31])
        elif what == "many":
            header.tensors.extend(
                [
                    pb.TensorMeta(name=f"t{i}", codec="fp32", dtype="float32", shape=[1], nbytes=4)
                    for i in range(int(self.rng.integers(100, 50_000)))
                ]
            )
        elif what == "dtype":
            t.dtype = self.pick(["float64", "int8", "", "float16"])
        elif what == "offset":  # a piece (floor/codec.py, "Pieces") of any rank, anywhere, alone or twice
            rank = max(0, len(t.shape) + self.pick([0, 0, 1, -1]))
            t.offset.extend(int(i) for i in self.rng.integers(-(2**40), 2**40, size=rank))
            if self.pick([False, True]):
                header.tensors.append(header.tensors[0])
        else:
            t.name = self.pick(["", self.text(), header.tensors[-1].name])
        return Shot("PushPseudoGrad", f"push header {what}", self._bytes(chunks), md)

    def _push_chunks(self) -> Shot:
        name, md = self.who()
        raw = self._bytes(self._stream(self._meta(name), self._tensors(np.zeros)))
        what = self.pick(["reorder", "repeat", "truncate", "digest", "garbage", "empty", "extra", "only_data"])
        if what == "reorder" and len(raw) > 2:
            raw[1], raw[2] = raw[2], raw[1]
        elif what == "repeat":
            raw.insert(1, raw[min(1, len(raw) - 1)])
        elif what == "truncate":
            raw = raw[: max(1, len(raw) - 1)]
        elif what == "digest":
            raw[-1] = raw[-1][:-1] + bytes([raw[-1][-1] ^ 1])
        elif what == "garbage":
            raw[int(self.rng.integers(len(raw)))] = self.rng.bytes(int(self.rng.integers(1, 5000)))
        elif what == "empty":
            raw = []
        elif what == "extra":
            raw.append(raw[-1])
        else:
            raw = raw[1:] or [self.rng.bytes(10)]
        return Shot("PushPseudoGrad", f"push chunks {what}", raw, md)

    def _push_values(self) -> Shot:
        """An insider's push that passes every wire check: real credentials, round, base digest, fp32."""
        name = self.pick(self.names)
        md = call_metadata(name, self.secrets.get(name) if self.secrets else None)
        value = self.pick([3.4e38, -3.4e38, 1e30, 1e-40, 1e-45])
        chunks = self._stream(self._meta(name), self._tensors(lambda s: np.full(s, value, np.float32)))
        return Shot("PushPseudoGrad", f"push insider values={value}", self._bytes(chunks), md)

    def _raw(self) -> Shot:
        _, md = self.who()
        rpc = self.pick(
            ["Join", "Heartbeat", "Leave", "Status", "PullGlobal", "PushPseudoGrad", "Admit", "Retire", "Lease"]
        )
        data = [self.rng.bytes(int(self.rng.integers(0, 2000))) for _ in range(int(self.rng.integers(1, 4)))]
        return Shot(rpc, f"raw bytes to {rpc}", data if rpc == "PushPseudoGrad" else data[0], md)


def fire(channel: grpc.Channel, shot: Shot) -> grpc.StatusCode:
    """Send one shot and return the status it got (OK when accepted)."""
    method = SERVICE + shot.rpc
    try:
        if shot.rpc == "PushPseudoGrad":
            channel.stream_unary(method)(iter(shot.payload), metadata=shot.metadata, timeout=CALL_TIMEOUT_S)
        elif shot.rpc == "PullGlobal":
            for _ in channel.unary_stream(method)(shot.payload, metadata=shot.metadata, timeout=CALL_TIMEOUT_S):
                pass
        else:
            channel.unary_unary(method)(shot.payload, metadata=shot.metadata, timeout=CALL_TIMEOUT_S)
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


class Flood:
    """Calls that send nothing until the server gives up on them: idle push streams and heartbeats."""

    def __init__(self, channel: grpc.Channel, forge: Forge, streams: int = 48, unary: int = 24) -> None:
        self._release = threading.Event()
        push, beat = channel.stream_unary(SERVICE + "PushPseudoGrad"), channel.stream_unary(SERVICE + "Heartbeat")
        insider = forge.names[-1]
        beat_md = call_metadata(insider, forge.secrets.get(insider) if forge.secrets else None)
        self.calls = [
            push.future(self._silent(), metadata=forge.who()[1], timeout=CALL_TIMEOUT_S * 4) for _ in range(streams)
        ]
        self.calls += [beat.future(self._silent(), metadata=beat_md, timeout=CALL_TIMEOUT_S * 4) for _ in range(unary)]

    def _silent(self) -> Iterator[bytes]:
        self._release.wait()
        yield from ()

    def codes(self) -> Counter[str]:
        """How each call ended (waits for all; the server's timeouts end them)."""
        out: Counter[str] = Counter()
        for call in self.calls:
            err = call.exception()
            out["OK" if err is None else err.code().name] += 1
        self._release.set()
        return out


def _probe(address: str, forge: Forge) -> dict[str, Any]:
    """A real island's Status and heartbeat while the flood hangs: answered, and how fast."""
    name = forge.names[0]
    config = TransportConfig(max_attempts=1, rpc_timeout_s=CALL_TIMEOUT_S)
    out: dict[str, Any] = {}
    with GrpcTransport(address, name, forge.secrets.get(name) if forge.secrets else None, config=config) as c:
        for what, call in (
            ("status", c.status),
            (
                "heartbeat",
                lambda: c.heartbeat(pb.HeartbeatRequest(run_id=forge.cfg.run.name, island=name, round=forge.round)),
            ),
        ):
            t0 = time.monotonic()
            try:
                call()
                out[what] = {"code": "OK", "s": round(time.monotonic() - t0, 3)}
            except TransportError as exc:  # reported, not raised: the probe's failure is the finding
                out[what] = {"code": exc.code.name, "s": round(time.monotonic() - t0, 3)}
    return out


def _fuzz(address: str, forge: Forge, messages: int, threads: int) -> dict[str, Any]:
    codes: Counter[str] = Counter()
    by_rpc: dict[str, Counter[str]] = {}
    bad: list[str] = []
    lock = threading.Lock()
    shots = iter(forge.shot, None)
    left = [messages]
    options = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]

    def worker() -> None:
        with grpc.insecure_channel(address, options=options) as channel:
            while True:
                with lock:
                    if left[0] <= 0:
                        return
                    left[0] -= 1
                    shot = next(shots)
                code = fire(channel, shot)
                with lock:
                    codes[code.name] += 1
                    by_rpc.setdefault(shot.rpc, Counter())[code.name] += 1
                    if code in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL) and len(bad) < 10:
                        bad.append(f"{code.name}: {shot.rpc} {shot.label}")

    pool = [threading.Thread(target=worker, name=f"fuzz-{i}", daemon=True) for i in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    unknown = codes["UNKNOWN"] + codes["INTERNAL"]
    return {
        "messages": sum(codes.values()),
        "codes": dict(codes),
        "by_rpc": {k: dict(v) for k, v in by_rpc.items()},
        "unknown_or_internal": unknown,
        "unknown_or_internal_shots": bad,
        "client_deadline_exceeded": codes["DEADLINE_EXCEEDED"],
    }


def _metrics_bytes(fed: Federation) -> int:
    path = fed.run_dir / "metrics.jsonl"
    return path.stat().st_size if path.exists() else 0


def _run(mode: str, messages: int, seed: int, run_dir: Path, tmp: Path, threads: int) -> dict[str, Any]:
    island_secrets = {f"island-{i}": secrets.token_hex(16) for i in range(2)}
    refs = []
    for i, secret in enumerate(island_secrets.values()):
        (tmp / f"{mode}-secret-{i}").write_text(secret)
        refs.append(f"file:{tmp / f'{mode}-secret-{i}'}")
    config = tmp / f"{mode}.toml"
    config.write_text(load_config_text(2, 1000, refs))
    operator = secrets.token_hex(16)
    (tmp / f"{mode}-operator").write_text(operator)
    overrides = [
        *FUZZ_OVERRIDES,
        f"network.operator_secret=file:{tmp / f'{mode}-operator'}",
        *(["network.secrets=[]"] if mode == "open" else []),
    ]
    cfg = load_config(config, overrides)
    known = island_secrets if mode == "auth" else None
    with _federation(config, overrides, run_dir / mode) as fed:
        address = fed.start_coordinator()
        assert fed.coordinator is not None
        pid = fed.coordinator.pid
        insider = cfg.islands.island_names[0]
        with GrpcTransport(address, insider, known.get(insider) if known else None) as client:
            full = client.pull(pb.PullRequest(run_id=cfg.run.name, island=insider, have_round=-1, full=True))
            leased = _insiders_lease(client, cfg, insider)
        forge = Forge(cfg, known, full, np.random.default_rng([seed, mode == "auth"]), operator, leased)
        before, metrics_before = proc_memory_kib(pid), _metrics_bytes(fed)
        with grpc.insecure_channel(address) as flood_channel:
            flood = Flood(flood_channel, forge)
            probe = _probe(address, forge)
            flood_codes = flood.codes()  # once the server has cut them all, so that the shots meet free slots
        result = _fuzz(address, forge, messages, threads)
        after, alive = proc_memory_kib(pid), fed.coordinator.poll() is None
        result |= {
            "idle_flood": {"calls": len(flood.calls), "codes": dict(flood_codes), "probes_meanwhile": probe},
            "coordinator_alive": alive,
            "rss_mib_before": round(before["VmRSS"] / 1024, 1),
            "rss_mib_after": round(after["VmRSS"] / 1024, 1),
            "rss_mib_peak": round(after["VmHWM"] / 1024, 1),
            "metrics_growth_bytes": _metrics_bytes(fed) - metrics_before,
            "rejected_events": len(fed.events("rejected")),
        }
        result["legit_round"] = _legit_round(fed) if alive else {"committed": False, "why": "coordinator died"}
    return result


def _insiders_lease(client: GrpcTransport, cfg: RunConfig, insider: str) -> list[tuple[int, int, int]]:
    """The first island joins and leases a round's chunk spans, as an insider holding its secret can: its pushes
    then claim real spans (or lies about them) against a ledger that has leased them."""
    client.join(
        pb.JoinRequest(
            run_id=cfg.run.name,
            island=insider,
            config_digest=bytes.fromhex(config_digest(cfg)),
            release=RELEASE,
            last_round=-1,
        )
    )
    per_round = cfg.train.inner_steps * cfg.train.batch_size
    reply = client.lease(pb.LeaseRequest(run_id=cfg.run.name, island=insider, round=0, sequences=per_round))
    return [(s.chunk, s.start, s.end) for s in reply.spans]


def _legit_round(fed: Federation, timeout_s: float = 240.0) -> dict[str, Any]:
    """Start the run's real islands and wait for a round committed after one of them pushed (a tiny round takes
    seconds; the timeout allows for a loaded machine). A miss keeps every process's last log lines: the finding."""
    t0 = time.monotonic()
    try:
        for name in fed.names:
            fed.start_island(name)
        pushed = lambda: any(fed.events("pushed", island=n) for n in fed.names)
        fed.wait_for(pushed, timeout_s, "a real island's push")
        rounds = fed.wait_rounds(len(fed.rounds()) + 1, timeout_s)
    except FederationError as exc:  # the finding, not the benchmark's failure
        logs = {name: log_lines(fed.log_path(name))[-8:] for name in fed.processes()}
        return {
            "committed": False,
            "why": str(exc).splitlines()[0],
            "s": round(time.monotonic() - t0, 1),
            "coordinator_state": fed.events()[-5:],
            "logs": logs,
        }
    losses = [r["eval_loss"] for r in rounds if "eval_loss" in r]
    return {
        "committed": True,
        "s": round(time.monotonic() - t0, 1),
        "round": rounds[-1]["round"],
        "eval_losses_finite": all(math.isfinite(x) for x in losses),
    }


MODES = ("auth", "open")


def run_fuzz_bench(
    messages: int = 5000, seed: int = 0, run_dir: Path | None = None, threads: int = 4, modes: tuple[str, ...] = MODES
) -> dict:
    """Fuzz a coordinator with secrets and one without (`modes`), ``messages`` in all (shared equally); see the
    module docstring."""
    if not modes or set(modes) - set(MODES):
        raise BenchError(f"bench fuzz: modes must be some of {', '.join(MODES)} (got {', '.join(modes) or 'none'})")
    if messages < len(modes) or threads < 1:
        raise BenchError(f"bench fuzz: --messages must be >= {len(modes)} (got {messages})")
    run_dir = run_dir or Path("runs") / f"bench-fuzz-{time.strftime('%Y%m%d-%H%M%S')}"
    if run_dir.exists() and any(run_dir.iterdir()):  # its islands' directories would hold another run's secrets
        raise BenchError(f"bench fuzz: --run-dir '{run_dir}' is not empty; give a new one")
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-fuzz-") as tmp:
        runs = {mode: _run(mode, messages // len(modes), seed, run_dir, Path(tmp), threads) for mode in modes}
    return {
        "bench": "fuzz",
        "seed": seed,
        "run_dir": str(run_dir),
        "messages_sent": sum(r["messages"] for r in runs.values()),
        "unknown_or_internal": sum(r["unknown_or_internal"] for r in runs.values()),
        "coordinator_alive": all(r["coordinator_alive"] for r in runs.values()),
        "legit_round_completed": all(r["legit_round"]["committed"] for r in runs.values()),
        "runs": runs,
        "wall_s": round(time.monotonic() - t0, 1),
    }
