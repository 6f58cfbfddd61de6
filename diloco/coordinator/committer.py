"""The commit path: when the open sync closes, what it commits, and what becomes of a commit that cannot stand.

`tick` applies the pure `membership.decide` (who is lost, whether the round closes); `close` commits the open sync
through `GlobalRun.commit` (the outer step shared with simulate) and hands the commit to the `Settler`. A sync whose
contributions cannot be committed (their update overflows float32 and the downlink codec refuses it) loses its
largest contribution and is tried again; a commit whose model diverges is undone with every later one (`keep`), and
unless every island's own loss diverged too, its largest contribution is dropped the same way. An island's input
may cost that island its round, never the coordinator its life. No lock of its own: the coordinator calls it under
its condition variable, which it shares with the settler.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import grpc

from diloco import faults
from diloco.config import RunConfig
from diloco.coordinator.chunk_leases import ChunkLeases
from diloco.coordinator.commit_window import CommitWindow
from diloco.coordinator.membership import Action, decide
from diloco.coordinator.push_admission import Admitted, PushAdmission
from diloco.coordinator.rejections import clip
from diloco.coordinator.roster import Roster
from diloco.coordinator.settler import Job, Settler
from diloco.run.global_run import GlobalRun, Settling, diverged_reason
from diloco.run.rounds import OuterLoop
from diloco.run.rundir import RunDir
from floor.codec import CodecError
from islands.island import DivergedError
from transport import diloco_pb2 as pb
from transport.errors import Rejected


def refuse_if_diverged(world: GlobalRun) -> None:
    """After the run itself diverged, every call is refused with the reason (`serve` exits with it)."""
    if world.diverged is not None:
        raise Rejected(grpc.StatusCode.FAILED_PRECONDITION, str(world.diverged))


class Committer:
    """Closes syncs, commits them, and keeps or undoes each commit once the settler evaluated it."""

    def __init__(
        self,
        cfg: RunConfig,
        rd: RunDir,
        world: GlobalRun,
        cond: threading.Condition,
        clock: Callable[[], float],
        roster: Roster,
        admission: PushAdmission,
        window: CommitWindow,
        leases: ChunkLeases,
    ) -> None:
        self.cfg = cfg
        self.rd = rd
        self.world = world
        self.cond = cond
        self.clock = clock
        self.roster = roster
        self.admission = admission
        self.window = window
        self.leases = leases
        self.asynchronous = cfg.train.mode == "async"
        """An asynchronous push commits itself (`commit_update`); a deadline or quorum never closes a sync."""
        self.opened_at = clock()
        self.settler = Settler(cond, world, self.keep, self.islands_done)

    @property
    def loop(self) -> OuterLoop:
        return self.world.loop

    def tick(self) -> None:
        """Drop the members `decide` counts lost, and close the open sync when it says so."""
        if self.world.done:
            return
        now = self.clock()
        view = self.roster.round_view(self.opened_at, self.loop.pending, self.world.durations, self.loop.sync)
        decision = decide(now, view, self.cfg.quorum)
        self.roster.lose(decision.lost, now)
        for name, why in sorted(decision.lost.items()):
            self.leases.release(name)  # a lost island's chunks return to the pool (its pushes still count)
            self.world.totals.islands_lost += 1
            self.rd.log("island_lost", round=self.loop.round, island=name, reason=why)
        if decision.action is Action.CLOSE and not self.asynchronous:
            self.close(now, decision.reason)

    def commit_update(self, meta: pb.PushMeta, admitted: Admitted) -> pb.PushReply:
        """Asynchronous: the push is one update, committed now; refused when it could not be (`close`)."""
        placement = admitted.placement
        annotations = {"island": meta.island, "staleness": placement.staleness, "weight": round(placement.weight, 6)}
        self.close(self.clock(), None, annotations)
        if self.loop.sync == placement.position:
            why = self.admission.dropped.get(admitted.content, "not committed")
            raise Rejected(
                grpc.StatusCode.FAILED_PRECONDITION, f"island {meta.island}'s pseudo-gradient was dropped: {why}"
            )
        return pb.PushReply(accepted=True, round=placement.position, detail=f"applied as update {placement.position}")

    def close(self, now: float, reason: str | None, annotations: dict[str, Any] | None = None) -> None:
        """Commit the open sync, dropping the largest contribution while it cannot be committed. θ_{s+1} is served
        from here on; the settler evaluates and checkpoints it. A sync left with no contribution stays open."""
        while self.loop.pending and self.world.diverged is None:
            sync, restore = self.loop.sync, self.admission.snapshot()
            faults.at(faults.COORDINATOR, "before_commit", self.loop.round)
            try:
                pending = self.world.commit(
                    losses=self.roster.losses(self.loop.pending),
                    seconds=now - self.opened_at,
                    reason=reason,
                    annotations=annotations,
                )
            except (CodecError, ArithmeticError) as exc:  # commit is all or nothing: θ and the round are unchanged
                self._drop_largest(str(exc))
                continue
            self.window.add(sync, pending.commit)
            self.settler.enqueue(pending, restore)
            self.opened_at = now
            for island, why in self.admission.opened(self.loop):
                self.rd.log(
                    "contribution_dropped",
                    round=self.loop.round,
                    fragment=self.loop.fragment,
                    island=island,
                    reason=clip(why),
                )
            if self.loop.pending:  # early pushes filled the new sync
                self.tick()
            self.cond.notify_all()
            return

    def _drop_largest(self, why: str) -> None:
        culprit = self.loop.largest_contribution()
        self.loop.withdraw(culprit)
        self.admission.drop(culprit, why)
        if self.world.chunks is not None:  # what it trained on was not consumed: its reader reads it again
            self.world.chunks.drop(culprit, self.loop.sync)
        self.rd.log("contribution_dropped", round=self.loop.round, island=culprit, reason=clip(why))

    def islands_done(self, pending: Settling) -> bool:
        """Every island that contributed to the commit and still holds a lease is done with it: it has been sent the
        commit and, with plain rounds, has said by heartbeat that it trains on the next round (it beats at once after
        adopting θ). Streaming and asynchronous islands train while they pull, so for them the pull is all."""
        commit = pending.commit
        position = commit.round * self.loop.fragments.count + commit.fragment
        plain = self.loop.fragments.count == 1 and not self.asynchronous
        return all(
            self.window.was_served(name, position) and (not plain or self.roster.moved_past(name, commit.round))
            for name in commit.islands
            if name in self.roster
        )

    def keep(self, job: Job, eval_loss: float) -> dict | None:
        """Keep a commit (returns the checkpoint metadata, if due) or, when its model diverged, undo it and every
        later commit and go on without its largest contribution (the settler's ``keep``, lock held)."""
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
                return None  # the run itself diverged: `refuse_if_diverged` refuses every later call
            self.world.diverged = None  # not the run's divergence: go on without this contribution
            self._drop_largest(f"diverged with a healthy island loss (lower outer.lr if all are dropped so): {exc}")
            self.tick()
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
        initial = self.world.totals.initial_eval_loss
        losses = self.roster.losses(sorted(set(self.loop.pending) | set(self.roster.live)))
        return bool(losses) and all(diverged_reason(x, initial, self.world.divergence_factor) for x in losses)
