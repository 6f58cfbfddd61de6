"""The global coordinator: a facade over its parts, the only owner of `GlobalState`, membership and the open sync.

It implements `transport.handler.CoordinatorHandler`, so the same object serves islands over gRPC (`diloco
coordinator`, `diloco launch`) or in-process. It holds one lock (a condition variable) and wires parts that each
have one job and their own state:

  `Enrollment` (enrollment.py)        who may take part: the config's islands, the admitted, less the retired
                                      (durable in RUN_DIR/roster.json)
  `Roster` (roster.py)                who is a member and what each last said; `membership.decide` (pure) says
                                      when a round closes and who is lost
  `PushAdmission` (push_admission.py)  whether a push joins a sync: its round, its base θ, duplicates, dropped
                                      contributions, early (streaming) pushes; a `RoundRule` for plain and
                                      streaming rounds or asynchronous updates
  `GlobalRun` (diloco/run/global_run.py)  the outer step shared with simulate: token-weighted (or robust) aggregate,
                                      outer optimizer, θ += û with û = decode(encode(u + e))
  `Committer` (committer.py)          closes syncs, commits them, drops what cannot be committed, keeps or undoes
                                      each commit once its `Settler` (settler.py) evaluated it
  `CommitWindow` (commit_window.py)   the last commits, the streams their pulls share, who received them
  `PullAnswers` (pull_answers.py)     what a pull gets, and the waits that spare an island a needless push
  `ChunkLeases` (chunk_leases.py)     data.sampling = "chunks": leases to members, a push's spans recorded in the
                                      run's ledger of its source (GlobalRun.chunks) and consumed when its round is
                                      kept, a departed island's chunks returned to the pool, an admitted island's
                                      own source taken on (sources.json)
  `ThrottledEvents` (rejections.py)   refusal and membership events, bounded whatever a caller sends

  push   -> admitted (the transport checked bytes, names, shapes, finiteness, digest; nothing unchecked reaches θ)
  tick   -> leases expire, the adaptive deadline passes, or everyone has pushed: the round closes
  close  -> commit; θ_{r+1} is served at once and the settler follows
  pull   -> what the pure `membership.answer_pull` says: the committed û of the last sync, the full θ, wait, or
            push first

A coordinator killed at any moment restarts from its last checkpoint: the round in flight is lost, islands that
pushed into it push again after resyncing, and nothing half-applied ever existed.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

import grpc
import numpy as np

from diloco import RELEASE
from diloco.config import RunConfig, config_digest, diff_keys, to_dict
from diloco.coordinator.chunk_leases import ChunkLeases
from diloco.coordinator.commit_window import CommitWindow
from diloco.coordinator.committer import Committer, refuse_if_diverged
from diloco.coordinator.enrollment import AdmissionLimits, Enrollment, overdue
from diloco.coordinator.membership import REJOIN
from diloco.coordinator.pull_answers import PullAnswers
from diloco.coordinator.push_admission import AsyncUpdates, PushAdmission, RoundRule, SyncRounds
from diloco.coordinator.rejections import ThrottledEvents, clip
from diloco.coordinator.roster import Roster
from diloco.ops.metrics import CoordinatorMetrics
from diloco.run.global_run import GlobalRun
from diloco.run.rounds import OuterLoop
from diloco.run.rundir import RunDir, read_events
from diloco.run.setup import Setup
from floor.codec import EncodedTensor
from pytrees.naming import flatten_named
from transport import diloco_pb2 as pb
from transport.errors import Rejected
from transport.handler import PullPayload
from transport.validate import ModelSpec


class Coordinator:
    """Wires the coordinator's parts under one condition variable and answers the transport's calls."""

    def __init__(
        self,
        cfg: RunConfig,
        rd: RunDir,
        setup: Setup,
        clock: Callable[[], float] = time.monotonic,
        metrics: CoordinatorMetrics | None = None,
        credentials: Mapping[str, bytes] | None = None,
    ) -> None:
        """`credentials`: SHA-256 of each configured island's secret (`network.secrets`), refused for good once that
        island is retired (`Enrollment`)."""
        self.cfg = cfg
        self.rd = rd
        self.clock = clock
        limits = AdmissionLimits(cfg.islands.max, cfg.islands.admissions_per_minute)
        self.enrollment = Enrollment(cfg.islands.island_names, rd.path, limits, credentials)
        self.metrics = metrics or CoordinatorMetrics(cfg.islands.island_names)
        for name in self.enrollment:
            self.metrics.enroll(name)
        """Prometheus metrics (diloco/ops/metrics.py), fed by this run dir's events from here on (restore's too)."""
        rd.observers.append(self.metrics.on_event)
        self.digest = bytes.fromhex(config_digest(cfg))
        self.frozen = setup.frozen_digest
        """The frozen base's digest under workload.lora (every joiner's must be it), else empty."""
        self.config_dict = to_dict(cfg)
        self.world = GlobalRun(cfg, rd, setup, durable=True)
        self.world.start(self.world.latest_step())
        if self.loop.round > 0:
            self.metrics.resume(self.world.totals, read_events(rd.metrics_path, "push"))
        # Compile the commit's functions while islands start and train, off the lock (OuterLoop.warm_up).
        threading.Thread(
            target=self.world.loop.warm_up, args=(len(self.enrollment),), name="warm-up", daemon=True
        ).start()
        whole = {name: (tuple(a.shape), "float32") for name, a in flatten_named(setup.init_params).items()}
        fragments = self.loop.fragments
        self.model_spec: ModelSpec = whole if fragments.count == 1 else (lambda p: fragments.select(p, whole))
        """What a push may carry: every tensor of θ, or (streaming) the tensors of the fragment it names."""
        self.asynchronous = cfg.train.mode == "async"
        """Async Local-SGD (docs/architecture.md, "Asynchronous rounds"): every push is one update, committed at
        once with its Δ weighted by its staleness; nobody waits for a quorum."""
        rule: RoundRule = SyncRounds()
        self.base_digest: Callable[[pb.PushMeta], str | None] = lambda m: self.world.fragment_digests[m.fragment]
        """The digest a push's base must have: the open θ's fragment, or (asynchronous) θ at the update it names."""
        if self.asynchronous:
            rule = AsyncUpdates(cfg.outer.max_staleness, cfg.outer.staleness_exponent)
            self.base_digest = lambda m: self.window.digests.get(m.round)
        self.cond = threading.Condition()
        self.roster = Roster()
        if self.loop.round > 0:  # a resumed run: every enrolled island took part before (retire_after_s counts)
            self.roster.expect(self.enrollment, clock())
        self.admission = PushAdmission(
            rule,
            max_tokens=cfg.train.inner_steps * cfg.train.batch_size * cfg.model.seq_len,
            remembered=cfg.transport.idempotency_cache,
        )
        kept = cfg.outer.max_staleness + 1 if self.asynchronous else fragments.count
        self.window = CommitWindow(kept, self.loop.sync, self.world.params_digest)
        self.leases = ChunkLeases(lambda: self.world.chunks, cfg.model.seq_len, rd.path, rd.log)
        self.leases.resume(self.world.consumption.layouts)  # the own sources admitted islands brought
        self.leases.release_all_but(self.enrollment)  # a resumed ledger's readers that are gone for good
        self.committer = Committer(
            cfg, rd, self.world, self.cond, lambda: self.clock(), self.roster, self.admission, self.window, self.leases
        )
        self.pulls = PullAnswers(cfg, self.world, self.cond, self.admission, self.window, self.metrics)
        self.events = ThrottledEvents(rd.log)
        self.finished: set[str] = set()
        """Islands that left once every round was committed (`awaited_at_end`)."""
        self.metrics.follow(self)

    # -- lifecycle ---------------------------------------------------------------------------------------------

    @property
    def loop(self) -> OuterLoop:
        return self.world.loop

    @property
    def run_id(self) -> str:
        return self.cfg.run.name

    @property
    def done(self) -> bool:
        """Every planned round is committed and settled (evaluated, logged, checkpointed)."""
        return self.world.done and self.committer.settler.unsettled == 0

    def flush(self) -> None:
        """A graceful stop (SIGTERM): every commit settled and the last committed round checkpointed."""
        self.committer.settler.flush()

    def settled(self, timeout_s: float | None = None) -> bool:
        """Wait until every commit so far is evaluated, logged and checkpointed (or undone); False on timeout."""
        return self.committer.settler.settled(timeout_s)

    def close(self) -> None:
        self.committer.settler.close()
        self.world.close()

    # -- membership --------------------------------------------------------------------------------------------

    def _state_name(self) -> str:
        if self.done:
            return "done"
        return "training" if len(self.roster) >= self.cfg.quorum.min_islands else "waiting_quorum"

    def join(self, req: pb.JoinRequest) -> pb.JoinReply:
        with self.cond:
            check_joiner(req, self.enrollment, self.digest, self.config_dict, self.frozen)
            # From the second round on, a joiner without the open round's θ pulls it and trains H steps first: the
            # round does not wait for it (diloco/coordinator/membership.py).
            late = self.loop.round > 0 and req.last_round != self.loop.round
            if self.roster.join(req.island, self.clock(), self.loop.sync if late else None):
                self.world.totals.islands_joined += 1
                if self.events.membership_logged(self.clock(), "island_joined", self.loop.round, req.island):
                    self.rd.log("island_joined", round=self.loop.round, island=req.island, devices=req.devices)
            return pb.JoinReply(
                run_id=self.run_id,
                round=self.loop.round,
                lease_s=self.cfg.quorum.lease_s,
                # A streaming island's local θ mixes fragments of several syncs: it always restarts from the full θ.
                needs_full_params=req.last_round != self.loop.round or self.loop.fragments.count > 1,
                state=self._state_name(),
            )

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
            return pb.AttendReply(
                member=member, state=self._state_name(), reconnect_grace_s=self.cfg.quorum.reconnect_grace_s
            )

    def absent(self, island: str) -> None:
        """An island's presence call broke: it is lost after `quorum.reconnect_grace_s` unless heard from again (the
        ticker's next `tick` after the grace drops it; diloco/coordinator/membership.py)."""
        with self.cond:
            if not self.done:
                self.roster.broke(island, self.clock())

    def leave(self, req: pb.LeaveRequest) -> pb.LeaveReply:
        with self.cond:
            if self.world.done:
                self.finished.add(req.island)
            self.leases.release(req.island)
            left = self.roster.leave(req.island, self.clock())
            if left and self.events.membership_logged(self.clock(), "island_left", self.loop.round, req.island):
                self.rd.log("island_left", round=self.loop.round, island=req.island, reason=req.reason)
            self.committer.tick()
        return pb.LeaveReply(ok=True)

    def awaited_at_end(self) -> list[str]:
        """Islands that took part, are no members now and have not left since the last commit: a process killed and
        starting again, which a coordinator that exits at once would leave retrying for its whole patience
        (network.coordinator_wait_s). `serve` lingers for them a while; joining, they hear that the run is done."""
        with self.cond:
            return sorted(n for n in self.roster.gone if n not in self.finished and n in self.enrollment)

    # -- the roster ----------------------------------------------------------------------------------------------

    def admit(self, req: pb.AdmitRequest) -> pb.AdmitReply:
        """The operator admits an island: enrolled durably (roster.json) before the reply; it joins when it comes,
        at the next sync point, and is never waited for by the round open when it arrives."""
        with self.cond:
            self.enrollment.admit(req.island, bytes(req.secret_sha256), self.loop.round)
            self.metrics.enroll(req.island)
            self.world.totals.islands_admitted += 1
            self.rd.log("island_admitted", round=self.loop.round, island=req.island, enrolled=len(self.enrollment))
            detail = f"island {req.island} admitted at round {self.loop.round}; {len(self.enrollment)} enrolled"
            return pb.AdmitReply(ok=True, round=self.loop.round, detail=detail)

    def retire(self, req: pb.RetireRequest, by: str) -> pb.RetireReply:
        """Retire an island for good: quorum and deadline stop counting it at once, its credentials are refused
        from then on. A push it made to the open sync still counts (it is valid work)."""
        with self.cond:
            if req.island not in self.enrollment:
                gone = self.enrollment.retirement(req.island)
                why = f"was retired {gone}" if gone else "is not on this run's roster"
                raise Rejected(grpc.StatusCode.NOT_FOUND, f"island {clip(req.island, 64)!r} {why}")
            self._retire(req.island, req.reason or f"asked by {by}")
            self.committer.tick()
            return pb.RetireReply(ok=True, round=self.loop.round, detail=f"island {req.island} retired")

    def _retire(self, island: str, reason: str) -> None:
        """Durably first (a failed write raises and changes nothing), then everywhere else."""
        self.enrollment.retire(island, self.loop.round, reason)
        self.roster.retire(island)
        self.metrics.retire(island)
        self.leases.release(island)
        self.world.totals.islands_retired += 1
        self.rd.log("island_retired", round=self.loop.round, island=island, reason=clip(reason))
        self.cond.notify_all()

    # -- pushes and pulls --------------------------------------------------------------------------------------

    def admissible(self, meta: pb.PushMeta) -> None:
        """A push's first chunk passed the transport's checks: refuse it now, before its payload is buffered, unless
        its round is one the admission takes (or it retries an accepted push)."""
        with self.cond:
            self.admission.admissible(meta, self.loop)

    def receiving(self, meta: pb.PushMeta) -> AbstractContextManager[None]:
        return self.pulls.receiving(meta)

    def push(
        self, meta: pb.PushMeta, tensors: Sequence[EncodedTensor], arrays: dict[str, np.ndarray], payload_digest: bytes
    ) -> pb.PushReply:
        """A pseudo-gradient the transport validated: a retry is answered as before; anything else joins its sync
        only once every check passed (`PushAdmission`), and is logged and counted only then."""
        with self.cond:
            refuse_if_diverged(self.world)
            if meta.island not in self.enrollment:
                who = clip(meta.island, 60)
                raise Rejected(grpc.StatusCode.PERMISSION_DENIED, f"island {who!r} is not on this run's roster")
            replayed = self.admission.replay(meta, payload_digest)
            if replayed is not None:
                return replayed
            if self.world.done or meta.round >= self.cfg.train.rounds:
                raise Rejected(grpc.StatusCode.FAILED_PRECONDITION, "the run is complete")
            admitted = self.admission.place(meta, tensors, arrays, payload_digest, self.loop, self.base_digest)
            sync = admitted.placement.position  # its sync; asynchronous: the update it becomes
            self.leases.record(meta, sync)
            try:
                self.admission.enter(admitted, self.loop)
            except Rejected:
                self.leases.drop(meta.island, sync)
                raise
            self._count_push(
                meta,
                admitted.tokens,
                admitted.placement.position,
                admitted.placement.staleness,
                sum(len(t.payload) for t in tensors),
                len({t.name for t in tensors if t.offset}),
            )
            if self.asynchronous:
                reply = self.committer.commit_update(meta, admitted)
            else:
                # Remembered before the tick: a commit there that drops this contribution forgets it with the rest.
                self.admission.remember(admitted.key, payload_digest, pb.PushReply())
                self.committer.tick()
                self.admission.refuse_if_dropped(admitted)
                reply = pb.PushReply(accepted=True, round=self.loop.round, detail="accepted")
            return self.admission.remember(admitted.key, payload_digest, reply)

    def _count_push(
        self, meta: pb.PushMeta, tokens: int, position: int, staleness: int, nbytes: int, in_pieces: int
    ) -> None:
        self.roster.pushed(meta.island, float(meta.loss), self.clock())
        totals = self.world.totals
        totals.tokens += tokens
        totals.bytes_up += nbytes
        totals.compute_s += float(meta.compute_s)
        totals.island_wall_s += float(meta.wall_s)
        where = {"base": meta.round, "staleness": staleness} if self.asynchronous else {}
        self.rd.log(
            "push",
            round=position // self.loop.fragments.count,
            **where,
            **({"fragment": meta.fragment} if self.loop.fragments.count > 1 else {}),
            island=meta.island,
            tokens=tokens,
            bytes_up=nbytes,
            loss=float(meta.loss),
            compute_s=round(float(meta.compute_s), 4),
            wall_s=round(float(meta.wall_s), 4),
            **({"tokens_claimed": int(meta.tokens)} if tokens != meta.tokens else {}),
            **({"tensors_in_pieces": in_pieces} if in_pieces else {}),
        )

    def pull(self, req: pb.PullRequest) -> PullPayload:
        return self.pulls.answer(req)

    # -- chunks of the corpus (data.sampling = "chunks") -------------------------------------------------------

    def lease(self, req: pb.LeaseRequest) -> pb.LeaseReply:
        with self.cond:
            refuse_if_diverged(self.world)
            return self.leases.lease(req, req.island in self.roster, self.loop.round, self.enrollment)

    # -- the ticker and reporting ------------------------------------------------------------------------------

    def tick(self) -> None:
        with self.cond:
            now = self.clock()
            self.events.flush(now, self.loop.round)
            self.leases.release_gone(self.roster.gone, now, self.cfg.quorum.lease_s)
            for island in overdue(self.roster.gone, now, self.cfg.islands.retire_after_s):
                gone_s = now - self.roster.gone[island]
                try:
                    self._retire(
                        island, f"gone {gone_s:.0f}s (islands.retire_after_s = {self.cfg.islands.retire_after_s:g})"
                    )
                except Rejected as exc:  # roster.json could not be written: nothing changed, a later tick tries again
                    if self.events.membership_logged(now, "retire_failed", self.loop.round, island):
                        self.rd.log("retire_failed", round=self.loop.round, island=island, reason=clip(exc.reason))
            self.committer.tick()

    def on_rejected(self, island: str, reason: str) -> None:
        """Count every refusal; log a truncated sample of them (diloco/coordinator/rejections.py), never one line per
        attack."""
        if reason.startswith(f"{grpc.StatusCode.ABORTED.name}:"):
            return  # "the round is still open, ask again" answers a pull; it refuses nothing
        self.metrics.refused(reason)
        with self.cond:
            self.world.totals.rejected += 1
            self.events.refused(self.clock(), self.loop.round, island, reason)

    def status(self) -> pb.StatusReply:
        with self.cond:
            now = self.clock()
            islands = [
                pb.IslandStatus(
                    name=name,
                    round=self.loop.round,
                    last_seen_s=self.roster.seen_ago(name, now),
                    state=("pushed" if name in self.loop.pending else "training") if name in self.roster else "absent",
                )
                for name in self.enrollment.names
            ]
            return pb.StatusReply(
                run_id=self.run_id,
                round=self.loop.round,
                state=self._state_name(),
                islands=islands,
                detail_json=json.dumps(self.live_status()),
            )

    def live_status(self) -> dict[str, Any]:
        """The summary so far plus who is alive and their last losses: `diloco status` and `launch`'s display."""
        return {
            **self.world.summary(),
            "islands_alive": self.roster.live,
            "last_losses": dict(self.roster.last_loss),
            "island_bytes": {n: dict(t) for n, t in self.metrics.tally.items() if n in self.enrollment},
            "roster": self.enrollment.summary(),
            "rejected_by_code": dict(self.metrics.reasons),
        }


