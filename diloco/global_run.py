"""The global model's side of a run, shared by `simulate` and the coordinator: start or resume, close rounds, sum up.

Both drivers own one `GlobalRun`. Closing a round is the same everywhere (docs/architecture.md, "The round"):

    commit   -> OuterLoop.commit(): token-weighted mean Δ, outer step, θ_{r+1} = θ_r + û (û exactly what is sent)
    evaluate -> the global model's loss on the fixed validation batches
    log      -> one `round` event in metrics.jsonl
    save     -> GlobalState + Totals with orbax every train.checkpoint_every rounds; with `durable` (the
                coordinator) the save finishes before the caller lets any island see θ_{r+1}, so no island ever
                holds a θ that a restarted coordinator lacks

The drivers differ only in how contributions arrive (direct calls, or validated pushes over the wire) and in
when a round closes (every island has trained, or `membership.decide`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from diloco.checkpoint import CheckpointStore, restore_state, save_state
from diloco.config import RunConfig
from diloco.rounds import Commit, OuterLoop
from diloco.rundir import RunDir
from diloco.setup import Evaluator, Setup
from diloco.summary import Totals, summary
from transport.digest import tree_digest


class GlobalRun:
    """θ, the outer optimizer and the run's totals, with their evaluation, metrics and checkpoints."""

    def __init__(self, cfg: RunConfig, rd: RunDir, setup: Setup, *, durable: bool) -> None:
        self.cfg = cfg
        self.rd = rd
        self.loop = OuterLoop.fresh(setup.init_params, cfg.outer.build(), cfg.codec.spec("downlink"))
        self.evaluate = Evaluator(setup.model, setup.eval_stack)
        self.param_count = setup.n_params
        self.totals = Totals()
        self.durations: list[float] = []
        """Seconds of the last quorum.history rounds: the coordinator's adaptive deadline survives a restart."""
        self.store = CheckpointStore(rd.checkpoints / "coordinator") if cfg.train.checkpoint_every else None
        self.durable = durable

    @property
    def done(self) -> bool:
        return self.loop.round >= self.cfg.train.rounds

    def start(self, step: int | None) -> None:
        """Resume from checkpoint `step`, or (None) start at θ_0 and evaluate it."""
        if step is None or self.store is None:
            self.totals.initial_eval_loss = self.totals.final_eval_loss = self.evaluate(self.loop.params)
            self.rd.log("eval", step=0, eval_loss=self.totals.initial_eval_loss)
            return
        self.loop.state, meta = restore_state(self.store, step, self.loop.state)
        self.totals = Totals.from_meta(meta["totals"])
        self.durations = list(meta.get("durations", []))
        self.rd.truncate_after_round(self.loop.round)
        self.rd.log("resumed", round=self.loop.round, digest=tree_digest(self.loop.params))

    def latest_step(self) -> int | None:
        steps = self.store.steps() if self.store is not None else []
        return steps[-1] if steps else None

    def close_round(
        self, *, losses: Sequence[float], seconds: float, deliveries: int = 0, reason: str | None = None
    ) -> Commit:
        """Commit the open round, evaluate, log its `round` event and checkpoint it when due.

        `deliveries`: how many islands receive this update without a pull (simulate hands it to each island
        directly; the coordinator counts its downlink bytes per pull instead).
        """
        commit = self.loop.commit()
        t = self.totals
        t.rounds = self.loop.round
        t.syncs += 1
        t.bytes_down += sum(e.nbytes for e in commit.encoded) * deliveries
        t.final_eval_loss = self.evaluate(self.loop.params)
        self.durations = [*self.durations, seconds][-self.cfg.quorum.history :]
        self.rd.log(
            "round", round=commit.round, loss=float(np.mean(losses)) if len(losses) else None,
            eval_loss=t.final_eval_loss, tokens=t.tokens, bytes_up=t.bytes_up, bytes_down=t.bytes_down,
            islands=list(commit.islands), digest=commit.digest, seconds=round(seconds, 4),
            **({"reason": reason} if reason else {}),
        )  # fmt: skip
        # The event is logged before the save: a kill in between loses the event with the round (truncated on
        # resume, then rerun), never a committed round without its event.
        if self.store is not None and checkpoint_due(self.cfg, self.loop.round):
            meta = {"totals": t.to_meta(), "durations": self.durations}
            save_state(self.store, self.loop.round, self.loop.state, meta)
            if self.durable:
                self.store.wait()
        return commit

    def summary(self) -> dict:
        return summary(
            self.cfg, self.totals, wall_s=self.rd.elapsed(), param_count=self.param_count,
            params_digest=tree_digest(self.loop.params),
        )  # fmt: skip

    def close(self) -> None:
        if self.store is not None:
            self.store.close()


def checkpoint_due(cfg: RunConfig, completed_rounds: int) -> bool:
    """Every train.checkpoint_every rounds, and always after the last one."""
    every = cfg.train.checkpoint_every
    return every > 0 and (completed_rounds % every == 0 or completed_rounds >= cfg.train.rounds)
