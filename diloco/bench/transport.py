"""`diloco bench transport`: goodput of a real chunked gRPC push, shaped efficiency, and receiver peak memory.

Measures what the cost model (docs/architecture.md) assumes of the wire (``T_comm = bytes / bandwidth + RTT``):

* ``unshaped_gbps``: payload bytes / wall time of a `GrpcTransport.push` of ``payload_mb`` MiB of fp32
  tensors (``tensor_mb`` MiB each, like a model's weight matrices) over loopback, including chunking, both
  blake2b digests, reassembly and the server's full validation (decode + finiteness). GB = 1e9 bytes. The
  median of ``repeats`` pushes after one full-size warm-up push: the steady state of a coordinator that
  receives a same-sized push every round (``unshaped_first_gbps`` is the first, cold one: fresh receive
  buffer). Next to it, the CPU seconds each side spent per push (median) and the 1-minute load average,
  because on a shared machine the figure is bounded by the CPU the two processes get, not by the wire.
* ``shaped_fraction``: achieved bits/s / configured bits/s for a ``shaped_mb`` MiB push through a
  `LinkShaper` at ``shaped_mbps`` Mbit/s (1e6 bits/s), latency 0.
* ``peak_rss_mb``: ``ru_maxrss`` of the receiving server process after a ``rss_payload_mb`` MiB push. The
  server runs in its own process (``multiprocessing`` spawn) so the figure is the receiver alone; it is
  reported next to the bound ``2 x payload + 200 MiB`` and the process's RSS before receiving (imports).

Run: ``diloco bench transport [--payload-mb 256] [--shaped-mbps 50] [--shaped-mb 20]`` (JSON on stdout).
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import resource
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from diloco.bench.errors import BenchError
from floor.codec import EncodedTensor
from transport import diloco_pb2 as pb
from transport.config import TransportConfig
from transport.grpc_client import GrpcTransport
from transport.handler import PullPayload
from transport.shaper import LinkProfile, LinkShaper

MIB = 1 << 20
RUN_ID = "bench-transport"


class _SinkHandler:
    """Accepts every validated push and drops it; reports its process's memory and CPU time in `status`."""

    def join(self, req: pb.JoinRequest) -> pb.JoinReply:
        return pb.JoinReply(run_id=RUN_ID)

    def heartbeat(self, req: pb.HeartbeatRequest) -> pb.HeartbeatReply:
        return pb.HeartbeatReply()

    def leave(self, req: pb.LeaveRequest) -> pb.LeaveReply:
        return pb.LeaveReply(ok=True)

    def attend(self, req: pb.AttendRequest) -> pb.AttendReply:
        return pb.AttendReply(member=False)  # the bench measures pushes and pulls; nobody attends

    def absent(self, island: str) -> None:
        pass

    def receiving(self, meta: pb.PushMeta) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def admissible(self, meta: pb.PushMeta) -> None:
        pass

    def push(
        self, meta: pb.PushMeta, tensors: Sequence[EncodedTensor], arrays: dict[str, np.ndarray], payload_digest: bytes
    ) -> pb.PushReply:
        return pb.PushReply(accepted=True)

    def pull(self, req: pb.PullRequest) -> PullPayload:
        return PullPayload(round=0, fragment=0, kind="full", param_digest=b"", tensors=[])

    def status(self) -> pb.StatusReply:
        maxrss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
        with open("/proc/self/statm") as f:
            rss_mb = int(f.read().split()[1]) * resource.getpagesize() / MIB
        detail = json.dumps({"maxrss_mb": maxrss_mb, "rss_mb": rss_mb, "cpu_s": _cpu_s()})
        return pb.StatusReply(run_id=RUN_ID, detail_json=detail)


