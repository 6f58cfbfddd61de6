"""Answering pulls: what the pure `membership.answer_pull` says, turned into a payload, with the waits it asks for.

A pull gets the commit of the island's sync position (it moves one sync on), the full θ (new, restarted, lagging),
a wait for the open sync, or "push first". A pull sent right after its island's push (`PullRequest.after_push`)
first gives that push `PUSH_LANDING_S` to land, and a push still streaming in (`receiving`) holds the pull until it
is through, so an island that asks for the commit as soon as its push is on the wire is not told to push again.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Iterator, Sequence

import grpc

from diloco.config import RunConfig
from diloco.coordinator.commit_window import CommitWindow
from diloco.coordinator.committer import refuse_if_diverged
from diloco.coordinator.membership import PullKind, PullView, answer_pull
from diloco.coordinator.push_admission import PushAdmission
from diloco.ops.metrics import CoordinatorMetrics
from diloco.run.global_run import GlobalRun
from floor.codec import CodecSpec, EncodedTensor
from pytrees.encode import encode_named
from pytrees.naming import flatten_named
from transport import diloco_pb2 as pb
from transport.errors import Rejected
from transport.handler import PullPayload

FP32 = CodecSpec(kind="fp32")
PUSH_LANDING_S = 2.0
"""How long a pull sent right after its island's push gives that push to reach the coordinator before the answer is
"push first": the push was on the wire first, so it lands about when the pull does, and once it is streaming in,
`PullAnswers.arriving` holds the pull anyway. A push that never lands (lost with a coordinator that restarted) costs
its island this long, then a push again."""
PUSH_MISSING = (PullKind.PUSH_FIRST, PullKind.RESYNC)
"""The answers a pull gets when the coordinator holds no push of the island's for the sync it asks about."""


def position_of(req: pb.PullRequest, fragments: int) -> int:
    """The sync position a pull says the island holds (-1: none); (round, fragment) on the wire."""
    return -1 if req.have_round < 0 else req.have_round * fragments + req.fragment


class PullAnswers:
    """Answers pulls under the coordinator's condition variable, and tracks the pushes streaming in."""

    def __init__(
        self,
        cfg: RunConfig,
        world: GlobalRun,
        cond: threading.Condition,
        admission: PushAdmission,
        window: CommitWindow,
        metrics: CoordinatorMetrics,
    ) -> None:
        self.cfg = cfg
        self.world = world
        self.cond = cond
        self.admission = admission
        self.window = window
        self.metrics = metrics
        self.arriving: Counter[tuple[str, int]] = Counter()
        """Pushes streaming in, by island and sync position: a pull for a position whose push is still arriving
        waits for it (`PullView.arriving`). Bounded by the push streams the server runs at once."""

    @contextlib.contextmanager
    def receiving(self, meta: pb.PushMeta) -> Iterator[None]:
        """While a push whose first chunk passed the service's checks streams in and is handed to the coordinator."""
        key = (meta.island, meta.round * self.world.loop.fragments.count + meta.fragment)
        with self.cond:
            self.arriving[key] += 1
        try:
            yield
        finally:
            with self.cond:
                self.arriving[key] -= 1
                if not self.arriving[key]:
                    del self.arriving[key]
                self.cond.notify_all()  # a pull held for it decides again: the push landed, or it failed

    def answer(self, req: pb.PullRequest) -> PullPayload:
        with self.cond:
            refuse_if_diverged(self.world)
            if req.after_push:  # its push left just before it: let that land (or fail) before "push first"
                self.cond.wait_for(
                    lambda: answer_pull(self._view(req)).kind not in PUSH_MISSING,
                    timeout=min(PUSH_LANDING_S, self.cfg.network.pull_wait_s),
                )
            answer = answer_pull(self._view(req))
            if answer.kind is PullKind.WAIT:
                self.cond.wait_for(
                    lambda: answer_pull(self._view(req)).kind is not PullKind.WAIT, timeout=self.cfg.network.pull_wait_s
                )
                answer = answer_pull(self._view(req))
            if answer.kind is not PullKind.UPDATE and answer.kind is not PullKind.FULL:
                self.metrics.pulled(req.island, answer.kind.value, 0)
            if answer.kind is PullKind.WAIT:  # ABORTED is retryable: the island asks again, keeping its lease
                raise Rejected(grpc.StatusCode.ABORTED, f"{answer.reason}; retry")
            if answer.kind in PUSH_MISSING:
                raise Rejected(grpc.StatusCode.FAILED_PRECONDITION, f"island {req.island}: {answer.reason}")
            return self._payload(req, answer.kind)

    def _payload(self, req: pb.PullRequest, kind: PullKind) -> PullPayload:
        """What a pull answered UPDATE or FULL carries: the commit of the island's position, or θ in fp32."""
        loop = self.world.loop
        if kind is PullKind.UPDATE:
            position = position_of(req, loop.fragments.count)
            commit = self.window.commits[position]
            tensors: Sequence[EncodedTensor] = commit.encoded
            reaches, digest, shared = position + 1, commit.fragment_digest, self.window.streams.get(position)
        else:
            tensors = encode_named(flatten_named(loop.params), FP32)
            reaches, digest, shared = loop.sync, self.world.params_digest, None
        island = req.island
        nbytes = sum(len(t.payload) for t in tensors)
        self.world.totals.bytes_down += nbytes
        self.metrics.pulled(req.island, kind.value, nbytes)
        round_, fragment = divmod(reaches, loop.fragments.count)
        return PullPayload(
            round=round_,
            fragment=fragment,
            kind=kind.value,
            param_digest=bytes.fromhex(digest),
            tensors=tensors,
            shared=shared,
            on_done=lambda: self._served(island, reaches - 1),
        )

    def _served(self, island: str, position: int) -> None:
        """A pull that carried the commit of sync ``position`` (or a later θ) to ``island`` is over."""
        with self.cond:
            if self.window.served_to(island, position):
                self.cond.notify_all()

    def _view(self, req: pb.PullRequest) -> PullView:
        loop = self.world.loop
        have = position_of(req, loop.fragments.count)
        pushed = self.admission.pending if have == loop.sync else self.admission.early.get(have, {})
        return PullView(
            have_round=have,
            full=req.full,
            round=loop.sync,
            done=self.world.done,
            pushed=req.island in pushed,
            arriving=(req.island, have) in self.arriving,
            last_commit_round=self.window.last_position,
            kept=self.window.kept,
        )
