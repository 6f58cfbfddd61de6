"""The global coordinator: a facade over its parts, the only owner of `GlobalState`, membership and the open sync.

It implements `transport.handler.CoordinatorHandler`, so the same object serves islands over gRPC (`diloco
coordinator`, `diloco launch`) or in-process. It holds one lock (a condition variable) and wires parts that each
have one job and their own state:

  `Roster` (diloco/roster.py)               who is a member and what each last said; `membership.decide` (pure)
                                            says when a round closes and who is lost
  `PushAdmission` (diloco/push_admission.py) whether a push joins a sync: its round, its base θ, duplicates,
                                            dropped contributions, early (streaming) pushes; a `RoundRule` for
                                            plain and streaming rounds or asynchronous updates
  `GlobalRun` (diloco/global_run.py)        the outer step shared with simulate: token-weighted (or robust)
                                            aggregate, outer optimizer, θ += û with û = decode(encode(u + e))
  `CommitWindow` (diloco/commit_window.py)  the last commits, the streams their pulls share, who received them
  `Settler` (diloco/settler.py)             evaluation, the round event and the checkpoint, off the islands' path

  push   -> admitted (the transport checked bytes, names, shapes, finiteness, digest; nothing unchecked reaches θ)
  tick   -> leases expire, the adaptive deadline passes, or everyone has pushed: the round closes
  close  -> commit; θ_{r+1} is served at once and the settler follows
  pull   -> what the pure `membership.answer_pull` says: the committed û of the last sync, the full θ, wait, or
            push first

A coordinator killed at any moment restarts from its last checkpoint: the round in flight is lost, islands that
pushed into it push again after resyncing, and nothing half-applied ever existed.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grpc
import numpy as np

from diloco import RELEASE
from diloco.commit_window import CommitWindow
from diloco.config import RunConfig, config_digest, diff_keys, to_dict
from diloco.global_run import GlobalRun, Settling, diverged_reason
from diloco.membership import REJOIN, Action, PullKind, PullView, answer_pull, decide
from diloco.metrics import CoordinatorMetrics
from diloco.push_admission import Admitted, AsyncUpdates, PushAdmission, RoundRule, SyncRounds
from diloco.rejections import RejectionLog, clip
from diloco.roster import Roster
from diloco.rounds import Commit, OuterLoop
from diloco.rundir import RunDir
from diloco.settler import Job, Settler
from diloco.setup import Setup
from diloco.summary import Totals
from islands.island import DivergedError
from transport import diloco_pb2 as pb
from transport.codecs import CodecError, CodecSpec, EncodedTensor, encode_tree, flatten_named
from transport.errors import Rejected
from transport.handler import PullPayload
from transport.validate import ModelSpec

FP32 = CodecSpec(kind="fp32")
MEMBERSHIP_BURST = 10
"""`island_joined` (or `island_left`) events of one island written a minute: a supervised island that restarts
several times a minute still has each one logged; an insider's Join/Leave loop is counted, not logged."""
PUSH_LANDING_S = 2.0
"""How long a pull sent right after its island's push (`PullRequest.after_push`) gives that push to reach the
coordinator before the answer is "push first": the push was on the wire first, so it lands about when the pull does,
and once it is streaming in, `Coordinator.arriving` holds the pull anyway. A push that never lands (lost with a
coordinator that restarted) costs its island this long, then a push again."""
PUSH_MISSING = (PullKind.PUSH_FIRST, PullKind.RESYNC)
"""The answers a pull gets when the coordinator holds no push of the island's for the sync it asks about."""


