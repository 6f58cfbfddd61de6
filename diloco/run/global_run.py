"""The global model's side of a run, shared by `simulate` and the coordinator: start or resume, close rounds, sum up.

Both drivers own one `GlobalRun`. Closing a round is the same everywhere (docs/architecture.md, "The round"):

    commit   -> OuterLoop.commit(): token-weighted mean Δ, outer step, θ_{r+1} = θ_r + û (û exactly what is sent)
    evaluate -> the global model's loss on the fixed validation batches
    log      -> one `round` event in metrics.jsonl (with streaming: a `sync` event for each fragment's commit but
                the round's last, which logs the `round` event)
    save     -> GlobalState + Totals with orbax every train.checkpoint_every rounds (at round ends); with `durable` (the
                coordinator) the save finishes before the caller lets any island see θ_{r+1}, so no island ever
                holds a θ that a restarted coordinator lacks

The drivers differ only in how contributions arrive (direct calls, or validated pushes over the wire) and in
when a round closes (every island has trained, or `membership.decide`).

A committed model whose evaluation is NaN/Inf or has exploded (`diverged_reason`) is not kept: the commit is undone
(θ, the outer state, the round and its contributions stay as they were, nothing is checkpointed), a `diverged`
event is logged, and `close_round` raises `DivergedError` with one line naming the round, the losses and the
settings to change; every later `close_round` raises it again. `simulate` ends there (exit code 2); the coordinator
process stops the run (diloco/coordinator/serve.py).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from diloco.config import RunConfig
from diloco.run.checkpoint import CheckpointStore, restore_state, save_state
from diloco.run.chunk_ledger import CORPUS, ConsumptionCheck
from diloco.run.chunk_sources import ChunkSources, layout_fields
from diloco.run.rounds import Commit, Contribution, GlobalState, OuterLoop, fragment_digests
from diloco.run.rundir import RunDir, read_events
from diloco.run.setup import Evaluator, Setup
from diloco.run.summary import Totals, summary
from diloco.run.warm_start import initial_params
from islands.island import DivergedError, divergence_advice
from outer_optimizer.optimizers import aggregator, build_optimizer
from pytrees.digest import tree_digest

DIVERGENCE_FACTOR = 2.0
"""A committed model whose eval loss is above this many times the initial model's has diverged. The initial model
predicts about uniformly, so being twice as wrong as that is no spike of a healthy run; 0 turns the check off
(NaN/Inf is always caught)."""


def diverged_reason(eval_loss: float, initial: float | None, factor: float = DIVERGENCE_FACTOR) -> str | None:
    """Why a committed model counts as diverged, or None. Only a positive initial loss scales the limit (a custom
    model's loss may be negative, where "2x" means nothing): then only NaN/Inf counts."""
    if not math.isfinite(eval_loss):
        return f"eval loss is {eval_loss}"
    if factor > 0 and initial is not None and initial > 0 and eval_loss > factor * initial:
        return f"eval loss {eval_loss:.4g} is over {factor:g}x the initial {initial:.4g}"
    return None


@dataclass
class Settling:
    """A commit whose θ is the global model but not yet evaluated, logged or checkpointed (`GlobalRun.settle`)."""

    commit: Commit
    before: tuple[GlobalState, dict[str, Contribution]]
    """The loop as it was before the commit: what a diverged commit rolls back to."""
    state: GlobalState
    """The global state right after the commit (what is evaluated and saved, however far the loop moved on)."""
    losses: tuple[float, ...]
    seconds: float
    reason: str | None
    commit_s: float
    round_closed: bool
    """The commit closed its round (the last fragment's, or every commit without streaming)."""
    annotations: dict[str, Any] = field(default_factory=dict)
    """What only the driver knows, added to the commit's event (the asynchronous mode's staleness and weight)."""
    eval_s: float = 0.0
    """Seconds the evaluation took (set by whoever evaluates it)."""
    scores: dict[str, float] = field(default_factory=dict)
    """The post-training workloads' held-out figures of the commit's θ (set with eval_s; {} without post-training)."""


class GlobalRun:
    """θ, the outer optimizer and the run's totals, with their evaluation, metrics and checkpoints."""

    def __init__(self, cfg: RunConfig, rd: RunDir, setup: Setup, *, durable: bool) -> None:
        self.cfg = cfg
        self.rd = rd
        outer = cfg.outer
        self.loop = OuterLoop.fresh(
            setup.init_params,
            build_optimizer(outer),
            cfg.codec.spec("downlink"),
            aggregator(outer),
            setup.fragments,
            union_of=cfg.codec.density if cfg.union_downlink else 0.0,
        )
        self.evaluate = Evaluator.of(cfg, setup)
        self.param_count = setup.n_params
        self.totals = Totals()
        self.durations: list[float] = []
        """Seconds of the last quorum.history rounds: the coordinator's adaptive deadline survives a restart."""
        self.store = CheckpointStore(rd.checkpoints / "coordinator") if cfg.train.checkpoint_every else None
        self.durable = durable
        factor = cfg.workload.divergence_factor
        self.divergence_factor = DIVERGENCE_FACTOR if factor is None else factor
        self.diverged: DivergedError | None = None
        """Set when a commit diverged (and was undone): the run must stop; `close_round` raises it from then on."""
        self.chunks: ChunkSources | None = None
        """data.sampling = "chunks": per source, who reads which chunk and what is consumed
        (diloco/run/chunk_sources.py, diloco/run/chunk_ledger.py)."""
        self.consumption = ConsumptionCheck()
        """What this run's `chunks_consumed` records add up to (summary.json's `sequences_*`, `epochs`)."""
        if setup.layouts is not None:
            per_round = cfg.train.inner_steps * cfg.train.batch_size
            self.chunks = ChunkSources(setup.layouts, cfg.islands.island_names, per_round)
            rd.observers.append(self.consumption.observe)  # it counts the records as they are written
        self._digest_all()

    def _digest_all(self) -> None:
        self.params_digest = tree_digest(self.loop.params)
        """Digest of θ at the current round, computed once per commit (Status and pulls read it, never rehash)."""
        self.fragment_digests = fragment_digests(self.loop.fragments, self.loop.params, self.params_digest)
        """Each fragment's `fragment_digest`, kept with each commit: what a push's base_digest is checked against."""

    @property
    def done(self) -> bool:
        return self.loop.round >= self.cfg.train.rounds

    def start(self, step: int | None) -> None:
        """Resume from checkpoint `step`, or (None) start at θ_0 and evaluate it: the random θ_0, or with init.from
        the source's parameters (diloco/run/warm_start.py; only here, so a run that resumes never reads it again)."""
        if step is None or self.store is None:
            if self.cfg.init.from_:
                self.loop.state = replace(self.loop.state, params=initial_params(self.cfg, self.loop.params, self.rd))
                self._digest_all()
            loss, scores = self.evaluate.measure(self.loop.params)
            self.totals.initial_eval_loss = self.totals.final_eval_loss = loss
            self.totals.initial_scores = self.totals.final_scores = scores or None
            self.rd.log("eval", step=0, eval_loss=loss, **({"scores": scores} if scores else {}))
            if self.chunks is not None:
                for key, layout in self.chunks.layouts().items():
                    self.rd.log("chunks_layout", **layout_fields(key, layout))
            return
        self.loop.state, meta = restore_state(self.store, step, self.loop.state)
        self._digest_all()
        self.totals = Totals.from_meta(meta["totals"])
        self.durations = list(meta.get("durations", []))
        self.rd.truncate_after_round(self.loop.round)
        kept = read_events(self.rd.metrics_path)
        self.totals = roster_counted(self.totals, kept)
        if self.chunks is not None:
            self.chunks.restore(meta)
            for event in kept:  # the records kept: what the restored ledger holds
                self.consumption.add(event)
        self.rd.log("resumed", round=self.loop.round, digest=self.params_digest)

    def latest_step(self) -> int | None:
        steps = self.store.steps() if self.store is not None else []
        return steps[-1] if steps else None

    def close_round(
        self,
        *,
        losses: Sequence[float],
        seconds: float,
        deliveries: int = 0,
        reason: str | None = None,
        annotations: dict[str, Any] | None = None,
    ) -> Commit:
        """Commit the open sync, evaluate, log its event and checkpoint it when due: `commit` then `settle`, as
        `simulate` runs them (the coordinator runs `settle` on another thread, off the islands' path).

        Raises DivergedError, with θ and the round unchanged, when the committed model diverged (module docstring).
        """
        pending = self.commit(
            losses=losses, seconds=seconds, deliveries=deliveries, reason=reason, annotations=annotations
        )
        self.settle(pending, self.evaluate_commit(pending))
        return pending.commit

    def evaluate_commit(self, pending: Settling) -> float:
        """The eval loss of a commit's θ (timed into `pending.eval_s`); reads nothing that later commits change.
        It also counts what the aggregation rule kept (`Commit.kept`), the record's other CPU cost, so that the
        coordinator runs both outside its lock."""
        t0 = time.perf_counter()
        loss, pending.scores = self.evaluate.measure(pending.state.params)
        pending.eval_s = time.perf_counter() - t0
        pending.commit.kept  # noqa: B018 - counted (and cached) here
        return loss

    def commit(
        self,
        *,
        losses: Sequence[float],
        seconds: float,
        deliveries: int = 0,
        reason: str | None = None,
        annotations: dict[str, Any] | None = None,
    ) -> Settling:
        """The outer step of the open sync: θ_{s+1} is the global model from here on (pulls may serve it), and what
        remains to do is returned for `settle`.

        `deliveries`: how many islands receive this update without a pull (simulate hands it to each island
        directly; the coordinator counts its downlink bytes per pull instead). A commit that fails (the codec
        refuses û) raises with nothing changed.
        """
        if self.diverged is not None:
            raise self.diverged
        before = self.loop.snapshot()
        t0 = time.perf_counter()
        commit = self.loop.commit()
        commit_s = time.perf_counter() - t0
        self.params_digest = commit.digest
        self.fragment_digests[commit.fragment] = commit.fragment_digest
        round_closed = self.loop.fragment == 0
        if round_closed:
            self.durations = [*self.durations, seconds][-self.cfg.quorum.history :]
        self.totals.bytes_down += sum(e.nbytes for e in commit.encoded) * deliveries
        return Settling(
            commit=commit,
            before=before,
            state=self.loop.state,
            losses=tuple(float(x) for x in losses),
            seconds=seconds,
            reason=reason,
            commit_s=commit_s,
            round_closed=round_closed,
            annotations=annotations or {},
        )

    def settle(self, pending: Settling, eval_loss: float) -> None:
        """The rest of a commit, given the evaluation of its θ: `record` it, then `save` it when due."""
        meta = self.record(pending, eval_loss)
        if meta is not None:
            self.save(pending, meta)

    def record(self, pending: Settling, eval_loss: float) -> dict | None:
        """Keep a commit whose θ evaluated to `eval_loss`: totals and its `round` or `sync` event; returns the
        checkpoint metadata when a save is due (else None). When it diverged, undo it and every commit after it
        (the loop goes back to `pending.before`) and raise DivergedError. Only a kept commit is ever saved, so a
        restored coordinator never holds a diverged model."""
        commit = pending.commit
        why = diverged_reason(eval_loss, self.totals.initial_eval_loss, self.divergence_factor)
        if why is not None:
            # All or nothing, as for a commit that fails: θ before it is the global model again (and the
            # checkpoint), its sync is open again with its contributions.
            self.loop.rollback(pending.before)
            self._digest_all()
            if self.chunks is not None:  # the later commits are undone; this sync's spans stay, as its pushes do
                self.chunks.undo_after(self._position(commit))
            self._diverge(commit, why, eval_loss, pending.losses)
        t = self.totals
        t.rounds = commit.round + (1 if pending.round_closed else 0)
        t.syncs += 1
        t.final_eval_loss = eval_loss
        t.final_scores = pending.scores or t.final_scores
        streaming = (
            {"fragment": commit.fragment, "fragment_digest": commit.fragment_digest}
            if self.loop.fragments.count > 1
            else {}
        )
        close_s = {"commit": round(pending.commit_s, 4), "eval": round(pending.eval_s, 4)}
        if self.chunks is not None:  # every sync consumes what its pushes claimed (docs/architecture.md)
            consumed = self.chunks.commit(self._position(commit), commit.islands)
            listed = {
                key: {island: [s.as_list() for s in got] for island, got in by_island.items()}
                for key, by_island in consumed.items()
            }
            others = {key: spans for key, spans in listed.items() if key != CORPUS}
            self.rd.log(
                "chunks_consumed",
                round=commit.round,
                **({"fragment": commit.fragment} if self.loop.fragments.count > 1 else {}),
                sequences=sum(s.length for by_island in consumed.values() for got in by_island.values() for s in got),
                spans=listed.get(CORPUS, {}),
                **({"sources": others} if others else {}),
            )
            if pending.round_closed and t.rounds >= self.cfg.train.rounds:
                self._log_unread(commit.round)
        losses, reason = pending.losses, pending.reason
        self.rd.log(
            "round" if pending.round_closed else "sync",
            round=commit.round,
            **streaming,
            loss=float(np.mean(losses)) if len(losses) else None,
            eval_loss=t.final_eval_loss,
            **({"scores": pending.scores} if pending.scores else {}),
            tokens=t.tokens,
            bytes_up=t.bytes_up,
            bytes_down=t.bytes_down,
            islands=list(commit.islands),
            digest=commit.digest,
            seconds=round(pending.seconds, 4),
            close_s=close_s,
            **({"reason": reason} if reason else {}),
            **({"kept": commit.reduced} if commit.reduced else {}),
            **pending.annotations,
        )
        if self.store is None or not pending.round_closed or not checkpoint_due(self.cfg, t.rounds):
            return None
        return self.checkpoint_meta()

    def _position(self, commit: Commit) -> int:
        """The sync `commit` closed, round·P + fragment: what the chunk ledger counts pushes by."""
        return commit.round * self.loop.fragments.count + commit.fragment

    def _log_unread(self, round_: int) -> None:
        """The run's last round is kept: what it leaves unread of the passes it began, by its records (summary.json's
        `sequences_unread`) and where, by the ledger."""
        assert self.chunks is not None
        where = {
            key: {"spans": [s.as_list() for s in ledger.unfinished()], "fresh_sequences": ledger.fresh_sequences()}
            for key, ledger in self.chunks.ledgers.items()
        }
        corpus = where.pop(CORPUS, {"spans": [], "fresh_sequences": 0})
        self.rd.log(
            "chunks_unread",
            round=round_,
            sequences=self.consumption.result().unread,
            **corpus,
            **({"sources": where} if where else {}),
        )

    def checkpoint_meta(self) -> dict:
        """What a checkpoint stores beside the state: the totals, the deadline's history and (chunks) the ledger, as
        they are now."""
        chunks = self.chunks.to_meta() if self.chunks is not None else {}
        return {"totals": self.totals.to_meta(), "durations": list(self.durations), **chunks}

    def save(self, pending: Settling, meta: dict) -> None:
        """Checkpoint the state of a recorded commit (one caller at a time). The event was logged before: a kill in
        between loses the event with the round (truncated on resume, then rerun), never a round without its event."""
        assert self.store is not None
        t0 = time.perf_counter()
        save_state(self.store, meta["totals"]["rounds"], pending.state, meta)
        if self.durable:
            self.store.wait()
        self.rd.log("checkpoint", round=pending.commit.round, seconds=round(time.perf_counter() - t0, 4))

    def _diverge(self, commit: Commit, why: str, eval_loss: float, losses: Sequence[float]) -> None:
        """Log the `diverged` event, remember the error for every later close, and raise it.

        The advice depends on where it blew up: islands whose own losses exploded point at the inner optimizer;
        islands that trained fine while their average step wrecked the model point at the outer one.
        """
        island_losses = [float(x) for x in losses]
        worst = max(island_losses, default=math.nan, key=lambda x: math.inf if math.isnan(x) else x)
        inner_blew_up = any(diverged_reason(x, self.totals.initial_eval_loss, self.divergence_factor) for x in losses)
        outer = self.cfg.outer
        advice = (
            divergence_advice(self.cfg.inner)
            if inner_blew_up or not island_losses
            else f"lower outer.lr ({outer.lr:g}) or outer.momentum ({outer.momentum:g})"
        )
        islands = f"; islands' last loss up to {worst:.4g}" if island_losses else ""
        self.rd.log(
            "diverged",
            round=commit.round,
            eval_loss=eval_loss,
            initial_eval_loss=self.totals.initial_eval_loss,
            loss=worst if island_losses else None,
            islands=list(commit.islands),
            reason=why,
        )
        self.diverged = DivergedError(
            f"the global model diverged at round {commit.round} and was not kept: {why}{islands}; {advice}"
        )
        raise self.diverged

    def summary(self) -> dict:
        return summary(
            self.cfg,
            self.totals,
            wall_s=self.rd.elapsed(),
            param_count=self.param_count,
            params_digest=self.params_digest,
            consumption=self.consumption.result() if self.chunks is not None else None,
            by_source=self.consumption.by_source() if self.chunks is not None else None,
        )

    def close(self) -> None:
        if self.store is not None:
            self.store.close()


def roster_counted(totals: Totals, events: Sequence[dict[str, Any]]) -> Totals:
    """Totals restored from a checkpoint, with the admissions and retirements of the records kept on resume (the
    `DURABLE_EVENTS`, some after that checkpoint); never fewer than the checkpoint counted (an older diloco dropped
    such records on resume)."""
    admitted = sum(e.get("event") == "island_admitted" for e in events)
    retired = sum(e.get("event") == "island_retired" for e in events)
    return replace(
        totals,
        islands_admitted=max(totals.islands_admitted, admitted),
        islands_retired=max(totals.islands_retired, retired),
    )


def checkpoint_due(cfg: RunConfig, completed_rounds: int) -> bool:
    """Every train.checkpoint_every rounds, and always after the last one."""
    every = cfg.train.checkpoint_every
    return every > 0 and (completed_rounds % every == 0 or completed_rounds >= cfg.train.rounds)
