"""A small, real `CoordinatorHandler` that keeps its state in memory: the transport tests' server-side peer.

It is not the DiLoCo coordinator (that lives in ``diloco/``): it applies each accepted push as
``θ -= lr * Δ`` immediately and serves θ as full fp32 parameters, which is enough to observe whether the
wire ever lets a message reach state (``state_digest`` changes iff the handler applied something).
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
from collections.abc import Mapping, Sequence

import numpy as np

from diloco.coordinator.push_admission import AcceptedPushes
from floor.codec import EncodedTensor
from transport import diloco_pb2 as pb
from transport.handler import PullPayload
from transport.validate import check_round


def params_digest(params: Mapping[str, np.ndarray]) -> bytes:
    """blake2b over the leaves in sorted-name order (name, shape, dtype, bytes)."""
    h = hashlib.blake2b(digest_size=32)
    for name in sorted(params):
        a = np.ascontiguousarray(params[name])
        h.update(name.encode())
        h.update(repr((a.shape, str(a.dtype))).encode())
        h.update(memoryview(a).cast("B"))
    return h.digest()


def fp32_tensor(name: str, array: np.ndarray) -> EncodedTensor:
    """An fp32-encoded tensor (the lossless codec's layout: little-endian float32)."""
    a = np.ascontiguousarray(array, dtype="<f4")
    return EncodedTensor(name, "fp32", "float32", tuple(a.shape), 0, 0, a.tobytes())


class ReferenceHandler:
    """In-memory handler: counts calls, applies pushes to θ, answers pulls with θ."""

    def __init__(self, run_id: str, params: Mapping[str, np.ndarray], lr: float = 1.0) -> None:
        self.run_id = run_id
        self.params = {k: np.array(v, dtype=np.float32) for k, v in params.items()}
        self.lr = lr
        self.round = 0
        self.applied: list[tuple[str, int, int, int]] = []
        self.members: dict[str, int] = {}
        self.absences: list[str] = []
        """Islands whose presence call broke, in order (`absent`)."""
        self.absent_event = threading.Event()
        self.accepted = AcceptedPushes(capacity=4096)
        """Accepted pushes, answered again to their retries (the coordinator's own `AcceptedPushes`)."""
        self._lock = threading.Lock()

    def model_spec(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """The (shape, dtype) of every parameter, for the service's validation."""
        return {k: (tuple(v.shape), "float32") for k, v in self.params.items()}

    def state_digest(self) -> bytes:
        """Digest of everything a push could change."""
        with self._lock:
            h = hashlib.blake2b(params_digest(self.params), digest_size=32)
            h.update(repr((self.round, self.applied, sorted(self.members.items()))).encode())
            return h.digest()

    def join(self, req: pb.JoinRequest) -> pb.JoinReply:
        with self._lock:
            self.members[req.island] = self.round
            return pb.JoinReply(
                run_id=self.run_id,
                round=self.round,
                lease_s=10.0,
                needs_full_params=req.last_round != self.round,
                state="training",
            )

    def heartbeat(self, req: pb.HeartbeatRequest) -> pb.HeartbeatReply:
        return pb.HeartbeatReply(round=self.round, lease_s=10.0, state="training")

    def leave(self, req: pb.LeaveRequest) -> pb.LeaveReply:
        with self._lock:
            self.members.pop(req.island, None)
        return pb.LeaveReply(ok=True)

    def attend(self, req: pb.AttendRequest) -> pb.AttendReply:
        with self._lock:
            return pb.AttendReply(member=req.island in self.members, state="training", reconnect_grace_s=1.0)

    def absent(self, island: str) -> None:
        with self._lock:
            self.absences.append(island)
            self.absent_event.set()

    def receiving(self, meta: pb.PushMeta) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def admissible(self, meta: pb.PushMeta) -> None:
        with self._lock:
            if (meta.island, meta.round, meta.fragment) not in self.accepted:
                check_round(meta.round, self.round)

    def push(
        self, meta: pb.PushMeta, tensors: Sequence[EncodedTensor], arrays: dict[str, np.ndarray], payload_digest: bytes
    ) -> pb.PushReply:
        key = (meta.island, meta.round, meta.fragment)
        with self._lock:
            replayed = self.accepted.replay(key, payload_digest)
            if replayed is not None:
                return replayed
            check_round(meta.round, self.round)  # the round may have moved on while the bytes streamed in
            for name, delta in arrays.items():
                self.params[name] -= self.lr * delta.astype(np.float32)
            self.applied.append((meta.island, meta.round, meta.fragment, meta.tokens))
            return self.accepted.remember(
                key, payload_digest, pb.PushReply(accepted=True, round=self.round, detail="applied")
            )

    def pull(self, req: pb.PullRequest) -> PullPayload:
        with self._lock:
            tensors = [fp32_tensor(k, self.params[k]) for k in sorted(self.params)]
            return PullPayload(
                round=self.round,
                fragment=req.fragment,
                kind="full",
                param_digest=params_digest(self.params),
                tensors=tensors,
            )

    def status(self) -> pb.StatusReply:
        with self._lock:
            islands = [pb.IslandStatus(name=k, round=r, state="member") for k, r in sorted(self.members.items())]
            return pb.StatusReply(run_id=self.run_id, round=self.round, state="training", islands=islands)