def _cpu_s() -> float:
    """User + system CPU seconds of this process so far (all threads)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _layout(nbytes: int, tensor_bytes: int) -> list[int]:
    """Element counts of the fp32 tensors making up ``nbytes``."""
    full, rest = divmod(nbytes, tensor_bytes)
    return [tensor_bytes // 4] * full + ([rest // 4] if rest >= 4 else [])


def _spec(layout: list[int]) -> dict[str, tuple[tuple[int, ...], str]]:
    return {f"t{i:04d}": ((n,), "float32") for i, n in enumerate(layout)}


def _serve(conn: Any, layouts: list[list[int]], config: TransportConfig) -> None:
    """Child process: a sink handler; fragment f of a push must carry the tensors of ``layouts[f]``."""
    from transport.grpc_server import start_server
    from transport.service import DilocoService

    specs = [_spec(layout) for layout in layouts]
    # One fragment per benchmark push, so each push is its own idempotency key (no dedup shortcut).
    server = start_server(DilocoService(_SinkHandler(), RUN_ID, specs.__getitem__, config=config))
    conn.send(server.port)
    conn.recv()  # wait for the parent to say stop
    server.stop(0)


class _ServerProcess:
    def __init__(self, layouts: list[list[int]], config: TransportConfig) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, layouts, config), daemon=True)
        self.proc.start()
        if not self._conn.poll(120):
            raise BenchError("bench transport: the receiving server did not start within 120 s")
        self.address = f"127.0.0.1:{self._conn.recv()}"

    def memory(self, client: GrpcTransport) -> dict[str, float]:
        return json.loads(client.status().detail_json)

    def stop(self) -> None:
        self._conn.send("stop")
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()


def _payload(layout: list[int], seed: int) -> list[EncodedTensor]:
    rng = np.random.default_rng(seed)
    return [
        EncodedTensor(name, "fp32", "float32", shape, 0, 0, rng.standard_normal(shape[0], np.float32).tobytes())
        for name, (shape, _) in _spec(layout).items()
    ]


def _push(client: GrpcTransport, fragment: int, tensors: list[EncodedTensor]) -> float:
    meta = pb.PushMeta(run_id=RUN_ID, island="bench", round=0, fragment=fragment, tokens=1)
    t0 = time.perf_counter()
    reply = client.push(meta, tensors)
    elapsed = time.perf_counter() - t0
    if not reply.accepted:
        raise BenchError(f"bench transport: push refused: {reply.detail}")
    return elapsed


def run_transport_bench(
    payload_mb: int = 256,
    shaped_mbps: float = 50.0,
    shaped_mb: int = 20,
    rss_payload_mb: int = 512,
    tensor_mb: int = 4,
    repeats: int = 3,
) -> dict[str, Any]:
    """Run the three measurements; return the figures (see the module docstring)."""
    sizes = {"payload_mb": payload_mb, "shaped_mb": shaped_mb, "rss_payload_mb": rss_payload_mb}
    for key, value in {**sizes, "tensor_mb": tensor_mb, "shaped_mbps": shaped_mbps, "repeats": repeats}.items():
        if not value > 0:
            raise BenchError(f"bench transport: {key} must be > 0 (got {value})")
    tensor_bytes = int(tensor_mb * MIB)
    big, small, rss = (_layout(int(sizes[k] * MIB), tensor_bytes) for k in sizes)
    config = TransportConfig(max_payload_mb=max(payload_mb, rss_payload_mb) + 1, rpc_timeout_s=600)
    result: dict[str, Any] = {**sizes, "shaped_mbps": shaped_mbps, "tensor_mb": tensor_mb, "repeats": repeats}

    # Fragments: 0 .. repeats timed (0 also warms up channel, threads and buffers), then one shaped push.
    # Each push is its own fragment, hence its own idempotency key (no dedup shortcut).
    server = _ServerProcess([big] * (repeats + 1) + [small], config)
    try:
        seconds, client_cpu, server_cpu = [], [], []
        with GrpcTransport(server.address, "bench", config=config) as client:
            payload = _payload(big, seed=0)
            for fragment in range(repeats + 1):
                cpu0, server0 = _cpu_s(), server.memory(client)["cpu_s"]
                seconds.append(_push(client, fragment, payload))
                client_cpu.append(_cpu_s() - cpu0)
                server_cpu.append(server.memory(client)["cpu_s"] - server0)
            del payload
        steady = seconds[1:]
        result["unshaped_first_gbps"] = payload_mb * MIB / seconds[0] / 1e9
        result["unshaped_all_s"] = seconds
        result["unshaped_s"] = float(np.median(steady))
        result["unshaped_gbps"] = payload_mb * MIB / result["unshaped_s"] / 1e9
        result["unshaped_client_cpu_s"] = float(np.median(client_cpu[1:]))
        result["unshaped_server_cpu_s"] = float(np.median(server_cpu[1:]))
        result["load_average_1m"] = os.getloadavg()[0]
        shaper = LinkShaper(LinkProfile(up_mbps=shaped_mbps, down_mbps=shaped_mbps), seed=0)
        with GrpcTransport(server.address, "bench", config=config, shaper=shaper) as client:
            shaped_s = _push(client, repeats + 1, _payload(small, seed=2))
        result["shaped_s"] = shaped_s
        result["shaped_achieved_mbps"] = shaped_mb * MIB * 8 / shaped_s / 1e6
        result["shaped_fraction"] = result["shaped_achieved_mbps"] / shaped_mbps
    finally:
        server.stop()

    server = _ServerProcess([rss], config)
    try:
        with GrpcTransport(server.address, "bench", config=config) as client:
            before = server.memory(client)
            _push(client, 0, _payload(rss, seed=3))
            after = server.memory(client)
    finally:
        server.stop()
    result["rss_before_mb"] = before["rss_mb"]
    result["peak_rss_mb"] = after["maxrss_mb"]
    result["peak_rss_bound_mb"] = 2 * rss_payload_mb + 200
    result["targets_met"] = {
        "unshaped_gbps>=0.4": result["unshaped_gbps"] >= 0.4,
        "shaped_fraction>=0.9": result["shaped_fraction"] >= 0.9,
        "peak_rss<=2x+200MB": result["peak_rss_mb"] <= result["peak_rss_bound_mb"],
    }
    return result
