"""The global coordinator: the only owner of `GlobalState`, membership, and the open round.

It implements `transport.handler.CoordinatorHandler`, so the same object serves islands over gRPC (`diloco
coordinator`, `diloco launch`) or in-process. Every decision about closing a round or dropping an island comes from
the pure `membership.decide`; this class only applies it:

  push   -> a validated pseudo-gradient joins the open round (the transport already checked credentials, run id,
            round, names, shapes, dtypes, finiteness and digest; nothing unchecked reaches θ)
  tick   -> leases expire, the adaptive deadline passes, or everyone has pushed: the round closes
  close  -> `GlobalRun.close_round` (the same as simulate's): token-weighted mean, outer step, θ += û with
            û = decode(encode(u + e)), evaluate, checkpoint (finished before any island can see θ_{r+1}); then
            wake the waiting pulls
  pull   -> what the pure `membership.answer_pull` says: the committed û of the last round (island one round
            behind), the full θ (new, restarted, lagging), wait for the open round, or push first

A coordinator killed at any moment restarts from its last checkpoint: the round in flight is lost, islands that
pushed into it push again after resyncing, and nothing half-applied ever existed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np

from diloco import RELEASE, faults
from diloco.config import RunConfig, config_digest, diff_keys, to_dict
from diloco.global_run import GlobalRun, Settling, diverged_reason
from diloco.membership import REJOIN, Action, PullKind, PullView, RoundView, answer_pull, decide
from diloco.metrics import CoordinatorMetrics
from diloco.rejections import RejectionLog, clip
from diloco.rounds import Commit, OuterLoop, RoundError
from diloco.rundir import DiskFullError, RunDir
from diloco.setup import Setup
from diloco.summary import Totals
from islands.island import DivergedError
from outer_optimizer import discount, staleness_weight
from transport import diloco_pb2 as pb
from transport.codecs import CodecError, CodecSpec, EncodedTensor, encode_tree, flatten_named
from transport.errors import Rejected
from transport.handler import PullPayload
from transport.service import SharedPull
from transport.validate import ModelSpec

FP32 = CodecSpec(kind="fp32")
MAX_DROPPED = 256
"""Digests of dropped contributions remembered per round (16 bytes each), beyond which the oldest is forgotten."""
MEMBERSHIP_BURST = 10
"""`island_joined` (or `island_left`) events of one island written a minute: a supervised island that restarts
several times a minute still has each one logged; an insider's Join/Leave loop is counted, not logged."""
PUSH_LANDING_S = 2.0
"""How long a pull sent right after its island's push (`PullRequest.after_push`) gives that push to reach the
coordinator before the answer is "push first": the push was on the wire first, so it lands about when the pull does,
and once it is streaming in, `Coordinator.arriving` holds the pull anyway. A push that never lands (lost with a
coordinator that restarted) costs its island this long, then a push again."""
EVAL_YIELD_S = 2.0
"""The longest a commit's evaluation waits for the islands that contributed to it to be done with it
(`_yield_to_islands`): long enough for a pull of a large model over a slow link to be out of the way, short enough
that an island that died before pulling delays the evaluation (and the checkpoint behind it) only a little."""
PUSH_MISSING = (PullKind.PUSH_FIRST, PullKind.RESYNC)
"""The answers a pull gets when the coordinator holds no push of the island's for the sync it asks about."""


@dataclass(frozen=True)
class Early:
    """A validated push for a later sync than the open one (streaming), held until that sync opens."""

    round: int
    fragment: int
    delta: dict[str, np.ndarray]
    tokens: int
    content: bytes
    """Its `contribution_digest`."""


def contribution_digest(island: str, tensors: Sequence[EncodedTensor], payload_digest: bytes) -> bytes:
    """Who sent which bytes: what identifies a contribution once dropped. SHA-256 (cut to 16 bytes) of the island,
    each tensor's name and size, and the payload digest the transport verified as the bytes arrived (SHA-256 of the
    concatenated payloads, `transport.chunking.payload_digest`): it runs under the coordinator's lock on every
    push, so it hashes a few hundred bytes, not the payload again (25 MB and 14 ms for 6.38M fp32 parameters)."""
    h = hashlib.sha256(island.encode())
    for t in tensors:
        h.update(f"\0{t.name}\0{t.nbytes}".encode())
    h.update(payload_digest)
    return h.digest()[:16]


