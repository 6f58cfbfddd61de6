"""One island as a process: join the coordinator, train H steps, push Δ, pull û, repeat (DiLoCo's inner loop).

    join      -> round r, and whether the island's own checkpoint is current (else it pulls the full θ_r)
    train     -> H inner AdamW steps from θ_r on this island's data shard (inner state kept across rounds)
    push      -> Δ = θ_r - θ_local, compressed with error feedback (the residual stays here)
    pull      -> û of round r (or the full θ when behind); θ_{r+1} = θ_r + û, checked against the
                 coordinator's digest: every island holds bit-identical parameters after every round
    checkpoint-> θ_{r+1}, inner optimizer state, residual and data cursor (orbax, one writer: this island)

With Streaming DiLoCo (`[stream]`) the same loop syncs one fragment at a time (outer_optimizer/fragments.py's
schedule, as `simulate` runs it): a fragment's push and the wait for its commit run on wire threads while the
island keeps training, and the committed fragment is merged τ = stream.overlap_steps steps later; the digest
checked is that fragment's. Plain DiLoCo is the case P = 1, τ = 0.

`IslandWorker` is the loop, and wires the island's parts together:

    Island                  the engine: inner steps, Δ, merges (islands/island.py)
    GlobalCopy              the island's copy of the global θ, a value moved by commits (diloco/worker/global_copy.py)
    IslandSync              pushes and pulls, on lanes off the training thread (diloco/worker/island_sync.py)
    IslandPresence          heartbeats and the presence call (diloco/worker/island_presence.py)
    IslandCheckpoints       the island's own checkpoints (diloco/worker/island_checkpoints.py)

While the coordinator is away every RPC is retried with backoff (tenacity, in transport) and this loop keeps its
state and asks again; a push refused because the round already closed (a slow island, or a coordinator that
restarted) is dropped and the island resyncs. A heartbeat thread renews the lease meanwhile.

This loop lives in diloco/ rather than islands/ because it reads the run config and the run directory, which
islands/ may not import; the engine it drives (Island, models, data, compression) is all islands/.
"""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import Future
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import grpc
import jax

from diloco import RELEASE, faults
from diloco.config import RunConfig, config_digest, require_federated, to_dict
from diloco.ops.metrics import IslandMetrics, metrics_port, serve_metrics
from diloco.run.checkpoint import CheckpointStore
from diloco.run.rundir import RunDir, RunDirLock
from diloco.run.setup import build_setup, make_island
from diloco.run.warm_start import initial_inner_state
from diloco.simulator.async_sim import async_order, planned_steps
from diloco.worker.global_copy import GlobalCopy, Ready, rolled_back, same_leaves
from diloco.worker.island_checkpoints import IslandCheckpoints
from diloco.worker.island_formation import FormationFiles, Lead
from diloco.worker.island_group import ONE_PROCESS, Channel, Group, LeaderIsland, exit_code, join
from diloco.worker.island_presence import IslandPresence
from diloco.worker.island_sync import IslandSync, Serial, Synced, retry_forever
from diloco.worker.stop_grace import StopGrace
from diloco.worker.supervisor import REGROUP
from floor.errors import UserError
from islands.backend import initialize_backend
from islands.chunks import ChunkStream, Span
from islands.island import DivergedError, InnerRun, Island, RoundPush
from outer_optimizer.fragments import merging_fragment, next_event, syncing_fragment
from pytrees.naming import PyTree, flatten_named, shapes_of
from transport import diloco_pb2 as pb
from transport.auth import TlsConfig, call_metadata, is_island_name
from transport.client import IslandClient
from transport.errors import TransportError
from transport.grpc_client import GrpcTransport, OperatorClient
from transport.handler import PullPayload
from transport.shaper import LinkShaper, load_link_profiles, profile_for

log = logging.getLogger(__name__)

STOP_GRACE_S = 10.0
"""How long a stop may take before the island exits wherever it is: a sync point normally comes within one run of
inner steps; a wait on an absent coordinator may never end."""
LEAVE_WAIT_S = 5.0
"""How long a stopping island waits for its last push to land and for its Leave: a stop must be prompt even when
the coordinator is stopping too."""


