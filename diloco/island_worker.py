"""One island as a process: join the coordinator, train H steps, push Δ, pull û, repeat (DiLoCo's inner loop).

    join      -> round r, and whether the island's own checkpoint is current (else it pulls the full θ_r)
    train     -> H inner AdamW steps from θ_r on this island's data shard (inner state kept across rounds)
    push      -> Δ = θ_r - θ_local, compressed with error feedback (the residual stays here)
    pull      -> û of round r (or the full θ when behind); θ_{r+1} = θ_r + û, checked against the
                 coordinator's digest: every island holds bit-identical parameters after every round
    checkpoint-> θ_{r+1}, inner optimizer state, residual and data cursor (orbax, one writer: this island)

While the coordinator is away every RPC is retried with backoff (tenacity, in transport) and this loop keeps its
state and asks again; a push refused because the round already closed (a slow island, or a coordinator that
restarted) is dropped and the island resyncs. A heartbeat thread renews the lease meanwhile.

This loop lives in diloco/ rather than islands/ because it reads the run config and the run directory, which
islands/ may not import; the engine it drives (Island, models, data, compression) is all islands/.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import jax
import numpy as np

from diloco.checkpoint import CheckpointStore, restore_state, save_state
from diloco.config import RunConfig, config_digest, require_whole_rounds, to_dict
from diloco.membership import REJOIN
from diloco.rundir import RunDir
from diloco.setup import build_setup, make_island
from islands.compress import decoded_tree
from islands.island import DivergedError, RoundPush
from outer_optimizer import apply_update
from transport import diloco_pb2 as pb
from transport.auth import TlsConfig
from transport.client import IslandClient
from transport.codecs import PyTree
from transport.digest import tree_digest
from transport.errors import TransportError, UserError
from transport.grpc_client import GrpcTransport
from transport.handler import PullPayload
from transport.shaper import LinkShaper, load_link_profiles, profile_for
from transport.tensors import decoder


class IslandError(UserError, ValueError):
    """A user mistake that stops an island (name not in the config, coordinator refuses the config...)."""


class CoordinatorAway(UserError, ConnectionError):
    """The coordinator did not answer for longer than the island is willing to wait."""


def _retry_forever(fn: Any, what: str, give_up_s: float) -> Any:
    """Call fn until it succeeds; retryable failures (coordinator away) are retried until give_up_s."""
    deadline = time.monotonic() + give_up_s
    delay = 0.5
    while True:
        try:
            return fn()
        except TransportError as exc:
            if not exc.retryable:
                raise
            if exc.code == grpc.StatusCode.ABORTED:  # the coordinator answered "not yet": it is not away
                deadline = time.monotonic() + give_up_s
            elif time.monotonic() > deadline:
                raise CoordinatorAway(f"{what}: coordinator did not answer for {give_up_s:.0f}s ({exc})") from None
            time.sleep(delay)
            delay = min(delay * 2, 5.0)


class IslandWorker:
    def __init__(self, cfg: RunConfig, name: str, client: IslandClient, rd: RunDir) -> None:
        if name not in cfg.islands.island_names:
            raise IslandError(
                f"island '{name}' is not in the config's islands.names ({', '.join(cfg.islands.island_names)})"
            )
        require_whole_rounds(cfg, "island")
        self.cfg, self.name, self.client, self.rd = cfg, name, client, rd
        self.give_up_s = cfg.network.coordinator_wait_s
        setup = build_setup(cfg, islands=[name])
        self.like = setup.init_params
        n_devices = min(cfg.islands.devices, len(jax.local_devices()))
        if n_devices < cfg.islands.devices:
            rd.log("devices_reduced", island=name, configured=cfg.islands.devices, available=n_devices)
        self.island = make_island(cfg, name, setup.model, setup.streams[name], n_devices)
        self.store = CheckpointStore(rd.checkpoints) if cfg.train.checkpoint_every else None
        self.round = -1
        self.global_params: PyTree = None
        self.global_digest = ""
        """Digest of global_params (θ_r): sent with every push, so the coordinator knows which θ Δ was taken from."""
        self.state_name = "starting"
        self._stop = threading.Event()
        self._decode = decoder()

    # -- coordinator RPCs --------------------------------------------------------------------------------------

    def _meta(self) -> dict[str, Any]:
        return {"run_id": self.cfg.run.name, "island": self.name}

    def _join_request(self, have_round: int) -> pb.JoinRequest:
        return pb.JoinRequest(
            **self._meta(),
            config_digest=bytes.fromhex(config_digest(self.cfg)),
            config_json=json.dumps(to_dict(self.cfg), sort_keys=True),
            last_round=have_round,
            devices=len(self.island.mesh.devices.flat),
        )

    def join(self, have_round: int) -> pb.JoinReply:
        req = self._join_request(have_round)
        first = self.global_params is None and self.round < 0
        wait = self.cfg.network.connect_timeout_s if first else self.give_up_s
        reply = _retry_forever(lambda: self.client.join(req), f"join {self.client.target}", wait)
        self.rd.log("joined", round=reply.round, island=self.name, state=reply.state)
        return reply

    def _heartbeats(self, lease_s: float) -> None:
        while not self._stop.wait(max(lease_s / 3, 0.2)):
            try:
                reply = self.client.heartbeat(
                    pb.HeartbeatRequest(**self._meta(), round=max(self.round, 0), step=self.island.state.step)
                )
                if reply.state == REJOIN:  # declared lost (we stalled): join again, keeping our own state
                    self.client.join(self._join_request(self.round))
                    self.rd.log("rejoined", round=reply.round, island=self.name)
                else:
                    self.state_name = reply.state
            except TransportError:
                pass  # the coordinator is away; the main loop's retries handle it

    def pull(self, have_round: int, full: bool = False) -> PullPayload:
        req = pb.PullRequest(**self._meta(), have_round=have_round, full=full)
        return _retry_forever(lambda: self.client.pull(req), "pull", self.give_up_s)

    def _params_from(self, payload: PullPayload) -> PyTree:
        arrays = {t.name: np.array(self._decode(t), np.float32) for t in payload.tensors}
        return decoded_tree(arrays, self.like)

    def adopt(self, payload: PullPayload) -> None:
        """Move to the payload's round: apply û to θ_r, or take the full θ; verify the digest."""
        if payload.kind == "update" and payload.round == self.round + 1 and self.global_params is not None:
            new = apply_update(self.global_params, self._params_from(payload))
        else:
            new = jax.tree.map(np.asarray, self._params_from(payload))
        digest = tree_digest(new)
        if digest != payload.param_digest.hex():
            if payload.kind == "update":  # should never happen; recover with the full parameters
                self.rd.log("digest_mismatch", round=payload.round, island=self.name, ours=digest)
                return self.adopt(self.pull(-1, full=True))
            raise IslandError(f"full parameters of round {payload.round} fail their digest check")
        self.global_params, self.global_digest = new, digest
        self.round = payload.round
        self.island.set_params(new)
        self.rd.log("synced", round=self.round, island=self.name, kind=payload.kind, digest=digest)

    def _push(self, meta: pb.PushMeta, push: RoundPush) -> bool:
        """Push Δ; False when the round closed without it (a slow island, a restarted coordinator): Δ is dropped."""
        try:
            _retry_forever(lambda: self.client.push(meta, push.sent.encoded), "push", self.give_up_s)
        except TransportError as exc:
            if exc.code not in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.ALREADY_EXISTS):
                raise
            self.rd.log("push_dropped", round=self.round, island=self.name, reason=exc.reason)
            return False
        self.rd.log("pushed", round=self.round, island=self.name, bytes_up=push.sent.payload_nbytes, loss=meta.loss)
        return True

    def _pull_after_push(self, meta: pb.PushMeta, push: RoundPush) -> PullPayload:
        """Wait for the round to close. A coordinator that restarted and lost our push says so: push again.

        When the push is refused too (the round closed meanwhile, or the coordinator restarted at an older
        round than ours), this Δ is of no use any more: resync with the full parameters of its round.
        """
        for _ in range(10):
            try:
                return self.pull(self.round)
            except TransportError as exc:
                if exc.code != grpc.StatusCode.FAILED_PRECONDITION:
                    raise
                self.rd.log("repush", round=self.round, island=self.name, reason=exc.reason)
                if not self._push(meta, push):
                    break
        return self.pull(-1, full=True)

    # -- checkpoints -------------------------------------------------------------------------------------------

    def save(self) -> None:
        """IslandState after adopting θ_r (so its params are the global ones) with the round it belongs to."""
        if self.store is not None:
            save_state(self.store, self.round, self.island.state, {"round": self.round})

    def restore(self) -> int:
        """Resume from this island's own checkpoint if it has one; returns its round (-1: none)."""
        steps = self.store.steps() if self.store else []
        self.island.start(self.like)
        if not steps:
            return -1
        assert self.store is not None and self.island.state is not None
        state, meta = restore_state(self.store, steps[-1], self.island.state)
        self.island.restore(state)
        self.global_params = jax.tree.map(np.asarray, state.params)
        self.global_digest = tree_digest(self.global_params)
        self.round = meta["round"]
        self.rd.log("resumed", round=self.round, island=self.name, step=state.step)
        return self.round

    # -- the loop ----------------------------------------------------------------------------------------------

    def run(self) -> int:
        """Train until the coordinator says the run is done; returns the rounds this island contributed to."""
        have = self.restore()
        reply = self.join(have)
        if reply.needs_full_params or self.global_params is None:
            self.round = -1
            self.adopt(self.pull(-1, full=True))
        heartbeat = threading.Thread(target=self._heartbeats, args=(reply.lease_s,), daemon=True)
        heartbeat.start()
        contributed = 0
        H = self.cfg.train.inner_steps
        try:
            # Compute utilization = inner-step seconds / wall seconds. Each push reports the wall time of its whole
            # cycle since the previous push (train, encode, push, the wait for the round to close, pull, checkpoint).
            cycle_from = time.perf_counter()
            steps_ended: float | None = None
            while self.round < self.cfg.train.rounds and self.state_name != "done":
                # sync_s: from the previous round's H-th inner step to now (encode, push, the wait for the round to
                # close, pull, checkpoint): the time the WAN and the coordinator cost this island (diloco bench sync).
                sync = {"sync_s": round(time.perf_counter() - steps_ended, 4)} if steps_ended is not None else {}
                self.rd.log("train_start", round=self.round, island=self.name, step=self.island.state.step, **sync)
                t_train = time.perf_counter()
                push = self.island.train_round(self.global_params, H, budget_s=self.cfg.train.round_seconds)
                run = push.run
                steps_ended = t_train + run.seconds
                self.rd.log_inner(self.round, self.name, run.first_step, run.losses, self.cfg.train.log_every)
                meta = pb.PushMeta(
                    **self._meta(), round=self.round, tokens=run.tokens, inner_steps=len(run.losses),
                    loss=float(run.losses[-1]),
                    compute_s=run.seconds, wall_s=time.perf_counter() - cycle_from,
                    base_digest=bytes.fromhex(self.global_digest),
                )  # fmt: skip
                cycle_from = time.perf_counter()
                if self._push(meta, push):
                    self.island.keep_residual(push)  # only an accepted push carries its residual (Island.keep_residual)
                    contributed += 1
                self.adopt(self._pull_after_push(meta, push))
                self.save()
        except DivergedError as exc:
            # Say so before dying, so a coordinator does not wait for this island until its lease runs out.
            self._leave(f"diverged: {exc}"[:200])
            raise
        finally:
            self._stop.set()
            if self.store is not None:
                self.store.close()
        self._leave("done")
        return contributed

    def _leave(self, reason: str) -> None:
        try:
            self.client.leave(pb.LeaveRequest(**self._meta(), reason=reason))
        except TransportError:
            pass


