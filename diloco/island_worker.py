"""One island as a process: join the coordinator, train H steps, push Δ, pull û, repeat (DiLoCo's inner loop).

    join      -> round r, and whether the island's own checkpoint is current (else it pulls the full θ_r)
    train     -> H inner AdamW steps from θ_r on this island's data shard (inner state kept across rounds)
    push      -> Δ = θ_r - θ_local, compressed with error feedback (the residual stays here)
    pull      -> û of round r (or the full θ when behind); θ_{r+1} = θ_r + û, checked against the
                 coordinator's digest: every island holds bit-identical parameters after every round
    checkpoint-> θ_{r+1}, inner optimizer state, residual and data cursor (orbax, one writer: this island)

With Streaming DiLoCo (`[stream]`) the same loop syncs one fragment at a time (outer_optimizer/fragments.py's
schedule, as `simulate` runs it): a fragment's push and the wait for its commit run on a wire thread while the
island keeps training, and the committed fragment is merged τ = stream.overlap_steps steps later; the digest
checked is that fragment's. Plain DiLoCo is the case P = 1, τ = 0.

While the coordinator is away every RPC is retried with backoff (tenacity, in transport) and this loop keeps its
state and asks again; a push refused because the round already closed (a slow island, or a coordinator that
restarted) is dropped and the island resyncs. A heartbeat thread renews the lease meanwhile.

This loop lives in diloco/ rather than islands/ because it reads the run config and the run directory, which
islands/ may not import; the engine it drives (Island, models, data, compression) is all islands/.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import grpc
import jax
import jax.numpy as jnp
import numpy as np

from diloco import RELEASE
from diloco.async_sim import async_order, planned_steps
from diloco.checkpoint import CheckpointStore, save_state
from diloco.config import RunConfig, config_digest, require_federated, to_dict
from diloco.island_group import ONE_PROCESS, Channel, Group, LeaderIsland, exit_code, join, restore_checkpoint
from diloco.membership import REJOIN
from diloco.metrics import IslandMetrics, metrics_port, serve_metrics
from diloco.rounds import fragment_digest, fragment_digests
from diloco.rundir import RunDir
from diloco.setup import build_setup, make_island
from diloco.warm_start import initial_inner_state
from islands.backend import initialize_backend
from islands.compress import decoded_tree
from islands.island import DivergedError, InnerRun, Island, RoundPush
from outer_optimizer import apply_update
from outer_optimizer.fragments import merging_fragment, next_event, syncing_fragment
from transport import diloco_pb2 as pb
from transport.auth import TlsConfig
from transport.client import NOT_A_MEMBER, IslandClient, Presence
from transport.codecs import PyTree, flatten_named, unflatten_named
from transport.digest import tree_digest
from transport.errors import TransportError, UserError
from transport.grpc_client import GrpcTransport
from transport.handler import PullPayload
from transport.shaper import LinkShaper, load_link_profiles, profile_for
from transport.tensors import decoder

STOP_GRACE_S = 10.0
"""How long a stop may take before the island exits wherever it is: a sync point normally comes within one run of
inner steps; a wait on an absent coordinator may never end."""
LEAVE_WAIT_S = 5.0
"""How long a stopping island waits for its last push to land and for its Leave: a stop must be prompt even when
the coordinator is stopping too."""
PRESENCE_RETRY_S = (0.2, 2.0)
"""The pause before the presence call is opened again after it ended, doubling from the first to the second while
calls keep ending at once (a coordinator restarting, or not yet counting us a member). The first is well inside
quorum.reconnect_grace_s, so a call broken by a blip is replaced before the coordinator counts the island lost."""


class IslandError(UserError, ValueError):
    """A user mistake that stops an island (name not in the config, coordinator refuses the config...)."""


class CoordinatorAway(UserError, ConnectionError):
    """The coordinator did not answer for longer than the island is willing to wait."""


def _retry_forever(fn: Any, what: str, give_up_s: float, on_retry: Callable[[], None] | None = None) -> Any:
    """Call fn until it succeeds; retryable failures (coordinator away) are retried until give_up_s, each such
    retry told to `on_retry` (the island's retries_total metric)."""
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
            elif on_retry is not None:
                on_retry()
            time.sleep(delay)
            delay = min(delay * 2, 5.0)


T = TypeVar("T")


def in_background(job: Callable[[], T], after: Future | None = None) -> Future[T]:
    """Run `job` on a daemon thread once `after` (the previous sync's job) has finished, so syncs reach the wire
    in order; a daemon, because one blocked on an absent coordinator must not keep a dying process alive."""
    out: Future[T] = Future()

    def work() -> None:
        if after is not None:
            after.exception()  # waits; its failure is its own caller's to see
        try:
            out.set_result(job())
        except BaseException as exc:  # handed to the caller, who re-raises it in the training thread
            out.set_exception(exc)

    threading.Thread(target=work, name="sync", daemon=True).start()
    return out


class Serial:
    """Jobs run one after the other on one daemon thread, in the order they were submitted: an island's encodes, or
    one fragment's pushes or commit waits (`IslandWorker.lanes`, `IslandWorker.pulls`). One long-lived thread rather
    than one per job: starting a thread waits until it is scheduled, which on shared cores cost a streaming island's
    training thread about 5 % of its time (py-spy); a daemon, because a push blocked on an absent coordinator must
    not keep a dying process alive."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]]] = queue.SimpleQueue()
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def submit(self, job: Callable[[], T]) -> Future[T]:
        out: Future[T] = Future()
        self._jobs.put((job, out))
        return out

    def _run(self) -> None:
        while True:
            job, out = self._jobs.get()
            try:
                out.set_result(job())
            except BaseException as exc:  # handed to whoever waits on it, as in_background does
                out.set_exception(exc)


def same_leaves(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """The same arrays under the same names: the same objects, not equal ones (cheap, and exact)."""
    return a.keys() == b.keys() and all(a[n] is b[n] for n in a)


@dataclass(frozen=True)
class Ready:
    """A streaming fragment's update applied off the training thread (`IslandWorker._ready`): the fragment's leaves
    of the global copy it was applied to (`base`) and the leaves it makes, which passed the commit's digest."""

    position: int
    """The sync position the global copy reaches with it."""
    base: dict[str, np.ndarray]
    leaves: dict[str, np.ndarray]
    on_mesh: dict[str, Any] | None = None
    """`leaves` placed on the island's mesh by the pull lane, ready for a merge with α = 0 (`Island.merge`); None
    with α > 0, or when the training thread redid the update (its merge places the leaves itself)."""


@dataclass(frozen=True)
class Synced:
    """One sync's outcome on the wire thread: was Δ accepted, what the pull after it brought, and (streaming) that
    update already applied to its fragment (None: the training thread applies it, or it was not an update)."""

    push: RoundPush
    accepted: bool
    payload: PullPayload
    ready: Ready | None = None


@dataclass
class SyncSpent:
    """The training thread's seconds off its inner steps since the last `train_start`, by cause (diloco bench sync
    reads them). Without overlap a sync is encode, then the wait (push, the round's close, pull), then the adopt;
    what remains of sync_s after them is the merge, the checkpoint copy and the loop itself."""

    encode_s: float = 0.0
    """Taking Δ and, without streaming, encoding it (streaming islands encode on the wire thread)."""
    waited_s: float = 0.0
    """Blocked on commits: what the overlap did not hide."""
    adopt_s: float = 0.0
    """Decoding the committed update, applying it to the global copy and checking its digest."""

    def fields(self) -> dict[str, float]:
        return {k: round(v, 4) for k, v in asdict(self).items()}


class IslandWorker:
    def __init__(self, cfg: RunConfig, name: str, client: IslandClient, rd: RunDir, group: Group = ONE_PROCESS) -> None:
        """`group`: this process's place in a multi-process island (diloco/island_group.py); the worker runs on its
        leader, process 0, and tells the other processes every call it makes on the island's engine."""
        if name not in cfg.islands.island_names:
            raise IslandError(
                f"island '{name}' is not in the config's islands.names ({', '.join(cfg.islands.island_names)})"
            )
        require_federated(cfg, "island")
        self.cfg, self.name, self.client, self.rd = cfg, name, client, rd
        self.metrics = IslandMetrics()
        """Prometheus metrics (diloco/metrics.py): fed by this island's events, its runs of inner steps, its retries."""
        rd.observers.append(self.metrics.on_event)
        self.give_up_s = cfg.network.coordinator_wait_s
        setup = build_setup(cfg, islands=[name])
        self.like = setup.init_params
        self.group = group
        # A multi-process island's mesh is every device of its processes (jax.distributed's global devices).
        n_devices = len(jax.devices()) if group.multiple else min(cfg.islands.devices, len(jax.local_devices()))
        if n_devices < cfg.islands.devices:
            rd.log("devices_reduced", island=name, configured=cfg.islands.devices, available=n_devices)
        self.asynchronous = cfg.train.mode == "async"
        # An asynchronous island's schedule spans the steps `simulate` would give it (diloco/async_sim.py).
        steps = (
            planned_steps(async_order(cfg), cfg.islands.island_names, cfg.train.inner_steps)[name]
            if self.asynchronous else None
        )  # fmt: skip
        island = make_island(cfg, name, setup.model, setup.streams[name], n_devices, total_steps=steps)
        self.island: Island | LeaderIsland = LeaderIsland(island, Channel()) if group.multiple else island
        self.store = CheckpointStore(rd.checkpoints) if cfg.train.checkpoint_every else None
        self.fragments = setup.fragments
        self.P, self.H = self.fragments.count, cfg.train.inner_steps
        self.position = -1
        """The sync position of the global copy (`OuterLoop.sync`: the round without streaming; -1: none yet)."""
        self.step = 0
        """Inner steps of the schedule (outer_optimizer/fragments.py); may run τ steps ahead of the global copy."""
        self.global_params: PyTree = None
        """This island's copy of the global θ at `position`: what Δ is taken from."""
        self.fragment_digests: list[str] = []
        """Each fragment's digest in the global copy: sent with its push, so the coordinator knows which θ Δ was
        taken from."""
        self._generation = 0
        """Bumped at every restart from the full θ: a sync queued before it is dropped unsent."""
        self.wire = Serial("wire")
        """Encodes (streaming), in sync order."""
        self.lanes = [Serial(f"push-{p}") for p in range(self.P)]
        """One push lane per fragment. Pushes of different fragments are on the wire together, as concurrent RPCs
        share one HTTP/2 connection: each pays the link's latency once, side by side. Pushed one after the other,
        P pushes a round paid P one-way latencies in a row (P 5 on wan3's 90 ms link: 0.6 s a round, more than the
        round's 10 steps of compute, so every island waited at its merges for the far one). A fragment's next
        push follows its merge, so a lane never holds more than one push of its own."""
        self.pulls = [Serial(f"pull-{p}") for p in range(self.P)]
        """One lane per fragment for the wait on its commits and the apply of each (`_collect`): like `lanes`, a
        long-lived thread rather than one started at every sync (that start cost the training thread a few per
        cent), and a fragment's commits are waited for in order."""
        self._last_push: dict[int, Future[bool | None]] = {}
        """Each lane's newest push: a stop gives them time to land (`_stop_syncs`)."""
        self.contributed = 0
        self._saving: Future[None] | None = None
        """The checkpoint save in flight (`save`)."""
        self.spent = SyncSpent()
        """Where the training thread's time between two runs of inner steps went (reported by train_start)."""
        self.state_name = "starting"
        self.stop_reason: str | None = None
        """Set by `request_stop` (SIGTERM, Ctrl+C): the island leaves at its next sync point."""
        self._stop = threading.Event()
        self._beat = threading.Event()
        """Set to send a heartbeat now (`_heartbeats`): after a plain commit is adopted, and at the stop."""
        self._decode = decoder()
        self._presence: Presence | None = None
        """The newest presence call (`_attend`), closed by `_end_presence`."""
        self._presence_lock = threading.Lock()
        self._left = threading.Event()
        """Set once the island has left (`_end_presence`): no presence call is opened again."""

    def request_stop(self, reason: str) -> None:
        """Leave the federation at the next sync point (between inner-step runs): no new push, the checkpoint
        flushed, a Leave so the coordinator does not wait out the lease. Sets a flag and arms a timer, so it is safe
        in a signal handler: an island blocked on an absent coordinator (retrying for network.coordinator_wait_s)
        never reaches a sync point, so after STOP_GRACE_S it exits anyway (`_stop_now`)."""
        if self.stop_reason is None:
            self.stop_reason = reason
            timer = threading.Timer(STOP_GRACE_S, self._stop_now)
            timer.daemon = True  # a stop that completes in time exits without waiting for it
            timer.start()

    def _stop_now(self) -> None:
        """The stop's grace ran out: exit at once (exit code 0: it was asked to stop). A checkpoint save cut short
        leaves the previous step restorable (diloco/checkpoint.py), so a restart resumes from there."""
        self.rd.log("stopped", round=self.round, island=self.name,
                    reason=f"{self.stop_reason} (forced after {STOP_GRACE_S:g} s: not at a sync point)")  # fmt: skip
        os._exit(0)

    @property
    def round(self) -> int:
        """The round of the global copy (-1: none)."""
        return self.position // self.P if self.position >= 0 else -1

    # -- coordinator RPCs --------------------------------------------------------------------------------------

    def _meta(self) -> dict[str, Any]:
        return {"run_id": self.cfg.run.name, "island": self.name}

    def _join_request(self, have_round: int) -> pb.JoinRequest:
        return pb.JoinRequest(
            **self._meta(),
            config_digest=bytes.fromhex(config_digest(self.cfg)),
            config_json=json.dumps(to_dict(self.cfg), sort_keys=True),
            release=RELEASE,
            last_round=have_round,
            devices=len(self.island.mesh.devices.flat),
        )

    def join(self, have_round: int) -> pb.JoinReply:
        req = self._join_request(have_round)
        first = self.global_params is None and self.round < 0
        wait = self.cfg.network.connect_timeout_s if first else self.give_up_s
        reply = _retry_forever(lambda: self.client.join(req), f"join {self.client.target}", wait, self.metrics.retried)
        self.rd.log("joined", round=reply.round, island=self.name, state=reply.state)
        return reply

    def _heartbeats(self, lease_s: float) -> None:
        """Renew the lease every third of it, and at once when `_beat` is set: an island that adopted a plain commit
        says so with its new round (the coordinator evaluates that commit only once its islands have moved on:
        docs/architecture.md, "Commits off the critical path")."""
        while True:
            self._beat.wait(max(lease_s / 3, 0.2))
            self._beat.clear()
            if self._stop.is_set():
                return
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

    def _attend(self) -> None:
        """Hold this island's presence call from its join to its Leave (transport/presence.py): if the process or its
        host dies, the coordinator sees the call break and counts the island lost within about a second, not a
        lease. A call that ends while the island runs (the coordinator restarted, the link blipped, the island was
        not yet a member: a heartbeat is sent at once, which joins again) is opened again after `PRESENCE_RETRY_S`."""
        pause = PRESENCE_RETRY_S[0]
        while True:
            with self._presence_lock:
                if self._left.is_set():
                    return
                self._presence = presence = self.client.attend(pb.AttendRequest(**self._meta()))
            opened = time.monotonic()
            if presence.wait() == NOT_A_MEMBER:
                self._beat.set()  # a heartbeat now learns the same and joins again (`_heartbeats`)
            held = time.monotonic() - opened
            pause = PRESENCE_RETRY_S[0] if held > PRESENCE_RETRY_S[1] else min(2 * pause, PRESENCE_RETRY_S[1])
            if self._left.wait(pause):
                return

    def _end_presence(self) -> None:
        """After the Leave: end the presence call (the coordinator sees it break, which the Leave made moot)."""
        with self._presence_lock:
            self._left.set()
            if self._presence is not None:
                self._presence.close()

    def pull(self, have: int, full: bool = False, after_push: bool = False) -> PullPayload:
        """The commit of sync position `have` (its round, and fragment when streaming), or the full θ (-1, `full`).
        `after_push`: this island's push for `have` has just gone out (`_collect`)."""
        round_, fragment = divmod(have, self.P) if have >= 0 else (-1, 0)
        req = pb.PullRequest(**self._meta(), have_round=round_, fragment=fragment, full=full, after_push=after_push)
        return _retry_forever(lambda: self.client.pull(req), "pull", self.give_up_s, self.metrics.retried)

    def _arrays_from(self, payload: PullPayload) -> dict[str, np.ndarray]:
        return {t.name: np.array(self._decode(t), np.float32) for t in payload.tensors}

    def _position_of(self, payload: PullPayload) -> int:
        return payload.round * self.P + payload.fragment

    def adopt(self, payload: PullPayload, ready: Ready | None = None) -> bool:
        """Move the global copy to the payload's position: apply the fragment's û (an update of the position the
        copy holds; `ready`: already applied on the wire thread) or take the full θ; verify the digest. True when it
        was an update (the caller merges that fragment into the local θ), False for the full θ (the caller restarts
        from it: `resync`)."""
        if payload.kind == "update":
            if self._apply_update(payload, ready):
                return True
            # should never happen; recover with the full parameters
            self.rd.log("digest_mismatch", round=payload.round, island=self.name, **self._fragment_field(
                payload.fragment))  # fmt: skip
            payload = self.pull(-1, full=True)
        new = jax.tree.map(np.asarray, decoded_tree(self._arrays_from(payload), self.like))
        digest = tree_digest(new)
        if digest != payload.param_digest.hex():
            raise IslandError(f"full parameters of round {payload.round} fail their digest check")
        self.global_params, self.position = new, self._position_of(payload)
        self.fragment_digests = fragment_digests(self.fragments, new, digest)
        self.rd.log("synced", round=self.round, island=self.name, kind=payload.kind, **self._where(None),
                    digest=digest)  # fmt: skip
        return False

    def _apply_update(self, payload: PullPayload, ready: Ready | None = None) -> bool:
        """θ_p += û_p on the global copy when the update is for the position it holds and its digest checks out.
        A `ready` one is taken as it is when it was applied to the leaves the copy holds now; else it is redone."""
        p = self.position % self.P
        if self.position < 0 or self._position_of(payload) != self.position + 1:
            return False
        theta = flatten_named(self.global_params)
        base = self.fragments.select(p, theta)
        if self.P > 1:
            if ready is None or ready.position != self.position + 1 or not same_leaves(ready.base, base):
                ready = self._ready(payload, base)
            if ready is None:
                return False
            new = unflatten_named({**theta, **ready.leaves}, self.like)
        else:  # plain rounds prove all of θ: its digest needs the whole new tree
            update = self._arrays_from(payload)
            if set(update) != set(base):
                return False
            new = unflatten_named({**theta, **apply_update(base, update)}, self.like)
            if fragment_digest(self.fragments, new, p) != payload.param_digest.hex():
                return False
        self.global_params, self.position = new, self.position + 1
        self.fragment_digests[p] = payload.param_digest.hex()
        self.rd.log("synced", round=self.round, island=self.name, kind="update", **self._where(p),
                    digest=payload.param_digest.hex())  # fmt: skip
        return True

    def _ready(self, payload: PullPayload, base: dict[str, np.ndarray] | None = None) -> Ready | None:
        """A streaming fragment's update (P > 1) applied to that fragment's leaves of the global copy (`base`, default
        the leaves it holds now) and proved by the commit's digest (the fragment's `fragment_digest`: its leaves by
        name); None when it is not such an update or fails. Pure in what it reads, so the wire thread runs it as soon
        as the pull lands (`_collect`): decoding, adding and hashing stay off the training thread, which at the merge
        only checks that the copy still holds `base` (a fragment's leaves change only by its own merges and by a
        restart from the full θ)."""
        position = self._position_of(payload)
        if self.P == 1 or payload.kind != "update" or self.global_params is None:
            return None
        if base is None:
            base = self.fragments.select((position - 1) % self.P, flatten_named(self.global_params))
        update = self._arrays_from(payload)
        if set(update) != set(base):
            return None
        # Host arrays, so that the copy's leaves stay these objects (flatten_named of a device array makes a new one).
        leaves = {name: np.asarray(v) for name, v in apply_update(base, update).items()}
        if tree_digest(leaves) != payload.param_digest.hex():
            return None
        return Ready(position, base, leaves)

    def resync(self, payload: PullPayload) -> None:
        """Restart from the coordinator's full θ (new, restarted, refused, or lagging)."""
        self.adopt(payload)
        self._restart_from_global()

    def _restart_from_global(self) -> None:
        """The local θ becomes the global copy and the schedule continues at its position."""
        self.island.set_params(self.global_params)
        self.step = self.round * self.H + (self.position % self.P) * (self.H // self.P)
        self._generation += 1  # syncs still in flight belong to the old schedule: their results are dropped

    def _fragment_field(self, p: int) -> dict[str, int]:
        return {"fragment": p} if self.P > 1 else {}

    def _where(self, p: int | None) -> dict[str, int]:
        """A `synced` event's place with streaming: the fragment it moved (an update) and the copy's sync position."""
        return {**({} if p is None else self._fragment_field(p)), "position": self.position} if self.P > 1 else {}

    def _push(
        self, meta: pb.PushMeta, push: RoundPush, on_sent: Callable[[], None] | None = None
    ) -> pb.PushReply | None:
        """Push Δ; None when the round closed without it (a slow island, a restarted coordinator) or (async) it was
        too stale: Δ is dropped. `on_sent`: told once the push's last chunk is on the wire (`_collect`)."""
        where = {"round": meta.round, "island": self.name, **self._fragment_field(meta.fragment)}
        t0 = time.perf_counter()
        try:
            reply = _retry_forever(lambda: self.client.push(meta, push.sent.encoded, on_sent), "push", self.give_up_s,
                                   self.metrics.retried)  # fmt: skip
        except TransportError as exc:
            if exc.code not in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.ALREADY_EXISTS):
                raise
            self.rd.log("push_dropped", **where, reason=exc.reason)
            return None
        self.rd.log("pushed", **where, bytes_up=push.sent.payload_nbytes, loss=meta.loss,
                    push_s=round(time.perf_counter() - t0, 4))  # fmt: skip
        return reply

    def _pull_after_push(self, sync: int, meta: pb.PushMeta, push: RoundPush) -> PullPayload:
        """Wait for sync `sync` (round, or round and fragment) to close. A coordinator that restarted and lost our
        push says so: push again.

        When the push is refused too (the sync closed meanwhile, or the coordinator restarted at an older round
        than ours), this Δ is of no use any more: resync with the full parameters.
        """
        for _ in range(10):
            try:
                return self.pull(sync)
            except TransportError as exc:
                if exc.code != grpc.StatusCode.FAILED_PRECONDITION:
                    raise
                self.rd.log("repush", round=meta.round, island=self.name, reason=exc.reason)
                if self._push(meta, push) is None:
                    break
        return self.pull(-1, full=True)

    def _pull_beside_push(self, sync: int) -> PullPayload | None:
        """The pull `_collect` sends while its push is still on the wire; None when the coordinator holds no push
        of ours for `sync` (it did not land, was refused, or a restarted coordinator lost it)."""
        try:
            return self.pull(sync, after_push=True)
        except TransportError as exc:
            if exc.code != grpc.StatusCode.FAILED_PRECONDITION:
                raise
            return None

    def _encoded(self, run: InnerRun, reference: dict[str, Any]) -> Future[RoundPush]:
        """Δ for the leaves `reference` names, encoded: with streaming on the wire thread, just before its push (the
        training thread goes on with the next fragment's steps meanwhile: Δ itself is taken now, before they
        replace θ); without, here. A plain round waits for its commit anyway, and a multi-process island's leader
        must make every engine call on this thread, where its followers hear of it in order
        (diloco/island_group.py)."""
        if self.P == 1:
            done: Future[RoundPush] = Future()
            done.set_result(self.island.encode_delta(run, reference))
            return done
        return self.wire.submit(self.island.take_delta(run, reference).encode)

    def _send(self, meta: pb.PushMeta, push: Future[RoundPush], generation: int, on_wire: Future[bool]) -> bool | None:
        """Push Δ (on its fragment's lane, once encoded); None when a resync made it stale first. `on_wire` says
        True once the push's last chunk is on the wire, False if the push is done with before (stale, or it failed):
        its pull waits for one or the other."""

        def settle(out: bool) -> None:
            with contextlib.suppress(InvalidStateError):  # told once: by the first attempt that got out, or here
                on_wire.set_result(out)

        try:
            if generation != self._generation:
                return None
            return self._push(meta, push.result(), partial(settle, True)) is not None
        finally:
            settle(False)

    def _collect(
        self,
        sync: int,
        meta: pb.PushMeta,
        pending: Future[RoundPush],
        sent: Future[bool | None],
        on_wire: Future[bool],
    ) -> Synced | None:
        """Wait for sync `sync`'s commit once its push went out (`run` merges the result when its turn comes).

        Each push leaves on its fragment's lane as soon as it is encoded, beside the other fragments' (`lanes`);
        the coordinator holds a push for a later fragment's sync until that sync opens (`Coordinator.early`), and
        the pulls wait for their commits side by side, so a sync's round trip never holds up the next fragment's
        push. The pull goes out as soon as the push is on the wire (`on_wire`), not once its reply is back: its
        request crosses the link beside the push's last bytes, which saves one round trip a sync (the push's
        reply comes back while the commit is made), and the coordinator holds it until the push has landed
        (`PullRequest.after_push`). Should the coordinator still hold no push of ours, the usual path decides once
        the push's reply is in (`_pull_after_push`: push again, or resync)."""
        early = self._pull_beside_push(sync) if on_wire.result() else None
        accepted = sent.result()
        if accepted is None:
            return None
        push = pending.result()
        payload = early if early is not None else self._pull_after_push(sync, meta, push)
        ready = self._ready(payload)
        if ready is not None and self.cfg.stream.merge_alpha == 0.0:  # the merge takes the leaves as they are
            ready = replace(ready, on_mesh=self.island.place(ready.leaves))
        return Synced(push, accepted, payload, ready)

    # -- checkpoints -------------------------------------------------------------------------------------------

    def save(self) -> None:
        """IslandState at a round boundary of the global copy, with the round it belongs to. Without streaming its
        params are the global ones; with streaming they mix fragments, so a resumed streaming island restarts from
        the full θ (it keeps its inner optimizer state, residual and data cursor).

        Saved on a background thread, one save after the other: orbax's blocking part (a few hundred ms on 2 cores)
        would otherwise stall the next round. The thread saves a device copy of this state; a kill
        mid-save leaves the previous step restorable (diloco/checkpoint.py)."""
        if self._saving is not None and self._saving.done():
            self._saving.result()  # a save that failed (disk full, permissions) stops the island here, with its error
        if self.store is not None and isinstance(self.island, LeaderIsland):
            self.island.save_checkpoint(self.store, self.round)  # in step with the followers (diloco/island_group.py)
        elif self.store is not None:
            # A copy: the next inner step donates the state's buffers to XLA (islands/inner.py), deleting them.
            store, state, round_ = self.store, jax.tree.map(jnp.copy, self.island.state), self.round
            self._saving = in_background(partial(save_state, store, round_, state, {"round": round_}), self._saving)

    def restore(self) -> int:
        """Resume from this island's own checkpoint if it has one; returns its round (-1: none)."""
        steps = self.store.steps() if self.store else []
        # Afresh, init.inner_state starts the inner optimizer from the source's (θ_0 comes by the first full pull).
        self.island.start(self.like, None if steps else initial_inner_state(self.cfg, self.island, self.like, self.rd))
        if not steps:
            return -1
        assert self.store is not None
        if isinstance(self.island, LeaderIsland):
            state, meta = self.island.restore_checkpoint(self.store, steps[-1])
        else:
            state, meta = restore_checkpoint(self.store, self.island, steps[-1])
        self.global_params = jax.tree.map(np.asarray, state.params)
        self.fragment_digests = fragment_digests(self.fragments, self.global_params, tree_digest(self.global_params))
        self.position = meta["round"] * self.P
        self.step = meta["round"] * self.H
        self.rd.log("resumed", round=self.round, island=self.name, step=state.step)
        return self.round

    # -- the loop ----------------------------------------------------------------------------------------------

    def run(self) -> int:
        """Train until the coordinator says the run is done; returns the syncs this island contributed to.

        The schedule is outer_optimizer/fragments.py's, as in `simulate`'s Lockstep: train to the next event; at a
        sync, Δ of that fragment goes to the wire thread (push, then wait for the commit) while training goes on;
        at its merge τ steps later the committed fragment is merged into the local θ. Plain DiLoCo is P = 1,
        τ = 0: H steps, push, wait, θ_{r+1}. See docs/architecture.md, "Streaming DiLoCo".
        """
        have = self.restore()
        reply = self.join(have)
        threading.Thread(target=self._attend, name="presence", daemon=True).start()
        if reply.needs_full_params or self.global_params is None:
            self.position = -1
            self.resync(self.pull(-1, full=True))
        heartbeat = threading.Thread(target=self._heartbeats, args=(reply.lease_s,), daemon=True)
        heartbeat.start()
        self.contributed = 0
        try:
            if self.asynchronous:
                self._run_async()
            else:
                self._run_rounds()
            if self.stop_reason is not None:
                self._stop_syncs()
        except DivergedError as exc:
            # Say so before dying, so a coordinator does not wait for this island until its lease runs out.
            self._leave(f"diverged: {exc}"[:200])
            self._end_presence()
            raise
        finally:
            self._stop.set()
            self._beat.set()
            if self._saving is not None:
                self._saving.exception()  # let the last save finish (an error of its own is raised below)
            if self.store is not None:
                self.store.close()
        if self._saving is not None:
            self._saving.result()
        if self.stop_reason is None:
            self._leave("done")
        else:  # the coordinator may be stopping too (launch stops every process at once): do not wait on it long
            self.rd.log("stopped", round=self.round, island=self.name, reason=self.stop_reason)
            in_background(partial(self._leave, f"stopped: {self.stop_reason}")).exception(timeout=LEAVE_WAIT_S)
        self._end_presence()
        return self.contributed

    def _stop_syncs(self) -> None:
        """On a stop: syncs not yet sent are dropped, a push already on the wire gets `LEAVE_WAIT_S` to land (a
        push after the Leave would make the coordinator count the island alive again)."""
        self._generation += 1
        deadline = time.monotonic() + LEAVE_WAIT_S
        for push in self._last_push.values():
            with contextlib.suppress(TimeoutError):
                push.exception(timeout=max(0.0, deadline - time.monotonic()))

    def _run_rounds(self) -> None:
        """Plain or streaming rounds until the coordinator says the run is done (`run`)."""
        stream, stride = self.cfg.stream, self.H // self.P
        total = self.cfg.train.rounds * self.P
        in_flight: deque[tuple[int, Future[Synced | None]]] = deque()
        # Compute utilization = inner-step seconds / wall seconds. Each push reports the wall time since the
        # previous push (train, encode, and whatever waiting for commits the overlap did not hide).
        cycle_from = time.perf_counter()
        steps_ended: float | None = None
        runs: list[InnerRun] = []
        while self.state_name != "done" and self.stop_reason is None:
            if self.step // stride >= total:  # every sync pushed: collect the last commits, then stop
                if not in_flight:
                    break
                if self._merge(in_flight.popleft()[1]):
                    in_flight.clear()
                continue
            if self.step % self.H == 0:
                self._log_train_start(self.step // self.H, steps_ended)
            target = next_event(self.step, self.H, self.P, stream.overlap_steps)
            run = self.island.train_for(self.cfg.train.round_seconds, target - self.step)
            self.metrics.trained(run)
            steps_ended = time.perf_counter()
            self.rd.log_inner(self.step // self.H, self.name, run.first_step, run.losses, self.cfg.train.log_every)
            runs.append(run)
            self.step = target
            p = syncing_fragment(self.step, self.H, self.P)
            if p is not None:
                sync_at = self.step // stride - 1
                joined = InnerRun.joined(runs)
                runs = []
                t0 = time.perf_counter()
                push = self._encoded(joined, self.fragments.select(p, flatten_named(self.global_params)))
                self.spent.encode_s += time.perf_counter() - t0
                meta = self._push_meta(sync_at // self.P, p, joined, cycle_from)
                cycle_from = time.perf_counter()
                on_wire: Future[bool] = Future()
                sent = self.lanes[p].submit(partial(self._send, meta, push, self._generation, on_wire))
                self._last_push[p] = sent
                collect = partial(self._collect, sync_at, meta, push, sent, on_wire)
                in_flight.append((p, self.pulls[p].submit(collect)))
            q = merging_fragment(self.step, self.H, self.P, stream.overlap_steps)
            if q is not None and in_flight and in_flight[0][0] == q and self._merge(in_flight.popleft()[1]):
                in_flight.clear()

    def _run_async(self) -> None:
        """Asynchronous updates (train.mode = "async"; docs/architecture.md, "Asynchronous rounds"): H steps from
        the global copy θ_b, push Δ naming b, and the coordinator applies it at once as update u; then pull the
        updates b .. u (each proved by its digest), restart from θ_{u+1} and go on. No island waits for another.

        A push refused (too stale, or the run is complete) loses its H steps: the island restarts from the full
        θ. The run ends for this island once its copy reaches θ_rounds."""
        cycle_from, steps_ended = time.perf_counter(), None
        while self.round < self.cfg.train.rounds and self.stop_reason is None:
            self._log_train_start(self.round, steps_ended)
            run = self.island.train(self.H)
            self.metrics.trained(run)
            steps_ended = time.perf_counter()
            self.rd.log_inner(self.round, self.name, run.first_step, run.losses, self.cfg.train.log_every)
            push = self.island.encode_delta(run, flatten_named(self.global_params))
            meta = self._push_meta(self.round, 0, run, cycle_from)
            cycle_from = time.perf_counter()
            t0 = time.perf_counter()
            reply = self._push(meta, push)
            if reply is not None:
                self.island.keep_residual(push)
                self.contributed += 1
            self._catch_up(reply.round + 1 if reply is not None else None)
            self._restart_from_global()
            self.spent.waited_s += time.perf_counter() - t0
            self.save()

    def _catch_up(self, position: int | None) -> None:
        """Move the global copy to `position` by pulling the updates it missed, one at a time, each proved by its
        digest; or (None, or when the coordinator no longer keeps one, or restarted) take the full θ."""
        if position is not None:
            try:
                while self.position < position:
                    if not self.adopt(self.pull(self.position)):
                        return  # a full θ came instead: the update fell out of the coordinator's window
                return
            except TransportError as exc:  # the coordinator restarted, or undid the update: it holds another θ
                if exc.code != grpc.StatusCode.FAILED_PRECONDITION:
                    raise
                self.rd.log("resync", round=self.round, island=self.name, reason=exc.reason)
        self.adopt(self.pull(-1, full=True))

    def _push_meta(self, round_: int, fragment: int, run: InnerRun, cycle_from: float) -> pb.PushMeta:
        """What a push says about itself: where Δ was taken from (its round, or with async the update b, and the
        fragment's digest in the global copy), its token weight, loss and time."""
        return pb.PushMeta(
            **self._meta(), round=round_, fragment=fragment, tokens=run.tokens, inner_steps=len(run.losses),
            loss=float(run.losses[-1]), compute_s=run.seconds, wall_s=time.perf_counter() - cycle_from,
            base_digest=bytes.fromhex(self.fragment_digests[fragment]),
        )  # fmt: skip

    def _log_train_start(self, round_: int, steps_ended: float | None) -> None:
        """sync_s: from the end of the last inner step to now (at a round boundary without overlap: encode, push,
        the wait for the round to close, pull, checkpoint; diloco bench sync), and where the training thread's time
        went since the last `train_start` (`SyncSpent`)."""
        sync = {"sync_s": round(time.perf_counter() - steps_ended, 4)} if steps_ended is not None else {}
        self.rd.log("train_start", round=round_, island=self.name, step=self.island.state.step,
                    **self.spent.fields(), **sync)  # fmt: skip
        self.spent = SyncSpent()

    def _merge(self, job: Future[Synced | None]) -> bool:
        """Take a sync's result: keep the residual of an accepted push, move the global copy, merge the fragment
        into the local θ (θ_p <- α·θ_p,local + (1 - α)·θ_p,global), or restart from the full θ; checkpoint at the
        global copy's round boundaries. True when it restarted (the syncs still in flight are then stale)."""
        t0 = time.perf_counter()
        done = job.result()
        t1 = time.perf_counter()
        self.spent.waited_s += t1 - t0
        if done is None:
            return False
        if done.accepted:
            self.island.keep_residual(done.push)  # only an accepted push carries its residual (Island.keep_residual)
            self.contributed += 1
        restarted = not self.adopt(done.payload, done.ready)
        self.spent.adopt_s += time.perf_counter() - t1
        if self.P == 1:
            self._beat.set()  # back to training on the next round: the coordinator may evaluate the commit now
        if restarted:
            self._restart_from_global()
        else:
            p = (self.position - 1) % self.P
            global_fragment = self.fragments.select(p, flatten_named(self.global_params))
            ready = done.ready  # placed already, if the copy took its leaves (else `adopt` redid them)
            on_mesh = ready.on_mesh if ready is not None and same_leaves(ready.leaves, global_fragment) else None
            self.island.merge(global_fragment, self.cfg.stream.merge_alpha, on_mesh)
        if self.position % self.P == 0:
            self.save()
        return restarted

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


def run_island_process(
    cfg: RunConfig,
    name: str,
    target: str,
    run_dir: Path,
    secret: str | None,
    metrics_port_flag: int | None = None,
    group: Group = ONE_PROCESS,
) -> dict:
    """`diloco island --no-supervise`: one worker until the run is done, or SIGTERM / Ctrl+C stops it cleanly
    (`IslandWorker.request_stop`; exit code 0: a stopped island is not restarted by its supervisor). With a metrics
    port (diloco/metrics.py: network.metrics_port + 1 + the island's index, or `metrics_port_flag`) the worker serves
    /metrics on network.metrics_host. In a multi-process island (`group`) this is its leader, process 0: it joins
    the island's JAX program first and, however it ends, tells the other processes to stop with its exit code."""
    initialize_backend(cfg.islands.backend)  # before anything asks JAX for a device (islands/backend.py)
    port = metrics_port(cfg, name, metrics_port_flag) if name in cfg.islands.island_names else 0
    rd = RunDir(run_dir, cfg)
    client = make_client(cfg, name, target, secret)
    metrics_server = None
    worker: IslandWorker | None = None
    ended: BaseException | None = None
    try:
        if group.multiple:
            join(group)
        worker = IslandWorker(cfg, name, client, rd, group)
        metrics_server = serve_metrics(worker.metrics.registry, cfg.network.metrics_host, port)

        def stop(signum: int, frame: object) -> None:
            worker.request_stop(signal.Signals(signum).name)

        for s in (signal.SIGTERM, signal.SIGINT):
            signal.signal(s, stop)
        contributed = worker.run()
        stopped = {"stopped": worker.stop_reason} if worker.stop_reason else {}
        return {"island": name, "rounds_contributed": contributed, "round": worker.round, **stopped}
    except BaseException as exc:
        ended = exc
        raise
    finally:
        if worker is not None and isinstance(worker.island, LeaderIsland):
            worker.island.stop(exit_code(ended))
        if metrics_server is not None:
            metrics_server.stop()
        client.close()
        rd.close()
