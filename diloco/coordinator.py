"""The global coordinator: the only owner of `GlobalState`, membership, and the open round.

It implements `transport.handler.CoordinatorHandler`, so the same object serves islands over gRPC (`diloco
coordinator`, `diloco launch`) or in-process. Every decision about closing a round or dropping an island comes from
the pure `membership.decide`; this class only applies it:

  push   -> a validated pseudo-gradient joins the open round (the transport already checked credentials, run id,
            round, names, shapes, dtypes, finiteness and digest; nothing unchecked reaches θ)
  tick   -> leases expire, the adaptive deadline passes, or everyone has pushed: the round closes
  close  -> token-weighted mean (islands in name order), outer step, û = decode(encode(u + e)), θ += û,
            evaluate, checkpoint (orbax, atomic, finished before any island can see θ_{r+1}), notify pulls
  pull   -> the committed û of the last round (island one round behind) or the full θ (new, restarted, lagging)

A coordinator killed at any moment restarts from its last checkpoint: the round in flight is lost, islands that
pushed into it push again after resyncing, and nothing half-applied ever existed.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np

from diloco.checkpoint import CheckpointStore
from diloco.config import RunConfig, config_digest, diff_keys, to_dict
from diloco.membership import REJOIN, Action, RoundView, decide
from diloco.rounds import Commit, GlobalState, OuterLoop, RoundError
from diloco.rundir import RunDir
from diloco.simulate import Evaluator, Setup
from islands.compress import decoded_tree, is_lossless
from transport import diloco_pb2 as pb
from transport.codecs import CodecSpec, encode_tree, flatten_named
from transport.digest import tree_digest
from transport.errors import Rejected
from transport.handler import PullPayload
from transport.tensors import EncodedTensorLike

PyTree = Any
FP32 = CodecSpec(kind="fp32")


@dataclass
class Totals:
    """Run totals that survive a coordinator restart (stored in the checkpoint's metadata)."""

    tokens: int = 0
    bytes_up: int = 0
    bytes_down: int = 0
    compute_s: float = 0.0
    island_wall_s: float = 0.0
    islands_joined: int = 0
    islands_lost: int = 0
    rejected: int = 0
    initial_eval_loss: float | None = None
    final_eval_loss: float | None = None
    durations: list[float] = field(default_factory=list)


class Coordinator:
    """Owns θ, the outer optimizer state, membership and the round. Thread-safe (one condition variable)."""

    def __init__(self, cfg: RunConfig, rd: RunDir, setup: Setup, clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self.rd = rd
        self.clock = clock
        self.names = cfg.islands.island_names
        self.digest = bytes.fromhex(config_digest(cfg))
        self.config_dict = to_dict(cfg)
        self.loop = OuterLoop.fresh(setup.init_params, cfg.outer.build(), cfg.codec.spec("downlink"))
        self.model_spec = {name: (tuple(a.shape), "float32") for name, a in flatten_named(setup.init_params).items()}
        self.evaluate = Evaluator(setup.model, setup.eval_stack)
        self.totals = Totals()
        self.cond = threading.Condition()
        self.last_seen: dict[str, float] = {}
        self.last_loss: dict[str, float] = {}
        self.last_commit: Commit | None = None
        self.store = CheckpointStore(rd.checkpoints / "coordinator") if cfg.train.checkpoint_every else None
        self._restore_or_start()
        self.opened_at = clock()

    # -- lifecycle ---------------------------------------------------------------------------------------------

    @property
    def run_id(self) -> str:
        return self.cfg.run.name

    @property
    def done(self) -> bool:
        return self.loop.round >= self.cfg.train.rounds

    def _restore_or_start(self) -> None:
        steps = self.store.steps() if self.store else []
        if not steps:
            self.totals.initial_eval_loss = self.totals.final_eval_loss = self.evaluate(self.loop.params)
            self.rd.log("eval", step=0, eval_loss=self.totals.initial_eval_loss)
            return
        like: dict[str, Any] = {"params": self.loop.params, "outer": self.loop.state.outer_opt_state}
        if not is_lossless(self.loop.downlink):
            like["down_residual"] = {k: np.zeros(s, np.float32) for k, (s, _) in self.model_spec.items()}
        state, meta = self.store.restore(steps[-1], like)  # type: ignore[union-attr]
        self.loop.state = GlobalState(
            params=state["params"],
            outer_opt_state=state["outer"],
            down_residual=state.get("down_residual"),
            round=meta["round"],
        )
        self.totals = Totals(**meta["totals"])
        self.rd.truncate_after_round(self.loop.round)
        self.rd.log("resumed", round=self.loop.round, digest=tree_digest(self.loop.params))

    def close(self) -> None:
        if self.store is not None:
            self.store.close()

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
        if bytes(req.config_digest) != self.digest:
            raise Rejected(grpc.StatusCode.FAILED_PRECONDITION, self._config_mismatch(req))
        with self.cond:
            now = self.clock()
            if req.island not in self.last_seen:
                self.totals.islands_joined += 1
                self.rd.log("island_joined", round=self.loop.round, island=req.island, devices=req.devices)
            self.last_seen[req.island] = now
            return pb.JoinReply(
                run_id=self.run_id,
                round=self.loop.round,
                lease_s=self.cfg.quorum.lease_s,
                needs_full_params=req.last_round != self.loop.round,
                state=self._state_name(),
            )

    def _config_mismatch(self, req: pb.JoinRequest) -> str:
        theirs = getattr(req, "config_json", "")
        try:
            keys = diff_keys(self.config_dict, json.loads(theirs)) if theirs else []
        except (json.JSONDecodeError, AttributeError):
            keys = []
        named = f" in: {', '.join(keys[:10])}" if keys else ""
        return f"island {req.island}'s config differs from the coordinator's{named}; start both from one config"

    def heartbeat(self, req: pb.HeartbeatRequest) -> pb.HeartbeatReply:
        with self.cond:
            if req.island not in self.last_seen and not self.done:
                # Its lease expired (a stall, a partition): not an attack, so no `rejected` event; it joins again.
                return pb.HeartbeatReply(round=self.loop.round, lease_s=self.cfg.quorum.lease_s, state=REJOIN)
            self.last_seen[req.island] = self.clock()
            return pb.HeartbeatReply(round=self.loop.round, lease_s=self.cfg.quorum.lease_s, state=self._state_name())

    def leave(self, req: pb.LeaveRequest) -> pb.LeaveReply:
        with self.cond:
            if self.last_seen.pop(req.island, None) is not None:
                self.rd.log("island_left", round=self.loop.round, island=req.island, reason=req.reason)
            self._tick_locked()
        return pb.LeaveReply(ok=True)

    def current_round(self, fragment: int) -> int:
        return self.loop.round

    def push(
        self, meta: pb.PushMeta, tensors: Sequence[EncodedTensorLike], arrays: dict[str, np.ndarray]
    ) -> pb.PushReply:
        with self.cond:
            if self.done:
                raise Rejected(grpc.StatusCode.FAILED_PRECONDITION, "the run is complete")
            if meta.round != self.loop.round:  # the round may have closed while this push streamed in
                raise Rejected(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"pseudo-gradient for round {meta.round} but round {self.loop.round} is open",
                )
            tree = decoded_tree({k: np.array(v, np.float32) for k, v in arrays.items()}, self.loop.params)
            try:
                self.loop.submit(meta.island, meta.round, tree, int(meta.tokens))
            except RoundError as exc:
                raise Rejected(grpc.StatusCode.ALREADY_EXISTS, str(exc)) from None
            nbytes = sum(len(t.payload) for t in tensors)
            self.last_seen[meta.island] = self.clock()
            self.totals.tokens += int(meta.tokens)
            self.totals.bytes_up += nbytes
            self.totals.compute_s += float(meta.compute_s)
            self.totals.island_wall_s += float(meta.wall_s)
            self.last_loss[meta.island] = float(meta.loss)
            self.rd.log(
                "push", round=meta.round, island=meta.island, tokens=int(meta.tokens), bytes_up=nbytes,
                loss=float(meta.loss),
            )  # fmt: skip
            self._tick_locked()
            return pb.PushReply(accepted=True, round=self.loop.round, detail="accepted")

    def pull(self, req: pb.PullRequest) -> PullPayload:
        with self.cond:
            if not req.full and req.have_round > self.loop.round:
                # Only possible when this coordinator restarted from a checkpoint older than what it had sent
                # (train.checkpoint_every > 1): waiting would deadlock (the island never pushes for our round).
                raise Rejected(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"island {req.island} is at round {req.have_round} but the coordinator restarted at round "
                    f"{self.loop.round}; pull the full parameters",
                )
            if not req.full and req.have_round >= self.loop.round and not self.done:
                if req.have_round == self.loop.round and req.island not in self.loop.pending:
                    # e.g. this coordinator restarted and lost the round in flight: the island must push again
                    raise Rejected(
                        grpc.StatusCode.FAILED_PRECONDITION,
                        f"round {self.loop.round} has no pseudo-gradient from island {req.island}; push it first",
                    )
                self.cond.wait_for(
                    lambda: req.have_round < self.loop.round or self.done, timeout=self.cfg.network.pull_wait_s
                )
                if req.have_round >= self.loop.round and not self.done:
                    # ABORTED is retryable: the island backs off and asks again while it keeps its lease.
                    raise Rejected(grpc.StatusCode.ABORTED, f"round {self.loop.round} is still open; retry")
            digest = bytes.fromhex(tree_digest(self.loop.params))
            commit = self.last_commit
            if not req.full and commit is not None and req.have_round == commit.round == self.loop.round - 1:
                kind, tensors = "update", commit.encoded
            else:
                kind, tensors = "full", encode_tree(flatten_named(self.loop.params), FP32)
            self.totals.bytes_down += sum(len(t.payload) for t in tensors)
            return PullPayload(round=self.loop.round, fragment=0, kind=kind, param_digest=digest, tensors=tensors)

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
                detail_json=json.dumps(self.summary(partial=True)),
            )

    def on_rejected(self, island: str, reason: str) -> None:
        if reason.startswith(f"{grpc.StatusCode.ABORTED.name}:"):
            return  # "the round is still open, ask again" answers a pull; it refuses nothing
        with self.cond:
            self.totals.rejected += 1
            self.rd.log("rejected", round=self.loop.round, island=island, reason=reason)

    # -- rounds ------------------------------------------------------------------------------------------------

    def tick(self) -> None:
        with self.cond:
            self._tick_locked()

    def _tick_locked(self) -> None:
        if self.done:
            return
        now = self.clock()
        view = RoundView(
            opened_at=self.opened_at,
            last_seen=dict(self.last_seen),
            pushed=frozenset(self.loop.pending),
            durations=self.totals.durations,
        )
        decision = decide(now, view, self.cfg.quorum)
        for name in sorted(decision.lost):
            del self.last_seen[name]
            self.totals.islands_lost += 1
            self.rd.log("island_lost", round=self.loop.round, island=name, reason="lease expired")
        if decision.action is Action.CLOSE:
            self._close_locked(now, decision.reason)

    def _close_locked(self, now: float, reason: str) -> None:
        commit = self.loop.commit()
        self.last_commit = commit
        seconds = now - self.opened_at
        self.totals.durations = [*self.totals.durations, seconds][-self.cfg.quorum.history :]
        self.opened_at = now
        eval_loss = self.evaluate(self.loop.params)
        self.totals.final_eval_loss = eval_loss
        losses = [self.last_loss[n] for n in commit.islands if n in self.last_loss]
        self.rd.log(
            "round", round=commit.round, loss=float(np.mean(losses)) if losses else None, eval_loss=eval_loss,
            tokens=self.totals.tokens, bytes_up=self.totals.bytes_up, bytes_down=self.totals.bytes_down,
            islands=list(commit.islands), digest=commit.digest, seconds=round(seconds, 4), reason=reason,
        )  # fmt: skip
        every = self.cfg.train.checkpoint_every
        if self.store is not None and (self.loop.round % every == 0 or self.done):
            saved: dict[str, Any] = {"params": self.loop.params, "outer": self.loop.state.outer_opt_state}
            if self.loop.state.down_residual is not None:
                saved["down_residual"] = self.loop.state.down_residual
            self.store.save(self.loop.round, saved, {"round": self.loop.round, "totals": self.totals.__dict__})
            # Durable before visible: no island may hold θ_{r+1} that a restarted coordinator does not have.
            # (The lock is held, so no pull sees the new round before this returns.) The round event is
            # logged before the save, so a kill in between loses the event with the round (truncated on
            # resume, then rerun), never a committed round without its event.
            self.store.wait()
        self.cond.notify_all()

    # -- reporting ---------------------------------------------------------------------------------------------

    def summary(self, partial: bool = False) -> dict[str, Any]:
        t = self.totals
        return {
            "mode": "diloco",
            "rounds": self.loop.round,
            "rounds_planned": self.cfg.train.rounds,
            "final_eval_loss": t.final_eval_loss,
            "initial_eval_loss": t.initial_eval_loss,
            "tokens": t.tokens,
            "bytes_up": t.bytes_up,
            "bytes_down": t.bytes_down,
            "wall_s": round(self.rd.elapsed(), 3),
            "compute_utilization": round(t.compute_s / t.island_wall_s, 4) if t.island_wall_s > 0 else 0.0,
            "islands_lost": t.islands_lost,
            "islands_joined": t.islands_joined,
            "rejected": t.rejected,
            "islands_alive": sorted(self.last_seen),
            "last_losses": dict(self.last_loss),
            "params_digest": tree_digest(self.loop.params),
            **({} if partial else {"syncs": self.loop.round}),
        }
