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

import json
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc
import numpy as np

from diloco.config import RunConfig, config_digest, diff_keys, to_dict
from diloco.global_run import GlobalRun
from diloco.membership import REJOIN, Action, PullKind, PullView, RoundView, answer_pull, decide
from diloco.rounds import Commit, OuterLoop, RoundError
from diloco.rundir import RunDir
from diloco.setup import Setup
from diloco.summary import Totals
from islands.compress import decoded_tree
from transport import diloco_pb2 as pb
from transport.codecs import CodecSpec, EncodedTensor, encode_tree, flatten_named
from transport.digest import tree_digest
from transport.errors import Rejected
from transport.handler import PullPayload

FP32 = CodecSpec(kind="fp32")


class Coordinator:
    """Owns θ, the outer optimizer state, membership and the round. Thread-safe (one condition variable)."""

    def __init__(self, cfg: RunConfig, rd: RunDir, setup: Setup, clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self.rd = rd
        self.clock = clock
        self.names = cfg.islands.island_names
        self.digest = bytes.fromhex(config_digest(cfg))
        self.config_dict = to_dict(cfg)
        self.world = GlobalRun(cfg, rd, setup, durable=True)
        self.world.start(self.world.latest_step())
        self.model_spec = {name: (tuple(a.shape), "float32") for name, a in flatten_named(setup.init_params).items()}
        self.cond = threading.Condition()
        self.last_seen: dict[str, float] = {}
        self.last_loss: dict[str, float] = {}
        self.last_commit: Commit | None = None
        self.opened_at = clock()

    # -- lifecycle ---------------------------------------------------------------------------------------------

    @property
    def loop(self) -> OuterLoop:
        return self.world.loop

    @property
    def totals(self) -> Totals:
        return self.world.totals

    @property
    def run_id(self) -> str:
        return self.cfg.run.name

    @property
    def done(self) -> bool:
        return self.world.done

    def close(self) -> None:
        self.world.close()

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

    def push(self, meta: pb.PushMeta, tensors: Sequence[EncodedTensor], arrays: dict[str, np.ndarray]) -> pb.PushReply:
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
            answer = answer_pull(self._pull_view(req))
            if answer.kind is PullKind.WAIT:
                self.cond.wait_for(lambda: answer_pull(self._pull_view(req)).kind is not PullKind.WAIT,
                                   timeout=self.cfg.network.pull_wait_s)  # fmt: skip
                answer = answer_pull(self._pull_view(req))
            if answer.kind is PullKind.WAIT:  # ABORTED is retryable: the island asks again, keeping its lease
                raise Rejected(grpc.StatusCode.ABORTED, f"{answer.reason}; retry")
            if answer.kind in (PullKind.PUSH_FIRST, PullKind.RESYNC):
                raise Rejected(grpc.StatusCode.FAILED_PRECONDITION, f"island {req.island}: {answer.reason}")
            if answer.kind is PullKind.UPDATE:
                assert self.last_commit is not None
                tensors: Sequence[EncodedTensor] = self.last_commit.encoded
            else:
                tensors = encode_tree(flatten_named(self.loop.params), FP32)
            self.totals.bytes_down += sum(len(t.payload) for t in tensors)
            digest = bytes.fromhex(tree_digest(self.loop.params))
            return PullPayload(
                round=self.loop.round, fragment=0, kind=answer.kind.value, param_digest=digest, tensors=tensors
            )

    def _pull_view(self, req: pb.PullRequest) -> PullView:
        return PullView(
            have_round=req.have_round, full=req.full, round=self.loop.round, done=self.done,
            pushed=req.island in self.loop.pending,
            last_commit_round=self.last_commit.round if self.last_commit is not None else None,
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
            durations=self.world.durations,
        )
        decision = decide(now, view, self.cfg.quorum)
        for name in sorted(decision.lost):
            del self.last_seen[name]
            self.totals.islands_lost += 1
            self.rd.log("island_lost", round=self.loop.round, island=name, reason="lease expired")
        if decision.action is Action.CLOSE:
            losses = [self.last_loss[n] for n in self.loop.pending if n in self.last_loss]
            # The lock is held, so no pull sees θ_{r+1} before it is durable (GlobalRun with durable=True).
            seconds = now - self.opened_at
            self.last_commit = self.world.close_round(losses=losses, seconds=seconds, reason=decision.reason)
            self.opened_at = now
            self.cond.notify_all()

    # -- reporting ---------------------------------------------------------------------------------------------

    def summary(self) -> dict[str, Any]:
        """summary.json's contents (diloco/summary.py), the same keys as `simulate` writes."""
        return self.world.summary()

    def live_status(self) -> dict[str, Any]:
        """The summary so far plus who is alive and their last losses: `diloco status` and `launch`'s display."""
        return {**self.summary(), "islands_alive": sorted(self.last_seen), "last_losses": dict(self.last_loss)}