def check_joiner(
    req: pb.JoinRequest, enrollment: Enrollment, digest: bytes, config: dict[str, Any], frozen: bytes = b""
) -> None:
    """A join names one of the run's enrolled islands, runs this release, holds this run's config and, under
    workload.lora, the coordinator's frozen base (`frozen`, its digest) (Rejected otherwise, naming what differs)."""
    if req.island not in enrollment:
        retired = enrollment.retirement(req.island)
        if retired is not None:
            raise Rejected(grpc.StatusCode.PERMISSION_DENIED, f"island '{req.island}' was retired {retired}")
        shown = ", ".join(enrollment.names[:16]) + (", ..." if len(enrollment) > 16 else "")
        raise Rejected(
            grpc.StatusCode.NOT_FOUND,
            f"island '{clip(req.island, 64)}' is not on this run's roster (islands.names and admitted: {shown})",
        )
    if req.release != RELEASE:
        theirs = f"diloco {clip(req.release, 40)}" if req.release else "an older diloco (its join names no release)"
        raise Rejected(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"island {req.island} runs {theirs}, the coordinator "
            f"diloco {RELEASE}: run one release everywhere (θ is bit-identical only within one)",
        )
    if bytes(req.config_digest) == digest:
        if bytes(req.frozen_digest) != frozen:
            theirs = bytes(req.frozen_digest).hex()[:16] or "none"
            raise Rejected(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"island {req.island}'s frozen base (workload.lora over init.from) differs from the coordinator's "
                f"(digest {theirs} against {frozen.hex()[:16] or 'none'}): init.from must hold the same checkpoint on "
                "every host",
            )
        return
    try:  # name the differing keys when the island's config_json is a readable object (it is only ever a hint)
        theirs = json.loads(req.config_json) if req.config_json else None
        keys = diff_keys(config, theirs) if isinstance(theirs, dict) else []
    except (ValueError, TypeError, RecursionError):  # not JSON, unhashable keys, nested beyond reason
        keys = []
    named = f" in: {', '.join(clip(k, 60) for k in keys[:10])}" if keys else ""
    raise Rejected(
        grpc.StatusCode.FAILED_PRECONDITION,
        f"island {req.island}'s config differs from the coordinator's{named}; start both from one config",
    )