class Coordinator:
    """Owns θ, the outer optimizer state, membership and the round. Thread-safe (one condition variable)."""

    def __init__(
        self, cfg: RunConfig, rd: RunDir, setup: Setup, clock: Callable[[], float] = time.monotonic,
        metrics: CoordinatorMetrics | None = None,
    ) -> None:  # fmt: skip
        self.cfg = cfg
        self.rd = rd
        self.clock = clock
        self.names = cfg.islands.island_names
        self.metrics = metrics or CoordinatorMetrics(self.names)
        """Prometheus metrics (diloco/metrics.py), fed by this run dir's events from here on (restore's too)."""
        rd.observers.append(self.metrics.on_event)
        self.digest = bytes.fromhex(config_digest(cfg))
        self.config_dict = to_dict(cfg)
        self.world = GlobalRun(cfg, rd, setup, durable=True)
        self.world.start(self.world.latest_step())
        # Compile the commit's functions while islands start and train, off the lock (OuterLoop.warm_up).
        threading.Thread(target=self.world.loop.warm_up, args=(len(self.names),), name="warm-up", daemon=True).start()
        whole = {name: (tuple(a.shape), "float32") for name, a in flatten_named(setup.init_params).items()}
        fragments = self.loop.fragments
        self.model_spec: ModelSpec = whole if fragments.count == 1 else (lambda p: fragments.select(p, whole))
        """What a push may carry: every tensor of θ, or (streaming) the tensors of the fragment it names."""
        self.asynchronous = cfg.train.mode == "async"
        """Async Local-SGD (docs/architecture.md, "Asynchronous rounds"): every push is one update, committed at
        once with its Δ weighted by its staleness; nobody waits for a quorum."""
        self.kept = cfg.outer.max_staleness + 1 if self.asynchronous else fragments.count
        """Commits kept for pulls: one per fragment (streaming), or (async) the updates an island may have missed."""
        self.cond = threading.Condition()
        self.last_seen: dict[str, float] = {}
        self.broken: dict[str, float] = {}
        """Member -> when its presence call broke (transport/presence.py), until it is heard from again: after
        `quorum.reconnect_grace_s` it is lost (diloco/membership.py)."""
        self.last_loss: dict[str, float] = {}
        self.commits: dict[int, Commit] = {}
        """The last `kept` commits by sync position (`OuterLoop.sync`; the round without streaming): what pulls
        answer with."""
        self.streams: dict[int, SharedPull] = {}
        """Each of the last `kept` commits' update as its pulls send it, serialized (and hashed) once for them all."""
        self.served: dict[int, set[str]] = {}
        """The islands that have received each of the last `kept` commits (by sync position), as the transport tells
        once a pull's stream is over (`_served`): what that commit's evaluation waits for (`_yield_to_islands`)."""
        self.working: dict[str, int] = {}
        """The round each island last said (by heartbeat) it is training on: a plain commit is evaluated once its
        islands have moved past it (`_yield_to_islands`). Keyed by the run's island names only."""
        self.digests: dict[int, str] = {self.loop.sync: self.world.params_digest}
        """The digest of θ at each of the last `kept` positions: what an asynchronous push's base is checked against."""
        self.rejections = RejectionLog()
        self.memberships = RejectionLog(burst=MEMBERSHIP_BURST)
        """`island_joined` / `island_left` events written per island and kind a minute (`_membership_logged`)."""
        self.dropped: dict[bytes, str] = {}
        """Contributions to the open round dropped at commit (content digest -> why): the same bytes are refused if
        pushed again (an island re-pushing after a lost reply), a retrained Δ from the same island is not. Keyed by
        content, not by name: a name is barred by nothing but its credentials, so a dropped forgery under a real
        island's name must not lock that island out of the round (found by `diloco bench fuzz`). At most
        `MAX_DROPPED` entries; cleared at every commit."""
        # An island trains at most H steps of batch_size sequences of seq_len tokens per round: a larger claimed
        # weight is a lie (it would give that island the whole mean), so it is capped to this.
        self.max_tokens = cfg.train.inner_steps * cfg.train.batch_size * cfg.model.seq_len
        self.pending_digest: dict[str, bytes] = {}
        """The content digest of each pending contribution (island names are bounded to `names`)."""
        self.early: dict[int, dict[str, Early]] = {}
        """Streaming: pushes for the P - 1 syncs after the open one, by position then island, each joining its sync
        when it opens. A fast island sends its next fragment while a slower one still holds up the open sync, so
        several syncs are on the wire at once; bounded by islands x (P - 1) fragments."""
        self.arriving: Counter[tuple[str, int]] = Counter()
        """Pushes streaming in, by island and sync position (`receiving`): a pull for a position whose push is still
        arriving waits for it rather than being told to push first (diloco/membership.py, `PullView.arriving`).
        Bounded by the push streams the server runs at once."""
        self.opened_at = clock()
        self.on_rollback: Callable[[int], None] | None = None
        """Told the first round a rollback reopened (serve.py: the service forgets the pushes it accepted for it and
        later ones, which run again). Called without the lock held."""
        self._settle_queue: queue.Queue[tuple[int, Settling, dict[str, bytes], dict[bytes, str]] | None] = queue.Queue()
        self._generation = 0
        """Bumped by a rollback: commits queued before it were undone and are not settled."""
        self._stopping = False
        """Set by `close` and `flush`: commits are settled at once (`_hurry`)."""
        self._unsettled = 0
        self.failure: DiskFullError | None = None
        """Set when a checkpoint could not be written (no disk space): `serve` stops the run with it."""
        self._unsaved: tuple[Settling, dict] | None = None
        """The last kept commit that closed a round, with its checkpoint metadata, while its save was not due
        (train.checkpoint_every > 1): what `flush` saves on a graceful stop."""
        threading.Thread(target=self._settle_forever, name="settle", daemon=True).start()
        self.metrics.follow(self)

    # -- lifecycle ---------------------------------------------------------------------------------------------

    @property
    def loop(self) -> OuterLoop:
        return self.world.loop

    @property
    def last_commit(self) -> Commit | None:
        return self.commits[max(self.commits)] if self.commits else None

    @property
    def totals(self) -> Totals:
        return self.world.totals

    @property
    def run_id(self) -> str:
        return self.cfg.run.name

    @property
    def done(self) -> bool:
        """Every planned round is committed and settled (evaluated, logged, checkpointed)."""
        return self.world.done and self._unsettled == 0

    def flush(self) -> None:
        """A graceful stop (SIGTERM): once every commit is settled, checkpoint the last committed round if its save
        was not due, so that a restart resumes exactly where this process stopped."""
        self._hurry()
        self.settled()
        if self._unsaved is not None and self.world.store is not None:
            self.world.save(*self._unsaved)
            self._unsaved = None

    def close(self) -> None:
        self._hurry()
        self.settled()
        self._settle_queue.put(None)
        self.world.close()

    def _hurry(self) -> None:
        """Stopping: settle every commit now, without waiting for its islands (`_yield_to_islands`)."""
        with self.cond:
            self._stopping = True
            self.cond.notify_all()

    def settled(self, timeout_s: float | None = None) -> bool:
        """Wait until every commit so far is evaluated, logged and checkpointed (or undone); False on timeout."""
        with self.cond:
            return self.cond.wait_for(lambda: self._unsettled == 0, timeout=timeout_s)

    # -- CoordinatorHandler ------------------------------------------------------------------------------------

    def _state_name(self) -> str:
        if self.done:
            return "done"
        live = len(self.last_seen)
        return "training" if live >= self.cfg.quorum.min_islands else "waiting_quorum"

    def join(self, req: pb.JoinRequest) -> pb.JoinReply:
        if req.island not in self.names:
            raise Rejected(
                grpc.StatusCode.NOT_FOUND,
                f"island '{req.island}' is not in this run's config (islands.names: {', '.join(self.names)})",
            )
        if req.release != RELEASE:
            theirs = f"diloco {clip(req.release, 40)}" if req.release else "an older diloco (its join names no release)"
            raise Rejected(grpc.StatusCode.FAILED_PRECONDITION, f"island {req.island} runs {theirs}, the coordinator "
                           f"diloco {RELEASE}: run one release everywhere (θ is bit-identical only within one)")
        if bytes(req.config_digest) != self.digest:
            raise Rejected(grpc.StatusCode.FAILED_PRECONDITION, self._config_mismatch(req))
        with self.cond:
            now = self.clock()
            if req.island not in self.last_seen:
                self.totals.islands_joined += 1
                if self._membership_logged("island_joined", req.island):
                    self.rd.log("island_joined", round=self.loop.round, island=req.island, devices=req.devices)
            self._heard_from(req.island, now)
            return pb.JoinReply(
                run_id=self.run_id,
                round=self.loop.round,
                lease_s=self.cfg.quorum.lease_s,
                # A streaming island's local θ mixes fragments of several syncs: it always restarts from the full θ.
                needs_full_params=req.last_round != self.loop.round or self.loop.fragments.count > 1,
                state=self._state_name(),
            )

    def _config_mismatch(self, req: pb.JoinRequest) -> str:
        """Name the differing keys when the island's config_json is a readable object (it is only ever a hint)."""
        try:
            theirs = json.loads(req.config_json) if req.config_json else None
            keys = diff_keys(self.config_dict, theirs) if isinstance(theirs, dict) else []
        except (ValueError, TypeError, RecursionError):  # not JSON, unhashable keys, nested beyond reason
            keys = []
        named = f" in: {', '.join(clip(k, 60) for k in keys[:10])}" if keys else ""
        return f"island {req.island}'s config differs from the coordinator's{named}; start both from one config"

    def heartbeat(self, req: pb.HeartbeatRequest) -> pb.HeartbeatReply:
        with self.cond:
            if req.island not in self.last_seen and not self.done:
                # Its lease expired (a stall, a partition): not an attack, so no `rejected` event; it joins again.
                return pb.HeartbeatReply(round=self.loop.round, lease_s=self.cfg.quorum.lease_s, state=REJOIN)
            self._heard_from(req.island, self.clock())
            if self.working.get(req.island) != req.round:
                self.working[req.island] = int(req.round)
                self.cond.notify_all()
            return pb.HeartbeatReply(round=self.loop.round, lease_s=self.cfg.quorum.lease_s, state=self._state_name())

    def attend(self, req: pb.AttendRequest) -> pb.AttendReply:
        """An island's presence call opened (transport/presence.py): heard from, as by a heartbeat."""
        with self.cond:
            member = req.island in self.last_seen
            if member:
                self._heard_from(req.island, self.clock())
            return pb.AttendReply(member=member, state=self._state_name(),
                                  reconnect_grace_s=self.cfg.quorum.reconnect_grace_s)  # fmt: skip

    def absent(self, island: str) -> None:
        """An island's presence call broke: it is lost after `quorum.reconnect_grace_s` unless heard from again (the
        ticker's next `_tick_locked` after the grace drops it; diloco/membership.py)."""
        with self.cond:
            if island in self.last_seen and not self.done:
                self.broken[island] = self.clock()

    def _heard_from(self, island: str, now: float) -> None:
        """A sign of life from a member (join, heartbeat, push, presence): renews its lease and forgives a broken
        presence call (its process is there: a blipped link, or a call not yet replaced)."""
        self.last_seen[island] = now
        self.broken.pop(island, None)

    def leave(self, req: pb.LeaveRequest) -> pb.LeaveReply:
        with self.cond:
            self.broken.pop(req.island, None)
            if self.last_seen.pop(req.island, None) is not None:
                if self._membership_logged("island_left", req.island):
                    self.rd.log("island_left", round=self.loop.round, island=req.island, reason=req.reason)
            self._tick_locked()
        return pb.LeaveReply(ok=True)

    @contextlib.contextmanager
    def receiving(self, meta: pb.PushMeta) -> Iterator[None]:
        """While a push whose first chunk passed the service's checks streams in and is handed to `push`: the pull
        its island sent as soon as the push was on the wire then waits for it (`arriving`)."""
        key = (meta.island, meta.round * self.loop.fragments.count + meta.fragment)
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

    def current_round(self, fragment: int) -> int:
        """The one round a push of `fragment` may be for: the open round, or (streaming) the next one for a fragment
        whose sync in this round is already committed (`early`)."""
        return self.loop.round + (1 if fragment < self.loop.fragment else 0)

    def push(
        self, meta: pb.PushMeta, tensors: Sequence[EncodedTensor], arrays: dict[str, np.ndarray], payload_digest: bytes
    ) -> pb.PushReply:
        """A pseudo-gradient the transport validated; checked against the round before it joins it.

        Nothing is queued or logged as accepted before every check passed: the island is one of the run's, the round
        is open, Δ was taken from θ_r itself (`base_digest`), its token weight is possible. A weight above what H
        steps of the configured batch hold is capped (see `max_tokens`).
        """
        with self.cond:
            self._refuse_if_diverged()
            if meta.island not in self.names:
                who = clip(meta.island, 60)
                raise Rejected(grpc.StatusCode.PERMISSION_DENIED, f"island {who!r} is not in this run")
            if self.world.done or meta.round >= self.cfg.train.rounds:
                raise Rejected(grpc.StatusCode.FAILED_PRECONDITION, "the run is complete")
            staleness, weight = 0, 1.0
            if self.asynchronous:
                staleness = self._check_async_base(meta)
                position = self.loop.sync
            else:
                position = self._check_sync_base(meta)
            content = contribution_digest(meta.island, tensors, payload_digest)
            if content in self.dropped:
                raise Rejected(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"island {meta.island}'s pseudo-gradient for round {meta.round} was dropped: "
                    f"{self.dropped[content]}",
                )
            tokens = min(int(meta.tokens), self.max_tokens)
            delta = {name: np.array(arrays[name], np.float32) for name in sorted(arrays)}
            if self.asynchronous:
                weight = staleness_weight(staleness, self.cfg.outer.staleness_exponent)
                self.loop.submit(meta.island, position, discount(delta, weight), tokens)
                self.pending_digest[meta.island] = content
            elif position == self.loop.sync:
                try:
                    self.loop.submit(meta.island, meta.round, delta, tokens, fragment=meta.fragment)
                except RoundError as exc:
                    raise Rejected(grpc.StatusCode.ALREADY_EXISTS, str(exc)) from None
                self.pending_digest[meta.island] = content
            else:
                queued = self.early.setdefault(position, {})
                if meta.island in queued:
                    raise Rejected(grpc.StatusCode.ALREADY_EXISTS, f"island {meta.island} already contributed to "
                                   f"{self._sync_name(meta.round, meta.fragment)}")  # fmt: skip
                queued[meta.island] = Early(meta.round, meta.fragment, delta, tokens, content)
            nbytes = sum(len(t.payload) for t in tensors)
            self._heard_from(meta.island, self.clock())
            self.totals.tokens += tokens
            self.totals.bytes_up += nbytes
            self.totals.compute_s += float(meta.compute_s)
            self.totals.island_wall_s += float(meta.wall_s)
            self.last_loss[meta.island] = float(meta.loss)
            where = {"base": meta.round, "staleness": staleness} if self.asynchronous else {}
            self.rd.log(
                "push", round=position // self.loop.fragments.count, **where,
                **({"fragment": meta.fragment} if self.loop.fragments.count > 1 else {}),
                island=meta.island, tokens=tokens, bytes_up=nbytes, loss=float(meta.loss),
                compute_s=round(float(meta.compute_s), 4), wall_s=round(float(meta.wall_s), 4),
                **({"tokens_claimed": int(meta.tokens)} if tokens != meta.tokens else {}),
            )  # fmt: skip
            if not self.asynchronous:
                self._tick_locked()
                return pb.PushReply(accepted=True, round=self.loop.round, detail="accepted")
            annotations = {"island": meta.island, "staleness": staleness, "weight": round(weight, 6)}
            self._close_locked(self.clock(), None, annotations)
            if self.loop.sync == position:  # the update could not be committed (`_close_locked` says why)
                raise Rejected(grpc.StatusCode.FAILED_PRECONDITION, f"island {meta.island}'s pseudo-gradient "
                               f"was dropped: {self.dropped.get(content, 'not committed')}")  # fmt: skip
            return pb.PushReply(accepted=True, round=position, detail=f"applied as update {position}")

    def _check_sync_base(self, meta: pb.PushMeta) -> int:
        """A round's push: for the open sync (or, streaming, one of the P - 1 after it), taken from θ_s's fragment.
        Returns its sync position."""
        position = meta.round * self.loop.fragments.count + meta.fragment
        if not self.loop.sync <= position < self.loop.sync + self.loop.fragments.count:  # it may have closed
            raise Rejected(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"pseudo-gradient for {self._sync_name(meta.round, meta.fragment)} but "
                f"{self._sync_name(self.loop.round, self.loop.fragment)} is open",
            )
        if bytes(meta.base_digest) != bytes.fromhex(self.world.fragment_digests[meta.fragment]):
            raise Rejected(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"island {meta.island}'s pseudo-gradient was not taken from θ_{self.loop.round}"
                f"{self._of_fragment(meta.fragment)} (base_digest "
                f"{bytes(meta.base_digest).hex()[:16] or 'missing'}); pull the full parameters",
            )
        return position

    def _check_async_base(self, meta: pb.PushMeta) -> int:
        """An asynchronous push names the update b whose θ_b its Δ was taken from (`round`): b may be up to
        outer.max_staleness updates old, and base_digest must be θ_b's. Returns its staleness τ = u - b."""
        u, bound = self.loop.round, self.cfg.outer.max_staleness
        if meta.round > u:
            raise Rejected(grpc.StatusCode.FAILED_PRECONDITION, f"island {meta.island}'s pseudo-gradient is from "
                           f"θ_{meta.round}, ahead of the coordinator's θ_{u}; pull the full parameters")  # fmt: skip
        if u - meta.round > bound:
            raise Rejected(grpc.StatusCode.FAILED_PRECONDITION, f"island {meta.island}'s pseudo-gradient is "
                           f"{u - meta.round} updates stale, over outer.max_staleness = {bound}; pull the full "
                           "parameters")  # fmt: skip
        known = self.digests.get(meta.round)  # None: not since this coordinator (re)started
        if known is None or bytes(meta.base_digest) != bytes.fromhex(known):
            raise Rejected(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"island {meta.island}'s pseudo-gradient was not taken from θ_{meta.round} (base_digest "
                f"{bytes(meta.base_digest).hex()[:16] or 'missing'}); pull the full parameters",
            )
        return u - meta.round

    def pull(self, req: pb.PullRequest) -> PullPayload:
        with self.cond:
            self._refuse_if_diverged()
            if req.after_push:  # its push left just before it: let that land (or fail) before "push first"
                self.cond.wait_for(lambda: answer_pull(self._pull_view(req)).kind not in PUSH_MISSING,
                                   timeout=min(PUSH_LANDING_S, self.cfg.network.pull_wait_s))  # fmt: skip
            answer = answer_pull(self._pull_view(req))
            if answer.kind is PullKind.WAIT:
                self.cond.wait_for(lambda: answer_pull(self._pull_view(req)).kind is not PullKind.WAIT,
                                   timeout=self.cfg.network.pull_wait_s)  # fmt: skip
                answer = answer_pull(self._pull_view(req))
            if answer.kind is not PullKind.UPDATE and answer.kind is not PullKind.FULL:
                self.metrics.pulled(req.island, answer.kind.value, 0)
            if answer.kind is PullKind.WAIT:  # ABORTED is retryable: the island asks again, keeping its lease
                raise Rejected(grpc.StatusCode.ABORTED, f"{answer.reason}; retry")
            if answer.kind in (PullKind.PUSH_FIRST, PullKind.RESYNC):
                raise Rejected(grpc.StatusCode.FAILED_PRECONDITION, f"island {req.island}: {answer.reason}")
            P = self.loop.fragments.count
            if answer.kind is PullKind.UPDATE:  # the commit of the island's position: it moves one sync on
                commit = self.commits[self._position(req)]
                tensors: Sequence[EncodedTensor] = commit.encoded
                reaches, digest = self._position(req) + 1, commit.fragment_digest
                shared = self.streams.get(self._position(req))
            else:
                tensors = encode_tree(flatten_named(self.loop.params), FP32)
                reaches, digest, shared = self.loop.sync, self.world.params_digest, None
            island = req.island
            nbytes = sum(len(t.payload) for t in tensors)
            self.totals.bytes_down += nbytes
            self.metrics.pulled(req.island, answer.kind.value, nbytes)
            round_, fragment = divmod(reaches, P)
            return PullPayload(
                round=round_, fragment=fragment, kind=answer.kind.value, param_digest=bytes.fromhex(digest),
                tensors=tensors, shared=shared, on_done=lambda: self._served(island, reaches - 1),
            )  # fmt: skip

    def _served(self, island: str, position: int) -> None:
        """A pull that carried the commit of sync ``position`` (or a later θ) to ``island`` is over."""
        with self.cond:
            if position in self.commits:  # the last `kept` only: `served` is bounded like `commits`
                self.served.setdefault(position, set()).add(island)
                self.cond.notify_all()

    def _position(self, req: pb.PullRequest) -> int:
        """The sync position a pull says the island holds (-1: none); (round, fragment) on the wire."""
        return -1 if req.have_round < 0 else req.have_round * self.loop.fragments.count + req.fragment

    def _sync_name(self, round_: int, fragment: int) -> str:
        return f"round {round_}{self._of_fragment(fragment)}"

    def _of_fragment(self, fragment: int) -> str:
        return f" fragment {fragment}" if self.loop.fragments.count > 1 else ""

    def _islands_diverged(self) -> bool:
        """After a commit diverged: did the islands' own losses explode too (the run diverged), or is it one Δ?

        An island can wreck the model with a finite but absurd Δ while reporting a healthy loss (a bug, or an insider
        with its credentials), so only the islands' reported losses may stop the run, and only when *every* island
        that took part in the round or is live agrees: one insider can claim an exploded loss as easily as send an
        absurd Δ, and if one claim stopped the run, an insider could stop it at will. Otherwise the largest
        contribution is dropped, every time. The price: a run whose *outer* step is too large for healthy islands
        drops every contribution and makes no progress, with a `contribution_dropped` event (and hint) each time
        rather than an exit.
        """
        initial = self.totals.initial_eval_loss
        voters = set(self.loop.pending) | set(self.last_seen)
        losses = [self.last_loss[n] for n in sorted(voters) if n in self.last_loss]
        return bool(losses) and all(diverged_reason(x, initial, self.world.divergence_factor) for x in losses)

    def _refuse_if_diverged(self) -> None:
        if self.world.diverged is not None:
            raise Rejected(grpc.StatusCode.FAILED_PRECONDITION, str(self.world.diverged))

    def _pull_view(self, req: pb.PullRequest) -> PullView:
        have = self._position(req)
        return PullView(
            have_round=have, full=req.full, round=self.loop.sync, done=self.world.done,
            pushed=req.island in (self.loop.pending if have == self.loop.sync else self.early.get(have, {})),
            arriving=(req.island, have) in self.arriving,
            last_commit_round=max(self.commits, default=None),
            kept=self.kept,
        )  # fmt: skip

    def status(self) -> pb.StatusReply:
        with self.cond:
            now = self.clock()
            islands = [
                pb.IslandStatus(
                    name=name,
                    round=self.loop.round,
                    last_seen_s=now - self.last_seen[name] if name in self.last_seen else -1.0,
                    state=("pushed" if name in self.loop.pending else "training")
                    if name in self.last_seen
                    else "absent",
                )
                for name in self.names
            ]
            return pb.StatusReply(
                run_id=self.run_id,
                round=self.loop.round,
                state=self._state_name(),
                islands=islands,
                detail_json=json.dumps(self.live_status()),
            )

    def on_rejected(self, island: str, reason: str) -> None:
        """Count every refusal; log a truncated sample of them (diloco/rejections.py), never one line per attack."""
        if reason.startswith(f"{grpc.StatusCode.ABORTED.name}:"):
            return  # "the round is still open, ask again" answers a pull; it refuses nothing
        self.metrics.refused(reason)
        with self.cond:
            self.totals.rejected += 1
            admitted = self.rejections.admit(self.clock(), island, reason)
            self._log_suppressed(admitted.suppressed)
            if admitted.event is not None:
                self.rd.log("rejected", round=self.loop.round, **admitted.event)

    def _log_suppressed(self, counts: dict[str, int]) -> None:
        if counts:
            self.rd.log("rejected_suppressed", round=self.loop.round, counts=counts)

    def _log_membership_suppressed(self, counts: dict[str, int]) -> None:
        if counts:
            self.rd.log("membership_suppressed", round=self.loop.round, counts=counts)

    def _membership_logged(self, event: str, island: str) -> bool:
        """Whether this `island_joined` or `island_left` event is written: at most MEMBERSHIP_BURST per island and
        kind a minute, the rest counted in `membership_suppressed`. An insider with one island's secret can send
        Join and Leave in turn, each one accepted: without the cap every pair would be two lines of metrics.jsonl
        (seen in `diloco bench fuzz`). The island is one of the run's (checked before), so the counts are bounded."""
        admitted = self.memberships.admit(self.clock(), island, "", kind=f"{event} {island}")
        self._log_membership_suppressed(admitted.suppressed)
        return admitted.event is not None

    # -- rounds ------------------------------------------------------------------------------------------------

    def tick(self) -> None:
        with self.cond:
            now = self.clock()
            self._log_suppressed(self.rejections.flush(now))
            self._log_membership_suppressed(self.memberships.flush(now))
            self._tick_locked()

    def _tick_locked(self) -> None:
        if self.world.done:
            return
        now = self.clock()
        view = RoundView(
            opened_at=self.opened_at,
            last_seen=dict(self.last_seen),
            pushed=frozenset(self.loop.pending),
            durations=self.world.durations,
            broken=dict(self.broken),
        )
        decision = decide(now, view, self.cfg.quorum)
        for name, why in sorted(decision.lost.items()):
            del self.last_seen[name]
            self.broken.pop(name, None)
            self.totals.islands_lost += 1
            self.rd.log("island_lost", round=self.loop.round, island=name, reason=why)
        if decision.action is Action.CLOSE and not self.asynchronous:  # an asynchronous push commits itself
            self._close_locked(now, decision.reason)

    def _close_locked(self, now: float, reason: str | None, annotations: dict[str, Any] | None = None) -> None:
        """Commit the round. If its contributions cannot be committed (their update overflows float32 and the
        downlink codec refuses it, or the model it makes diverges while the islands report healthy losses), drop the
        largest one, say so, and try again: an island's input may cost that island its round, never the coordinator
        its life. A round left with no contribution stays open."""
        while self.loop.pending and self.world.diverged is None:
            losses = [self.last_loss[n] for n in self.loop.pending if n in self.last_loss]
            sync = self.loop.sync
            faults.at(faults.COORDINATOR, "before_commit", self.loop.round)
            try:
                pending = self.world.commit(
                    losses=losses, seconds=now - self.opened_at, reason=reason, annotations=annotations
                )
            except (CodecError, ArithmeticError) as exc:  # commit is all or nothing: θ and the round are unchanged
                self._drop_largest(str(exc))
                continue
            # θ_{s+1} is served from here on; its evaluation and checkpoint follow on the settle thread, off the
            # islands' path (docs/architecture.md, "Commits off the critical path").
            self.commits[sync] = pending.commit
            self.streams[sync] = SharedPull()
            for kept in (self.commits, self.streams, self.served):
                kept.pop(sync - self.kept, None)
            self.digests[sync + 1] = pending.commit.digest
            self.digests.pop(sync + 1 - self.kept, None)
            self._settle_queue.put((self._generation, pending, dict(self.pending_digest), dict(self.dropped)))
            self._unsettled += 1
            self.dropped.clear()
            self.pending_digest.clear()
            self.opened_at = now
            self._admit_early()
            self.cond.notify_all()
            return

    def _admit_early(self) -> None:
        """The pushes that arrived early for the sync that just opened join it, then it may close at once."""
        for island, e in sorted(self.early.pop(self.loop.sync, {}).items()):
            try:
                self.loop.submit(island, e.round, e.delta, e.tokens, fragment=e.fragment)
            except RoundError as exc:  # checked at its push already; never let it stop a commit
                self.rd.log("contribution_dropped", round=e.round, fragment=e.fragment, island=island,
                            reason=clip(str(exc)))  # fmt: skip
                continue
            self.pending_digest[island] = e.content
        if self.loop.pending:
            self._tick_locked()

    def _settle_forever(self) -> None:
        """The settle thread: evaluate each commit (without the lock), keep it or undo it (with the lock), save its
        checkpoint when due (without the lock), in commit order."""
        while (job := self._settle_queue.get()) is not None:
            generation, pending, digests, dropped = job
            faults.at(faults.COORDINATOR, "after_commit", pending.commit.round)
            reopened: int | None = None
            try:
                if generation == self._generation:
                    self._yield_to_islands(pending)
                eval_loss = self.world.evaluate_commit(pending) if generation == self._generation else math.nan
                with self.cond:
                    meta = None
                    if generation == self._generation:
                        meta, reopened = self._record_locked(pending, digests, dropped, eval_loss)
                        if reopened is None and pending.round_closed:  # kept: saved now, or by `flush` at a stop
                            self._unsaved = None if meta is not None else (pending, self.world.checkpoint_meta())
                if meta is not None:
                    self.world.save(pending, meta)
            except DiskFullError as exc:  # the run cannot go on durably: `serve` stops with this one line
                self.failure = exc
            finally:
                with self.cond:
                    self._unsettled -= 1
                    self.cond.notify_all()
            if reopened is not None and self.on_rollback is not None:
                self.on_rollback(reopened)

    def _yield_to_islands(self, pending: Settling) -> None:
        """Wait, at most EVAL_YIELD_S, until every island that contributed to the commit and still holds a lease is
        done with it, unless a later commit is queued to be settled (the settle thread must not fall behind), the
        commit is the run's last (its islands stop), or the coordinator is stopping. Done: it has been sent the
        commit and, with plain rounds, has said by heartbeat that it trains on the next round (it beats at once after
        adopting: `IslandWorker._merge`). Streaming and asynchronous islands train while they pull, so for them the
        pull is all.

        The evaluation is the coordinator's lowest-priority work: nobody waits for it, while every contributor waits
        for its commit. Run at once, on a host whose cores the islands share, it took the CPU from the pulls it
        overlapped (the 6.38M-parameter sync of 3 islands on 2 cores: one evaluation took 0.15 s instead of 0.06 s
        and the critical path grew by 0.07 s), and run once the pulls were sent, from the islands' adopt of θ
        (0.055 s instead of 0.03 s; docs/architecture.md, "Commits off the critical path")."""
        commit = pending.commit
        position = commit.round * self.loop.fragments.count + commit.fragment
        plain = self.loop.fragments.count == 1 and not self.asynchronous

        def done(name: str) -> bool:
            sent = name in self.served.get(position, ())
            return sent and (not plain or self.working.get(name, -1) > commit.round)

        def all_done() -> bool:
            if self._stopping or self.world.done or not self._settle_queue.empty():
                return True  # stopping, the run's last commit (its islands leave), or a later commit waits
            return all(done(name) for name in commit.islands if name in self.last_seen)

        with self.cond:
            self.cond.wait_for(all_done, timeout=EVAL_YIELD_S)

    def _record_locked(
        self, pending: Settling, digests: dict[str, bytes], dropped: dict[bytes, str], eval_loss: float
    ) -> tuple[dict | None, int | None]:
        """Keep a commit (returns the checkpoint metadata, if due) or, when its model diverged, undo it and every
        later commit and go on without its largest contribution (returns the reopened round)."""
        try:
            return self.world.record(pending, eval_loss), None
        except DivergedError as exc:
            # θ, the outer state and the open sync are as before the commit (GlobalRun.record); so are its pushes.
            self._generation += 1
            self._unsaved = None  # an older round's state: its own save (if due) happened when it was kept
            reopened = self.loop.sync
            self.commits = {s: c for s, c in self.commits.items() if s < reopened}
            self.streams = {s: t for s, t in self.streams.items() if s < reopened}
            self.served = {s: n for s, n in self.served.items() if s < reopened}
            self.digests = {s: d for s, d in self.digests.items() if s <= reopened}
            self.pending_digest, self.dropped = digests, dropped
            self.early.clear()  # taken from fragments of undone commits: those islands resync
            self.opened_at = self.clock()
            self.cond.notify_all()
            if self._islands_diverged():
                # The run itself diverged: every later call is refused with the reason (`_refuse_if_diverged`) and
                # `serve` exits with it.
                return None, self.loop.round
            self.world.diverged = None  # not the run's divergence: go on without this contribution
            self._drop_largest(f"diverged with a healthy island loss (lower outer.lr if all are dropped so): {exc}")
            self._tick_locked()
            return None, self.loop.round

    def _drop_largest(self, why: str) -> None:
        culprit = self.loop.largest_contribution()
        self.loop.withdraw(culprit)
        if len(self.dropped) >= MAX_DROPPED:
            del self.dropped[next(iter(self.dropped))]
        self.dropped[self.pending_digest.pop(culprit)] = clip(why)
        self.rd.log("contribution_dropped", round=self.loop.round, island=culprit, reason=clip(why))

    # -- reporting ---------------------------------------------------------------------------------------------

    def summary(self) -> dict[str, Any]:
        """summary.json's contents (diloco/summary.py), the same keys as `simulate` writes."""
        return self.world.summary()

    def live_status(self) -> dict[str, Any]:
        """The summary so far plus who is alive and their last losses: `diloco status` and `launch`'s display."""
        return {
            **self.summary(), "islands_alive": sorted(self.last_seen), "last_losses": dict(self.last_loss),
            "island_bytes": {n: dict(t) for n, t in self.metrics.tally.items() if n in self.names},
            "rejected_by_code": dict(self.metrics.reasons),
        }  # fmt: skip