class Coordinator:
    """Wires the coordinator's parts under one condition variable and answers the transport's calls."""

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
        rule: RoundRule = (
            AsyncUpdates(cfg.outer.max_staleness, cfg.outer.staleness_exponent) if self.asynchronous else SyncRounds()
        )
        self.cond = threading.Condition()
        self.roster = Roster(self.names)
        self.admission = PushAdmission(
            rule, max_tokens=cfg.train.inner_steps * cfg.train.batch_size * cfg.model.seq_len,
            remembered=cfg.transport.idempotency_cache,
        )  # fmt: skip
        kept = cfg.outer.max_staleness + 1 if self.asynchronous else fragments.count
        self.window = CommitWindow(kept, self.loop.sync, self.world.params_digest)
        self.rejections = RejectionLog()
        self.memberships = RejectionLog(burst=MEMBERSHIP_BURST)
        """`island_joined` / `island_left` events written per island and kind a minute (`_membership_logged`)."""
        self.arriving: Counter[tuple[str, int]] = Counter()
        """Pushes streaming in, by island and sync position (`receiving`): a pull for a position whose push is still
        arriving waits for it rather than being told to push first (diloco/membership.py, `PullView.arriving`).
        Bounded by the push streams the server runs at once."""
        self.opened_at = clock()
        self.settler = Settler(self.cond, self.world, self._keep_locked, self._islands_done)
        self.metrics.follow(self)

    # -- lifecycle ---------------------------------------------------------------------------------------------

    @property
    def loop(self) -> OuterLoop:
        return self.world.loop

    @property
    def last_commit(self) -> Commit | None:
        return self.window.last

    @property
    def totals(self) -> Totals:
        return self.world.totals

    @property
    def run_id(self) -> str:
        return self.cfg.run.name

    @property
    def done(self) -> bool:
        """Every planned round is committed and settled (evaluated, logged, checkpointed)."""
        return self.world.done and self.settler.unsettled == 0

    @property
    def failure(self) -> Exception | None:
        """Why the run cannot go on durably (a checkpoint that could not be written), or None."""
        return self.settler.failure

    def flush(self) -> None:
        """A graceful stop (SIGTERM): every commit settled and the last committed round checkpointed."""
        self.settler.flush()

    def settled(self, timeout_s: float | None = None) -> bool:
        return self.settler.settled(timeout_s)

    def close(self) -> None:
        self.settler.close()
        self.world.close()

    # -- membership --------------------------------------------------------------------------------------------

    def _state_name(self) -> str:
        if self.done:
            return "done"
        return "training" if len(self.roster) >= self.cfg.quorum.min_islands else "waiting_quorum"

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
            if self.roster.join(req.island, self.clock()):
                self.totals.islands_joined += 1
                if self._membership_logged("island_joined", req.island):
                    self.rd.log("island_joined", round=self.loop.round, island=req.island, devices=req.devices)
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
            if req.island not in self.roster and not self.done:
                # Its lease expired (a stall, a partition): not an attack, so no `rejected` event; it joins again.
                return pb.HeartbeatReply(round=self.loop.round, lease_s=self.cfg.quorum.lease_s, state=REJOIN)
            if self.roster.beat(req.island, int(req.round), self.clock()):
                self.cond.notify_all()
            return pb.HeartbeatReply(round=self.loop.round, lease_s=self.cfg.quorum.lease_s, state=self._state_name())

    def attend(self, req: pb.AttendRequest) -> pb.AttendReply:
        """An island's presence call opened (transport/presence.py): heard from, as by a heartbeat."""
        with self.cond:
            member = req.island in self.roster
            if member:
                self.roster.heard_from(req.island, self.clock())
            return pb.AttendReply(member=member, state=self._state_name(),
                                  reconnect_grace_s=self.cfg.quorum.reconnect_grace_s)  # fmt: skip

    def absent(self, island: str) -> None:
        """An island's presence call broke: it is lost after `quorum.reconnect_grace_s` unless heard from again (the
        ticker's next `_tick_locked` after the grace drops it; diloco/membership.py)."""
        with self.cond:
            if not self.done:
                self.roster.broke(island, self.clock())

    def leave(self, req: pb.LeaveRequest) -> pb.LeaveReply:
        with self.cond:
            if self.roster.leave(req.island) and self._membership_logged("island_left", req.island):
                self.rd.log("island_left", round=self.loop.round, island=req.island, reason=req.reason)
            self._tick_locked()
        return pb.LeaveReply(ok=True)

    def _membership_logged(self, event: str, island: str) -> bool:
        """Whether this `island_joined` or `island_left` event is written: at most MEMBERSHIP_BURST per island and
        kind a minute, the rest counted in `membership_suppressed`. An insider with one island's secret can send
        Join and Leave in turn, each one accepted: without the cap every pair would be two lines of metrics.jsonl.
        The island is one of the run's (checked before), so the counts are bounded."""
        admitted = self.memberships.admit(self.clock(), island, "", kind=f"{event} {island}")
        self._log_counts("membership_suppressed", admitted.suppressed)
        return admitted.event is not None

    # -- pushes ------------------------------------------------------------------------------------------------

    def admissible(self, meta: pb.PushMeta) -> None:
        """A push's first chunk passed the transport's checks: refuse it now, before its payload is buffered, unless
        its round is one the admission takes (or it retries an accepted push)."""
        with self.cond:
            self.admission.admissible(meta, self.loop)

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

    def push(
        self, meta: pb.PushMeta, tensors: Sequence[EncodedTensor], arrays: dict[str, np.ndarray], payload_digest: bytes
    ) -> pb.PushReply:
        """A pseudo-gradient the transport validated: a retry is answered as before; anything else joins its sync
        only once every check passed (`PushAdmission`), and is logged and counted only then."""
        with self.cond:
            self._refuse_if_diverged()
            if meta.island not in self.names:
                who = clip(meta.island, 60)
                raise Rejected(grpc.StatusCode.PERMISSION_DENIED, f"island {who!r} is not in this run")
            replayed = self.admission.replay(meta, payload_digest)
            if replayed is not None:
                return replayed
            if self.world.done or meta.round >= self.cfg.train.rounds:
                raise Rejected(grpc.StatusCode.FAILED_PRECONDITION, "the run is complete")
            admitted = self.admission.place(meta, tensors, arrays, payload_digest, self.loop, self._base_digest)
            self.admission.enter(admitted, self.loop)
            self._count_push(meta, admitted.tokens, admitted.placement.position, admitted.placement.staleness,
                             sum(len(t.payload) for t in tensors))  # fmt: skip
            if self.asynchronous:
                reply = self._commit_update(meta, admitted)
            else:
                self._tick_locked()
                reply = pb.PushReply(accepted=True, round=self.loop.round, detail="accepted")
            return self.admission.remember(admitted.key, payload_digest, reply)

    def _base_digest(self, meta: pb.PushMeta) -> str | None:
        """The digest a push's base must have: the open θ's fragment, or (asynchronous) θ at the update it names."""
        if self.asynchronous:
            return self.window.digests.get(meta.round)
        return self.world.fragment_digests[meta.fragment]

    def _count_push(self, meta: pb.PushMeta, tokens: int, position: int, staleness: int, nbytes: int) -> None:
        self.roster.pushed(meta.island, float(meta.loss), self.clock())
        self.totals.tokens += tokens
        self.totals.bytes_up += nbytes
        self.totals.compute_s += float(meta.compute_s)
        self.totals.island_wall_s += float(meta.wall_s)
        where = {"base": meta.round, "staleness": staleness} if self.asynchronous else {}
        self.rd.log(
            "push", round=position // self.loop.fragments.count, **where,
            **({"fragment": meta.fragment} if self.loop.fragments.count > 1 else {}),
            island=meta.island, tokens=tokens, bytes_up=nbytes, loss=float(meta.loss),
            compute_s=round(float(meta.compute_s), 4), wall_s=round(float(meta.wall_s), 4),
            **({"tokens_claimed": int(meta.tokens)} if tokens != meta.tokens else {}),
        )  # fmt: skip

    def _commit_update(self, meta: pb.PushMeta, admitted: Admitted) -> pb.PushReply:
        """Asynchronous: the push is one update, committed now; refused when it could not be (`_close_locked`)."""
        placement = admitted.placement
        annotations = {"island": meta.island, "staleness": placement.staleness, "weight": round(placement.weight, 6)}
        self._close_locked(self.clock(), None, annotations)
        if self.loop.sync == placement.position:
            why = self.admission.dropped.get(admitted.content, "not committed")
            raise Rejected(grpc.StatusCode.FAILED_PRECONDITION,
                           f"island {meta.island}'s pseudo-gradient was dropped: {why}")  # fmt: skip
        return pb.PushReply(accepted=True, round=placement.position, detail=f"applied as update {placement.position}")

    # -- pulls -------------------------------------------------------------------------------------------------

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
            if answer.kind in PUSH_MISSING:
                raise Rejected(grpc.StatusCode.FAILED_PRECONDITION, f"island {req.island}: {answer.reason}")
            return self._payload(req, answer.kind)

    def _payload(self, req: pb.PullRequest, kind: PullKind) -> PullPayload:
        """What a pull answered UPDATE or FULL carries: the commit of the island's position (it moves one sync on),
        or the whole θ in fp32."""
        if kind is PullKind.UPDATE:
            position = _position(req, self.loop.fragments.count)
            commit = self.window.commits[position]
            tensors: Sequence[EncodedTensor] = commit.encoded
            reaches, digest, shared = position + 1, commit.fragment_digest, self.window.streams.get(position)
        else:
            tensors = encode_tree(flatten_named(self.loop.params), FP32)
            reaches, digest, shared = self.loop.sync, self.world.params_digest, None
        island = req.island
        nbytes = sum(len(t.payload) for t in tensors)
        self.totals.bytes_down += nbytes
        self.metrics.pulled(req.island, kind.value, nbytes)
        round_, fragment = divmod(reaches, self.loop.fragments.count)
        return PullPayload(
            round=round_, fragment=fragment, kind=kind.value, param_digest=bytes.fromhex(digest),
            tensors=tensors, shared=shared, on_done=lambda: self._served(island, reaches - 1),
        )  # fmt: skip

    def _served(self, island: str, position: int) -> None:
        """A pull that carried the commit of sync ``position`` (or a later θ) to ``island`` is over."""
        with self.cond:
            if self.window.served_to(island, position):
                self.cond.notify_all()

    def _pull_view(self, req: pb.PullRequest) -> PullView:
        have = _position(req, self.loop.fragments.count)
        pushed = self.admission.pending if have == self.loop.sync else self.admission.early.get(have, {})
        return PullView(
            have_round=have, full=req.full, round=self.loop.sync, done=self.world.done,
            pushed=req.island in pushed, arriving=(req.island, have) in self.arriving,
            last_commit_round=self.window.last_position, kept=self.window.kept,
        )  # fmt: skip

    # -- rounds ------------------------------------------------------------------------------------------------

    def tick(self) -> None:
        with self.cond:
            now = self.clock()
            self._log_counts("rejected_suppressed", self.rejections.flush(now))
            self._log_counts("membership_suppressed", self.memberships.flush(now))
            self._tick_locked()

    def _tick_locked(self) -> None:
        if self.world.done:
            return
        now = self.clock()
        decision = decide(now, self.roster.round_view(self.opened_at, self.loop.pending, self.world.durations),
                          self.cfg.quorum)  # fmt: skip
        self.roster.lose(decision.lost)
        for name, why in sorted(decision.lost.items()):
            self.totals.islands_lost += 1
            self.rd.log("island_lost", round=self.loop.round, island=name, reason=why)
        if decision.action is Action.CLOSE and not self.asynchronous:  # an asynchronous push commits itself
            self._close_locked(now, decision.reason)

    def _close_locked(self, now: float, reason: str | None, annotations: dict[str, Any] | None = None) -> None:
        """Commit the open sync. If its contributions cannot be committed (their update overflows float32 and the
        downlink codec refuses it), drop the largest one, say so, and try again: an island's input may cost that
        island its round, never the coordinator its life. A sync left with no contribution stays open."""
        while self.loop.pending and self.world.diverged is None:
            sync, restore = self.loop.sync, self.admission.snapshot()
            try:
                pending = self.world.commit(losses=self.roster.losses(self.loop.pending),
                                            seconds=now - self.opened_at, reason=reason, annotations=annotations)
            except (CodecError, ArithmeticError) as exc:  # commit is all or nothing: θ and the round are unchanged
                self._drop_largest(str(exc))
                continue
            # θ_{s+1} is served from here on; the settler evaluates and checkpoints it.
            self.window.add(sync, pending.commit)
            self.settler.enqueue(pending, restore)
            self.opened_at = now
            for island, why in self.admission.opened(self.loop):
                self.rd.log("contribution_dropped", round=self.loop.round, fragment=self.loop.fragment,
                            island=island, reason=clip(why))  # fmt: skip
            if self.loop.pending:
                self._tick_locked()
            self.cond.notify_all()
            return

    def _drop_largest(self, why: str) -> None:
        culprit = self.loop.largest_contribution()
        self.loop.withdraw(culprit)
        self.admission.drop(culprit, why)
        self.rd.log("contribution_dropped", round=self.loop.round, island=culprit, reason=clip(why))

    def _islands_done(self, pending: Settling) -> bool:
        """Every island that contributed to the commit and still holds a lease is done with it: it has been sent the
        commit and, with plain rounds, has said by heartbeat that it trains on the next round (it beats at once after
        adopting θ). Streaming and asynchronous islands train while they pull, so for them the pull is all."""
        commit = pending.commit
        position = commit.round * self.loop.fragments.count + commit.fragment
        plain = self.loop.fragments.count == 1 and not self.asynchronous
        return all(
            self.window.was_served(name, position) and (not plain or self.roster.moved_past(name, commit.round))
            for name in commit.islands if name in self.roster
        )  # fmt: skip

    def _keep_locked(self, job: Job, eval_loss: float) -> dict | None:
        """Keep a commit (returns the checkpoint metadata, if due) or, when its model diverged, undo it and every
        later commit and go on without its largest contribution."""
        try:
            return self.world.record(job.pending, eval_loss)
        except DivergedError as exc:
            # θ, the outer state and the open sync are as before the commit (GlobalRun.record); so are its pushes.
            self.settler.undone()
            reopened = self.loop.sync
            self.window.undo_from(reopened)
            self.admission.undo_to(job.restore, reopened, self.loop.fragments.count)
            self.opened_at = self.clock()
            self.cond.notify_all()
            if self._islands_diverged():
                # The run itself diverged: every later call is refused with the reason (`_refuse_if_diverged`) and
                # `serve` exits with it.
                return None
            self.world.diverged = None  # not the run's divergence: go on without this contribution
            self._drop_largest(f"diverged with a healthy island loss (lower outer.lr if all are dropped so): {exc}")
            self._tick_locked()
            return None

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
        losses = self.roster.losses(sorted(set(self.loop.pending) | set(self.roster.live)))
        return bool(losses) and all(diverged_reason(x, initial, self.world.divergence_factor) for x in losses)

    def _refuse_if_diverged(self) -> None:
        if self.world.diverged is not None:
            raise Rejected(grpc.StatusCode.FAILED_PRECONDITION, str(self.world.diverged))

    # -- reporting ---------------------------------------------------------------------------------------------

    def status(self) -> pb.StatusReply:
        with self.cond:
            now = self.clock()
            islands = [
                pb.IslandStatus(
                    name=name, round=self.loop.round, last_seen_s=self.roster.seen_ago(name, now),
                    state=("pushed" if name in self.loop.pending else "training") if name in self.roster else "absent",
                )
                for name in self.names
            ]  # fmt: skip
            return pb.StatusReply(run_id=self.run_id, round=self.loop.round, state=self._state_name(),
                                  islands=islands, detail_json=json.dumps(self.live_status()))  # fmt: skip

    def on_rejected(self, island: str, reason: str) -> None:
        """Count every refusal; log a truncated sample of them (diloco/rejections.py), never one line per attack."""
        if reason.startswith(f"{grpc.StatusCode.ABORTED.name}:"):
            return  # "the round is still open, ask again" answers a pull; it refuses nothing
        self.metrics.refused(reason)
        with self.cond:
            self.totals.rejected += 1
            admitted = self.rejections.admit(self.clock(), island, reason)
            self._log_counts("rejected_suppressed", admitted.suppressed)
            if admitted.event is not None:
                self.rd.log("rejected", round=self.loop.round, **admitted.event)

    def _log_counts(self, event: str, counts: dict[str, int]) -> None:
        if counts:
            self.rd.log(event, round=self.loop.round, counts=counts)

    def summary(self) -> dict[str, Any]:
        """summary.json's contents (diloco/summary.py), the same keys as `simulate` writes."""
        return self.world.summary()

    def live_status(self) -> dict[str, Any]:
        """The summary so far plus who is alive and their last losses: `diloco status` and `launch`'s display."""
        return {
            **self.summary(), "islands_alive": self.roster.live, "last_losses": dict(self.roster.last_loss),
            "island_bytes": {n: dict(t) for n, t in self.metrics.tally.items() if n in self.names},
            "rejected_by_code": dict(self.metrics.reasons),
        }  # fmt: skip


def _position(req: pb.PullRequest, fragments: int) -> int:
    """The sync position a pull says the island holds (-1: none); (round, fragment) on the wire."""
    return -1 if req.have_round < 0 else req.have_round * fragments + req.fragment