def make_client(cfg: RunConfig, name: str, target: str, secret: str | None) -> IslandClient:
    """The island's gRPC client: TLS (mutual with a client certificate) when network.tls_* says so."""
    from diloco.tls import client_tls

    shaper = None
    if cfg.network.links:
        shaper = LinkShaper(profile_for(load_link_profiles(cfg.network.links), name), seed=cfg.run.seed)
    net = cfg.network
    tls = client_tls(net.tls_ca, net.tls_cert, net.tls_key, net.tls_server_name)
    return GrpcTransport(target, name, secret, config=cfg.transport, shaper=shaper, tls=tls)


def say_gone(cfg: RunConfig, name: str, target: str, secret: str | None, tls: TlsConfig | None, why: str) -> None:
    """Tell the coordinator that island `name`'s worker is gone (its supervisor saw it die), so the others' round
    need not wait out its lease. One quick attempt: if the coordinator is away too, the lease does the same later."""
    config = replace(cfg.transport, max_attempts=1, rpc_timeout_s=min(cfg.transport.rpc_timeout_s, 3.0))
    try:
        with GrpcTransport(target, name, secret, config=config, tls=tls) as client:
            client.leave(pb.LeaveRequest(run_id=cfg.run.name, island=name, reason=why[:200]))
    except TransportError:
        pass


def run_island_process(cfg: RunConfig, name: str, target: str, run_dir: Path, secret: str | None) -> dict:
    rd = RunDir(run_dir, cfg)
    client = make_client(cfg, name, target, secret)
    try:
        worker = IslandWorker(cfg, name, client, rd)
        contributed = worker.run()
        return {"island": name, "rounds_contributed": contributed, "round": worker.round}
    finally:
        client.close()
        rd.close()
