"""The islands that train in each round of `simulate`, changed between rounds as a roster script says (roster.events).

Each change is what the live federation does at the point `launch` carries it out (docs/architecture.md, "Churn by
script"), so both end with one parameter digest:

- **join** at round r: the operator admits the island while round r is open; it starts as any new island process
  does (`build_setup(cfg, islands=[name])`: an admitted island's stream, windows of the whole split or the ledger's
  chunks; a fresh inner state, or init.inner_state's), takes θ_r and pushes into round r.
- **retire** at round r: the island leased and trained round r and is retired before its push; its chunks return
  to the pool (`ChunkLedger.release`) then, before the islands that arrive in round r lease, and it never trains
  again.
- **kill** at round r: SIGKILLed before its push of round r, so its round's work is lost; its supervisor's Leave
  returns its chunks once every lease of round r is made. It comes back in round r + 1 from its own checkpoint of
  round r (what it held when round r began, which is what it holds now: it trained nothing that counted), or afresh
  without train.checkpoint_every, and takes θ_{r+1}.

Under data.sampling = "chunks" every round's leases are made here, in `leasing_at`'s order, the one `launch` holds
its islands to (`lease` hands each its spans when `Lockstep` asks).
"""

from __future__ import annotations

from diloco.config import RunConfig
from diloco.run.checkpoint import CheckpointStore
from diloco.run.global_run import GlobalRun
from diloco.run.roster_script import RoundChanges, changes_at, leasing_at
from diloco.run.rundir import RunDir
from diloco.run.setup import build_setup, make_island
from diloco.run.warm_start import initial_inner_state
from diloco.simulator.local_islands import island_stores
from islands.chunks import ChunkStream, Span
from islands.island import Island


class ScriptedRoster:
    """Who trains now (`training`), and each island's checkpoint store; `open_round` applies a round's changes and
    makes its leases."""

    def __init__(
        self, cfg: RunConfig, rd: RunDir, world: GlobalRun, islands: list[Island], stores: list[CheckpointStore]
    ) -> None:
        self.cfg, self.rd, self.world = cfg, rd, world
        self.training = list(islands)
        self.stores = {island.name: store for island, store in zip(islands, stores, strict=True)} if stores else {}
        """Each island's checkpoint store (none without train.checkpoint_every)."""
        self._down: dict[str, Island] = {}
        """Islands killed in the last round, back in this one."""
        self._leased: dict[str, list[Span]] = {}
        """The spans each island that trains this round leased (data.sampling = "chunks"), until `lease` hands them."""

    def open_round(self, round_: int) -> bool:
        """Apply round `round_`'s changes and make its leases before it trains; True when the islands that train
        changed."""
        changes = changes_at(self.cfg.roster.events, round_)
        for name in changes.restarts:
            self._restart(self._down.pop(name), round_)
        for name in changes.joins:
            self._join(name, round_)
        self._lease_round(round_, changes)
        for name in (*changes.retires, *changes.kills):
            island = next(island for island in self.training if island.name == name)
            self.training.remove(island)
            if name in changes.kills:
                self._down[name] = island
                self.rd.log("island_left", round=round_, island=name, reason="killed (roster.events)")
            else:
                self.world.totals.islands_retired += 1
                self.rd.log("island_retired", round=round_, island=name, reason="roster.events")
        return bool(changes)

    def lease(self, island: str, sequences: int) -> list[Span]:
        """`Lockstep`'s lease: the spans `open_round` leased for `island` this round (of `sequences` sequences)."""
        spans = self._leased.pop(island)
        assert sum(span.end - span.start for span in spans) == sequences, (island, spans, sequences)
        return spans

    def saved(self) -> list[CheckpointStore]:
        """The stores of the islands that train, in `training` order (none without train.checkpoint_every)."""
        return [self.stores[island.name] for island in self.training] if self.stores else []

    def _lease_round(self, round_: int, changes: RoundChanges) -> None:
        """Round `round_`'s leases as `launch` makes them: in `leasing_at`'s order, the retirees' chunks back in the
        pool before the arrivals lease, the killed islands' once every lease is made. A leaver leases as the
        others do (it trained round r), and its spans are never claimed."""
        ledger = self.world.chunks
        if ledger is None:
            return
        by_name = {island.name: island for island in self.training}
        order = leasing_at(self.cfg.roster.events, self.cfg.islands.island_names, round_)
        for name in order[: len(order) - len(changes.arriving)]:
            self._lease(by_name[name])
        for name in changes.retires:
            ledger.release(name)
        for name in changes.arriving:
            self._lease(by_name[name])
        for name in changes.kills:
            ledger.release(name)

    def _lease(self, island: Island) -> None:
        ledger = self.world.chunks
        if ledger is not None and isinstance(island.stream, ChunkStream):
            self._leased[island.name] = ledger.lease(island.name, self.cfg.train.inner_steps * island.stream.batch_size)

    def _join(self, name: str, round_: int) -> None:
        setup = build_setup(self.cfg, islands=[name])
        island = make_island(self.cfg, name, setup.model_of(name), setup.streams[name])
        params = self.world.loop.params
        island.start(params, initial_inner_state(self.cfg, island, params, self.rd))
        if self.stores:
            self.stores.update(zip([name], island_stores(self.cfg, self.rd, [name]), strict=True))
        self.world.totals.islands_admitted += 1
        self.rd.log("island_admitted", round=round_, island=name, enrolled=len(self.training) + len(self._down) + 1)
        self._seat(island, round_)

    def _restart(self, island: Island, round_: int) -> None:
        params = self.world.loop.params
        if self.cfg.train.checkpoint_every:
            island.set_params(params)
        else:  # nothing saved: a new process starts afresh
            island.start(params, initial_inner_state(self.cfg, island, params, self.rd))
        self._seat(island, round_)

    def _seat(self, island: Island, round_: int) -> None:
        self.training.append(island)
        self.world.totals.islands_joined += 1
        self.rd.log("island_joined", round=round_, island=island.name)