class IslandError(UserError, ValueError):
    """A user mistake that stops an island (name not in the config, coordinator refuses the config...)."""


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
        """`group`: this process's place in a multi-process island (diloco/worker/island_group.py); the worker runs on
        its leader, process 0, and tells the other processes every call it makes on the island's engine."""
        if not is_island_name(name):
            raise IslandError(f"island name {name[:64]!r} must be 1 to 64 characters of [A-Za-z0-9_-]")
        require_federated(cfg, "island")
        self.cfg, self.name, self.client, self.rd = cfg, name, client, rd
        self.who = {"run_id": cfg.run.name, "island": name}
        """What every request to the coordinator names."""
        self.metrics = IslandMetrics()
        """Prometheus metrics (diloco/ops/metrics.py): fed by this island's events, its runs of inner steps, its
        retries."""
        rd.observers.append(self.metrics.on_event)
        self.give_up_s = cfg.network.coordinator_wait_s
        # θ_0's shapes alone (zeros in the island's layout), unless init.inner_state reads a source's state into it.
        setup = build_setup(cfg, islands=[name], theta=cfg.init.inner_state)
        self.initial: PyTree = setup.init_params
        """θ_0 (or its shapes), which the island starts from (`restore`) and then lets go: the first pull brings the
        global θ, and a copy of θ_0 kept for the process's life would be one more θ that its memory plan does not
        count."""
        self.like = shapes_of(setup.init_params)
        """θ's structure, shapes and dtypes: what a pulled θ is rebuilt into."""
        self.frozen = setup.frozen_digest
        """Under workload.lora, the digest of the frozen base this process read (its Join carries it)."""
        # A multi-process island's mesh is every device of its processes (jax.distributed's global devices).
        n_devices = len(jax.devices()) if group.multiple else min(cfg.islands.devices, len(jax.local_devices()))
        if n_devices < cfg.islands.devices:
            rd.log("devices_reduced", island=name, configured=cfg.islands.devices, available=n_devices)
        self.asynchronous = cfg.train.mode == "async"
        # An asynchronous island's schedule spans the steps `simulate` would give it (diloco/simulator/async_sim.py).
        steps = (
            planned_steps(async_order(cfg), cfg.islands.island_names, cfg.train.inner_steps).get(name)
            if self.asynchronous
            else None
        )
        island = make_island(cfg, name, setup.model_of(name), setup.streams[name], n_devices, total_steps=steps)
        self.island: Island | LeaderIsland = LeaderIsland(island, Channel()) if group.multiple else island
        store = CheckpointStore(rd.checkpoints) if cfg.train.checkpoint_every else None
        self.checkpoints = IslandCheckpoints(store, self.island)
        self.fragments = setup.fragments
        self.P, self.H = self.fragments.count, cfg.train.inner_steps
        self.copy = GlobalCopy(self.fragments, self.like, downlink=cfg.downlink_specs())
        """This island's copy of the global θ: what Δ is taken from, moved by every commit it adopts."""
        self.step = 0
        """Inner steps of the schedule (outer_optimizer/fragments.py); may run τ steps ahead of the global copy."""
        self.lease_due = True
        """data.sampling = "chunks": the stream's plan is not the one for where the schedule is (the island starts, or
        restarts from the global copy, maybe mid-round with streaming): it leases before it trains on."""
        self.sync = IslandSync(client, rd, self.who, self.P, self.give_up_s, self._prepare, self.metrics.retried)
        self.presence = IslandPresence(
            client, rd, self.who, lambda: (self.round, self.island.state.step), lambda: self._join_request(self.round)
        )
        self.contributed = 0
        self.spent = SyncSpent()
        """Where the training thread's time between two runs of inner steps went (reported by train_start)."""
        self.stop_reason: str | None = None
        """Set by `request_stop` (SIGTERM, Ctrl+C): the island leaves at its next sync point."""
        self.reform: Callable[[], str | None] = lambda: None
        """Asked at each round's end of plain rounds, once the round's checkpoint is saved: why the island should end
        there and re-form, or None to go on. A multi-process island's process 0 asks whether a lost process is back
        (diloco/worker/island_formation.py: `Lead.returning`)."""
        self.reforming = False
        """The island ends at this sync point to re-form (`reform` said why): its processes exit with REGROUP."""

    def request_stop(self, reason: str) -> None:
        """Leave the federation at the next sync point (between inner-step runs): no new push, the checkpoint
        flushed, a Leave so the coordinator does not wait out the lease. Sets a flag, so it is safe in a signal
        handler; an island blocked on an absent coordinator (retrying for network.coordinator_wait_s) never reaches a
        sync point, so its `StopGrace` ends it after STOP_GRACE_S anyway (`forced_stop`)."""
        if self.stop_reason is None:
            self.stop_reason = reason

    def forced_stop(self, reason: str) -> None:
        """The stop's grace ran out: the line a stopped island ends with (`stopped` saying why), so that its log's
        last line says why it ended; the process then exits with code 0 (it was asked to stop). A checkpoint save
        cut short leaves the previous step restorable (diloco/run/checkpoint.py), so a restart resumes from there."""
        reason = f"{self.stop_reason or reason} (forced after {STOP_GRACE_S:g} s: not at a sync point)"
        print(json.dumps({"island": self.name, "round": self.round, "stopped": reason}), flush=True)
        self.rd.log("stopped", round=self.round, island=self.name, reason=reason)

    @property
    def round(self) -> int:
        """The round of the global copy (-1: none)."""
        return self.copy.round

    # -- joining and leaving -----------------------------------------------------------------------------------

    def _join_request(self, have_round: int) -> pb.JoinRequest:
        return pb.JoinRequest(
            **self.who,
            config_digest=bytes.fromhex(config_digest(self.cfg)),
            config_json=json.dumps(to_dict(self.cfg), sort_keys=True),
            release=RELEASE,
            frozen_digest=self.frozen,
            last_round=have_round,
            devices=len(self.island.mesh.devices.flat),
        )

    def join(self, have_round: int) -> pb.JoinReply:
        req = self._join_request(have_round)
        first = self.copy.params is None and self.round < 0
        wait = self.cfg.network.connect_timeout_s if first else self.give_up_s
        reply = retry_forever(lambda: self.client.join(req), f"join {self.client.target}", wait, self.metrics.retried)
        self.rd.log("joined", round=reply.round, island=self.name, state=reply.state)
        return reply

    def _leave(self, reason: str) -> None:
        try:
            self.client.leave(pb.LeaveRequest(**self.who, reason=reason))
        except TransportError:
            pass

    def restore(self) -> int:
        """Resume from this island's own checkpoint if it has one; returns its round (-1: none)."""
        saved = self.checkpoints.latest()
        # Afresh, init.inner_state starts the inner optimizer from the source's (θ_0 comes by the first full pull).
        inner = None if saved is not None else initial_inner_state(self.cfg, self.island, self.initial, self.rd)
        self.island.start(self.initial, inner)
        self.initial = None
        if saved is None:
            return -1
        state, meta = self.checkpoints.restore(saved)
        if self.island.held_whole():
            self.copy = GlobalCopy.whole(
                self.fragments, self.like, state.params, meta["round"] * self.P, self.copy.downlink
            )
        else:  # θ split across the island's processes: the copy comes whole from the coordinator (a full pull at join)
            self.copy = replace(self.copy, position=meta["round"] * self.P)
        self.step = meta["round"] * self.H
        self.rd.log("resumed", round=self.round, island=self.name, step=state.step)
        return self.round

    # -- the loop ----------------------------------------------------------------------------------------------

    def run(self) -> int:
        """Train until the coordinator says the run is done; returns the syncs this island contributed to.

        The schedule is outer_optimizer/fragments.py's, as in `simulate`'s Lockstep: train to the next event; at a
        sync, Δ of that fragment goes to the wire threads (push, then wait for the commit) while training goes on;
        at its merge τ steps later the committed fragment is merged into the local θ. Plain DiLoCo is P = 1,
        τ = 0: H steps, push, wait, θ_{r+1}. See docs/architecture.md, "Streaming DiLoCo".
        """
        have = self.restore()
        reply = self.join(have)
        self.presence.state = reply.state  # "done": the run ended while this island was away; it takes θ and leaves
        self.presence.attend()
        if reply.needs_full_params or self.copy.params is None:
            held, self.copy = self.copy, replace(self.copy, position=-1)
            self.adopt(self.sync.pull(-1, full=True), held=held)
            self._restart_from_global()
        self.presence.start_heartbeats(reply.lease_s)
        self.contributed = 0
        try:
            if self.asynchronous:
                self._run_async()
            else:
                self._run_rounds()
            if self.stop_reason is not None:
                self.sync.let_land(LEAVE_WAIT_S)
        except DivergedError as exc:
            # Say so before dying, so a coordinator does not wait for this island until its lease runs out.
            self._leave(f"diverged: {exc}"[:200])
            self.presence.end()
            raise
        finally:
            self.presence.stop()
            self.checkpoints.close()
        self.checkpoints.check()
        if self.stop_reason is None:
            self._leave("done")
        else:  # the coordinator may be stopping too (launch stops every process at once): do not wait on it long
            self.rd.log("stopped", round=self.round, island=self.name, reason=self.stop_reason)
            with Serial("leave") as leaving:  # a daemon: a Leave blocked on an absent coordinator is left behind
                futures.wait([leaving.submit(self._leave, f"stopped: {self.stop_reason}")], timeout=LEAVE_WAIT_S)
        self.presence.end()
        return self.contributed

    def _run_rounds(self) -> None:
        """Plain or streaming rounds until the coordinator says the run is done (`run`)."""
        stream = self.cfg.stream
        total = self.cfg.train.rounds * self.P
        in_flight: deque[tuple[int, Future[Synced | None]]] = deque()
        # Compute utilization = inner-step seconds / wall seconds. Each push reports the wall time since the
        # previous push (train, encode, and whatever waiting for commits the overlap did not hide).
        cycle_from = time.perf_counter()
        steps_ended: float | None = None
        runs: list[InnerRun] = []
        while self.presence.state != "done" and self.stop_reason is None:
            if self.step // (self.H // self.P) >= total:  # every sync pushed: collect the last commits, then stop
                if not in_flight:
                    break
                if self._finish_sync(in_flight.popleft()[1]):
                    in_flight.clear()
                    runs = []
                continue
            if self.step % self.H == 0 or self.lease_due:
                self._lease_chunks(self.step // self.H, self.H - self.step % self.H)
            if self.step % self.H == 0:
                self._log_train_start(self.step // self.H, steps_ended)
            target = next_event(self.step, self.H, self.P, stream.overlap_steps)
            run = self.island.train_for(self.cfg.train.round_seconds, target - self.step)
            self.metrics.trained(run)
            steps_ended = time.perf_counter()
            self.rd.log_inner(
                self.step // self.H, self.name, run.first_step, run.losses, self.cfg.train.log_every, run.figures
            )
            runs.append(run)
            self.step = target
            p = syncing_fragment(self.step, self.H, self.P)
            if p is not None:
                in_flight.append((p, self._start_sync(p, InnerRun.joined(runs), cycle_from)))
                runs = []
                cycle_from = time.perf_counter()
            q = merging_fragment(self.step, self.H, self.P, stream.overlap_steps)
            if q is not None and in_flight and in_flight[0][0] == q and self._finish_sync(in_flight.popleft()[1]):
                in_flight.clear()
                runs = []  # the steps since the last sync were on the θ the restart replaced: no push has them

    def _start_sync(self, p: int, run: InnerRun, cycle_from: float) -> Future[Synced | None]:
        """Fragment p syncs at this step: Δ_p of `run` (the steps since p last synced) is taken now, from the global
        copy's fragment, and goes to the wire (`IslandSync.submit`: encode, push, wait for the commit)."""
        sync_at = self.step // (self.H // self.P) - 1
        faults.at(self.name, "before_push", sync_at // self.P)
        t0 = time.perf_counter()
        push = self._encoded(run, self.copy.fragment(p))
        self.spent.encode_s += time.perf_counter() - t0
        meta = self._push_meta(sync_at // self.P, p, run, cycle_from)
        return self.sync.submit(sync_at, meta, push)

    def _encoded(self, run: InnerRun, reference: dict[str, Any]) -> Future[RoundPush]:
        """Δ for the leaves `reference` names, encoded: with streaming on the wire thread, just before its push (the
        training thread goes on with the next fragment's steps meanwhile: Δ itself is taken now, before they
        replace θ); without, here. A plain round waits for its commit anyway, and a multi-process island's leader
        must make every engine call on this thread, where its followers hear of it in order
        (diloco/worker/island_group.py)."""
        if self.P == 1:
            done: Future[RoundPush] = Future()
            done.set_result(self.island.encode_delta(run, reference).for_the_wire())
            return done
        return self.sync.encode(self.island.take_delta(run, reference))

    def _prepare(self, payload: PullPayload) -> Ready | None:
        """What a pull lane does with a commit once it has landed: a streaming fragment's update applied ahead to
        the global copy it finds (`GlobalCopy.ready`) and, with α = 0, its leaves placed on the mesh, so the merge
        takes them as they are."""
        ready = self.copy.ready(payload)
        if ready is not None and self.cfg.stream.merge_alpha == 0.0:
            ready = replace(ready, on_mesh=self.island.place(ready.leaves))
        return ready

    def _finish_sync(self, job: Future[Synced | None]) -> bool:
        """A sync's end, at its merge: wait for its result, keep the residual of an accepted push, adopt the commit
        into the global copy and merge its fragment into the local θ (or restart from the full θ), and checkpoint
        at the copy's round boundaries. True when it restarted (the syncs still in flight are then stale)."""
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
            self.presence.beat()  # back to training on the next round: the coordinator may evaluate the commit now
        if restarted:
            self._restart_from_global()
        else:
            self._merge_fragment(done.ready)
        if self.copy.position % self.P == 0:
            self.checkpoints.save(self.round, **self._chunk_meta())
        faults.at(self.name, "after_adopt", self.round)
        if self.P == 1 and self.stop_reason is None and self.round < self.cfg.train.rounds:
            why = self.reform()
            if why is not None:  # leave here as a stop does (checkpoint flushed, a Leave), then re-form
                self.stop_reason, self.reforming = f"re-forming: {why}", True
        return restarted

    def _merge_fragment(self, ready: Ready | None) -> None:
        """θ_p <- α·θ_p,local + (1 - α)·θ_p,global for the fragment the global copy just moved, with the leaves the
        pull lane placed when the copy took them (else `apply` redid them, and the merge places its own)."""
        p = (self.copy.position - 1) % self.P
        global_fragment = self.copy.fragment(p)
        on_mesh = ready.on_mesh if ready is not None and same_leaves(ready.leaves, global_fragment) else None
        self.island.merge(global_fragment, self.cfg.stream.merge_alpha, on_mesh)

    def _run_async(self) -> None:
        """Asynchronous updates (train.mode = "async"; docs/architecture.md, "Asynchronous rounds"): H steps from
        the global copy θ_b, push Δ naming b, and the coordinator applies it at once as update u; then pull the
        updates b .. u (each proved by its digest), restart from θ_{u+1} and go on. No island waits for another.

        A push refused (too stale, or the run is complete) loses its H steps: the island restarts from the full
        θ. The run ends for this island once its copy reaches θ_rounds."""
        cycle_from, steps_ended = time.perf_counter(), None
        while self.round < self.cfg.train.rounds and self.stop_reason is None:
            self._lease_chunks(self.round, self.H)
            self._log_train_start(self.round, steps_ended)
            run = self.island.train(self.H)
            self.metrics.trained(run)
            steps_ended = time.perf_counter()
            self.rd.log_inner(self.round, self.name, run.first_step, run.losses, self.cfg.train.log_every, run.figures)
            push = self.island.encode_delta(run, flatten_named(self.copy.params)).for_the_wire()
            meta = self._push_meta(self.round, 0, run, cycle_from)
            cycle_from = time.perf_counter()
            t0 = time.perf_counter()
            faults.at(self.name, "before_push", self.round)
            reply = self.sync.push(meta, push)
            if reply is not None:
                self.island.keep_residual(push)
                self.contributed += 1
            self._catch_up(reply.round + 1 if reply is not None else None)
            self._restart_from_global()
            self.spent.waited_s += time.perf_counter() - t0
            self.checkpoints.save(self.round, **self._chunk_meta())

    def _catch_up(self, position: int | None) -> None:
        """Move the global copy to `position` by pulling the updates it missed, one at a time, each proved by its
        digest; or (None, or when the coordinator no longer keeps one, or restarted) take the full θ."""
        if position is not None:
            try:
                while self.copy.position < position:
                    if not self.adopt(self.sync.pull(self.copy.position)):
                        return  # a full θ came instead: the update fell out of the coordinator's window
                return
            except TransportError as exc:  # the coordinator restarted, or undid the update: it holds another θ
                if exc.code != grpc.StatusCode.FAILED_PRECONDITION:
                    raise
                self.rd.log("resync", round=self.round, island=self.name, reason=exc.reason)
        self.adopt(self.sync.pull(-1, full=True))

    # -- the global copy ---------------------------------------------------------------------------------------

    def adopt(self, payload: PullPayload, ready: Ready | None = None, held: GlobalCopy | None = None) -> bool:
        """Move the global copy to the payload's commit (`GlobalCopy.apply`; `ready`: the update already applied
        on the pull lane) and log it. True when it was an update (the caller merges that fragment into the local
        θ), False for the full θ (the caller restarts from it). An update that does not prove out is replaced by
        the full θ; a full θ that does not is an error. A full θ that undoes commits the copy held (`held`, default
        the copy now: `rolled_back`) is logged as `rolled_back` first."""
        held = self.copy if held is None else held
        moved = self.copy.apply(payload, ready)
        if moved is None and payload.kind == "update":  # should never happen; recover with the full parameters
            self.rd.log(
                "digest_mismatch", round=payload.round, island=self.name, **self.sync.fragment_field(payload.fragment)
            )
            payload = self.sync.pull(-1, full=True)
            moved = self.copy.apply(payload)
        if moved is None:
            raise IslandError(f"full parameters of round {payload.round} fail their digest check")
        if rolled_back(held, moved):
            self.rd.log(
                "rolled_back",
                round=moved.round,
                island=self.name,
                from_round=held.round,
                from_digests=list(held.digests),
                digest=payload.param_digest.hex(),
            )
        self.copy = moved
        update = payload.kind == "update"
        # With streaming, a `synced` event says the fragment it moved (an update) and the copy's sync position.
        moved_fragment = {"fragment": (moved.position - 1) % self.P} if update else {}
        where = {**moved_fragment, "position": moved.position} if self.P > 1 else {}
        self.rd.log(
            "synced", round=self.round, island=self.name, kind=payload.kind, **where, digest=payload.param_digest.hex()
        )
        return update

    def _restart_from_global(self) -> None:
        """The local θ becomes the global copy and the schedule continues at its position; syncs still in flight
        belong to the old schedule: their results are dropped."""
        self.island.set_params(self.copy.params)
        self.step = self.round * self.H + (self.copy.position % self.P) * (self.H // self.P)
        self.sync.drop_queued()
        self.lease_due = True

    def _lease_chunks(self, round_: int, steps: int) -> None:
        """data.sampling = "chunks": ask the coordinator which sequences the `steps` inner steps left of round
        `round_` read (its ledger is the authority: after a refused push, a resync or a restart the island is told
        where each of its chunks stands) and read them; an island that brings its own source names it (by content)
        in every lease. An island the coordinator no longer counts a member joins again first."""
        stream = self.island.stream
        if not isinstance(stream, ChunkStream):
            return
        # With overlap (τ > 0) the round's last push may still be on the wire: the lease reads on after its claim
        # once the ledger holds it, so it waits for the reply (the price of chunks: that push's round trip a round).
        self.sync.await_replies()
        faults.at(self.name, "before_lease", round_)
        own = {"source": stream.source, "source_sequences": stream.layout.sequences} if stream.source else {}
        req = pb.LeaseRequest(**self.who, round=round_, sequences=steps * stream.batch_size, **own)
        for attempt in range(3):
            try:
                reply = retry_forever(lambda: self.client.lease(req), "lease", self.give_up_s, self.metrics.retried)
                break
            except TransportError as exc:
                if exc.code != grpc.StatusCode.FAILED_PRECONDITION or attempt == 2:
                    raise
                self.rd.log("lease_refused", round=round_, island=self.name, reason=exc.reason)
                self.join(self.round)
        self.island.read_chunks([Span(int(s.chunk), int(s.start), int(s.end)) for s in reply.spans])
        self.lease_due = False
        self.rd.log("leased", round=round_, island=self.name, spans=[s.as_list() for s in stream.plan])

    def _chunk_meta(self) -> dict[str, Any]:
        """What the island's checkpoint keeps of its chunks: the spans its last round read (its own record; where it
        reads on is the coordinator's ledger's to say)."""
        return {"chunks": [s.as_list() for s in self._taken()]} if isinstance(self.island.stream, ChunkStream) else {}

    def _push_meta(self, round_: int, fragment: int, run: InnerRun, cycle_from: float) -> pb.PushMeta:
        """What a push says about itself: where Δ was taken from (its round, or with async the update b, and the
        fragment's digest in the global copy), its token weight, loss and time."""
        return pb.PushMeta(
            **self.who,
            round=round_,
            fragment=fragment,
            tokens=run.tokens,
            inner_steps=len(run.losses),
            loss=float(run.losses[-1]),
            compute_s=run.seconds,
            wall_s=time.perf_counter() - cycle_from,
            base_digest=bytes.fromhex(self.copy.digests[fragment]),
            chunks=[pb.ChunkSpan(chunk=s.chunk, start=s.start, end=s.end) for s in self._claim()],
        )

    def _taken(self) -> list[Span]:
        """The chunk spans the steps since the last lease read (data.sampling = "chunks"; none otherwise)."""
        stream = self.island.stream
        return stream.taken() if isinstance(stream, ChunkStream) else []

    def _claim(self) -> list[Span]:
        """The chunk spans the steps since the previous push read, which this push claims (data.sampling =
        "chunks"; none otherwise): with streaming, each fragment's push claims its own S steps."""
        stream = self.island.stream
        return stream.claim() if isinstance(stream, ChunkStream) else []

    def _log_train_start(self, round_: int, steps_ended: float | None) -> None:
        """sync_s: from the end of the last inner step to now (at a round boundary without overlap: encode, push,
        the wait for the round to close, pull, checkpoint; diloco bench sync), and where the training thread's time
        went since the last `train_start` (`SyncSpent`)."""
        sync = {"sync_s": round(time.perf_counter() - steps_ended, 4)} if steps_ended is not None else {}
        self.rd.log(
            "train_start", round=round_, island=self.name, step=self.island.state.step, **self.spent.fields(), **sync
        )
        self.spent = SyncSpent()


def make_client(cfg: RunConfig, name: str, target: str, secret: str | None) -> IslandClient:
    """The island's gRPC client: TLS (mutual with a client certificate) when network.tls_* says so."""
    from diloco.deploy.tls import network_client_tls

    shaper = None
    if cfg.network.links:
        shaper = LinkShaper(profile_for(load_link_profiles(cfg.network.links), name), seed=cfg.run.seed)
    tls = network_client_tls(cfg.network)
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


def retire_self(cfg: RunConfig, name: str, target: str, secret: str | None, reason: str) -> bool:
    """Retire island `name` for good with its own credentials (`diloco island --retire-on-stop`); False, with one
    warning line, when the coordinator cannot be reached (the operator's `diloco retire` does it later)."""
    from diloco.deploy.tls import network_client_tls

    tls = network_client_tls(cfg.network)
    try:
        with OperatorClient(target, call_metadata(name, secret), tls) as client:
            client.retire(pb.RetireRequest(run_id=cfg.run.name, island=name, reason=reason[:200]))
    except TransportError as exc:
        log.warning("island %s could not retire itself: %s", name, exc)
        return False
    return True


class StartingStop:
    """Where an island process's stop goes: to its worker once the worker exists (`attach`), kept until then. An island
    takes a while to start (its model compiled, its checkpoint restored, its place in a multi-process island waited
    for); a SIGTERM then is a stop like any other: the worker stops at its first sync point, or the grace ends the
    process with its one line and exit code 0, never the signal's default death."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.reason: str | None = None
        self.worker: IslandWorker | None = None

    def request(self, reason: str) -> None:
        self.reason = self.reason or reason
        if self.worker is not None:
            self.worker.request_stop(reason)

    def forced(self, reason: str) -> None:
        if self.worker is not None:
            self.worker.forced_stop(reason)
            return
        stopped = f"{self.reason or reason} (forced after {STOP_GRACE_S:g} s: while starting)"
        print(json.dumps({"island": self.name, "round": -1, "stopped": stopped}), flush=True)

    def attach(self, worker: IslandWorker) -> None:
        self.worker = worker
        if self.reason is not None:
            worker.request_stop(self.reason)


def run_island_process(
    cfg: RunConfig,
    name: str,
    target: str,
    run_dir: Path,
    secret: str | None,
    metrics_port_flag: int | None = None,
    group: Group = ONE_PROCESS,
    retire_on_stop: bool = False,
    lead_lock: RunDirLock | None = None,
) -> dict:
    """`diloco island --no-supervise`: one worker until the run is done, or SIGTERM / Ctrl+C stops it cleanly
    (`IslandWorker.request_stop`; exit code 0: a stopped island is not restarted by its supervisor). With a metrics
    port (diloco/ops/metrics.py: network.metrics_port + 1 + the island's index, or `metrics_port_flag`) the worker
    serves /metrics on network.metrics_host. In a multi-process island (`group`) this is its leader, holding run.lock
    (`lead_lock`, taken when it was elected: diloco/worker/island_formation.py): it forms the island of the processes
    ready and joins the island's JAX program first, looks for a lost process back at each round's end (then it ends
    with "reform" in its result, to be started again), and however it ends tells the other processes to stop with
    its exit code. With `retire_on_stop` a clean
    stop (not a re-forming) ends with the island retiring itself (`retire_self`), after its Leave."""
    stop = StartingStop(name)
    StopGrace(STOP_GRACE_S, stop.request, stop.forced)  # first: a SIGTERM while the island starts is a stop too
    initialize_backend(cfg.islands.backend)  # before anything asks JAX for a device (islands/backend.py)
    port = metrics_port(cfg, name, metrics_port_flag) if name in cfg.islands.island_names else 0
    rd = RunDir(run_dir, cfg, lock=lead_lock)
    client = make_client(cfg, name, target, secret)
    metrics_server = None
    worker: IslandWorker | None = None
    ended: BaseException | None = None
    try:
        lead = None
        if group.multiple:
            files = FormationFiles(run_dir, group.num_processes)
            lead = Lead(files, cfg, name, rd.log, group.process_id, group.coordinator)
            formation = lead.form(cfg.islands.regroup_wait_s)
            join(group, formation, 0)
            processes = list(formation.processes)
            rd.log("formed", island=name, epoch=formation.epoch, processes=processes, devices=len(jax.devices()))
        worker = IslandWorker(cfg, name, client, rd, group)
        if lead is not None and cfg.train.checkpoint_every:  # a re-formed island resumes from the round's checkpoint
            worker.reform = lead.returning
        metrics_server = serve_metrics(worker.metrics.registry, cfg.network.metrics_host, port)

        stop.attach(worker)
        contributed = worker.run()
        rd.log_memory_peak(island=name)
        stopped = {"stopped": worker.stop_reason} if worker.stop_reason else {}
        if worker.stop_reason and retire_on_stop and not worker.reforming:
            stopped["retired"] = retire_self(cfg, name, target, secret, f"retired on stop: {worker.stop_reason}")
        reform = {"reform": True} if worker.reforming else {}
        return {"island": name, "rounds_contributed": contributed, "round": worker.round, **stopped, **reform}
    except BaseException as exc:
        ended = exc
        raise
    finally:
        if worker is not None and isinstance(worker.island, LeaderIsland):
            worker.island.stop(REGROUP if worker.reforming and ended is None else exit_code(ended))
        if metrics_server is not None:
            metrics_server.stop()
        client.close()
        rd.close()
