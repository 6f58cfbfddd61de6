"""`launch` carrying out a roster script (roster.events) against its live federation, at the points that make each
event's outcome the one `simulate` computes (docs/architecture.md, "Churn by script").

For round 0 and each round r that opens with a change, the islands that push in r without joining or coming back
in it (the *steady* ones), and those the script retires or kills at r, stop at `before_push` of r (diloco/faults.py).
Once every one of them stands there, round r is open and nothing of it has been pushed by them:

1. each retiree is retired by the operator (`diloco retire`'s call) and let go: its push is refused, it exits;
2. each joiner is admitted by the operator (`diloco admit`'s call: a secret made here, its digest sent) and started
   with its kit; it joins late for r, pulls θ_r, trains and pushes;
3. once every joiner and every island back from a kill at r - 1 has pushed into r (the coordinator's Status), the
   steady islands are let go: round r then holds all of them;
4. each killee is SIGKILLed where it stands, once its checkpoint of round r is on disk and every steady island has
   pushed: its supervisor's Leave closes round r, and the restarted worker comes back in round r + 1.

Under data.sampling = "chunks" the leases are ordered too, in every round: each island stops at `before_lease` of r
and is let go in `leasing_at`'s order, the next once the one before has logged its lease (`leased`), so the ledger
hands out returned and fresh chunks as `simulate`'s does. The steady islands, retirees and killees lease before
step 1, the arriving ones in step 2's order (those back from a kill first, then the joiners, each admitted in turn).

Every wait is on a marker, an island's records or the coordinator's Status, never on time; `poll` advances the
script as far as it can and returns, so `launch`'s display loop drives it.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

from diloco.config import RunConfig
from diloco.deploy.tls import OPERATOR_CLIENT, LocalPki
from diloco.harness.procs import Federation
from diloco.ops.roster_ops import admit_island, retire_island
from diloco.run.roster_script import changes_at, enrolled_at, leasing_at, rounds_changed
from floor.errors import UserError
from transport import diloco_pb2 as pb
from transport.auth import call_metadata, resolve_secret
from transport.errors import TransportError
from transport.grpc_client import OperatorClient


class RosterScriptError(UserError, RuntimeError):
    """The live federation did not follow the script (a round closed before the script's event could land)."""


def held_entries(cfg: RunConfig) -> list[str]:
    """The stops (WHO:POINT:ROUND) the script needs, for `Federation(pause_at=...)`: `before_push` of the held
    rounds, and under chunks `before_lease` of every round; none without a script (nothing would release them)."""
    if not cfg.roster.events:
        return []
    pushes = [_stop(name, r) for r in _held_rounds(cfg) for name in _held(cfg, r)]
    return pushes + [_lease_stop(name, r) for r in _leasing_rounds(cfg) for name in _leasing(cfg, r)]


def _held_rounds(cfg: RunConfig) -> list[int]:
    """The rounds the driver holds: those that open with a change, and round 0, which every configured island must
    have joined before any pushes (the islands start one by one; simulate's first round holds them all). A kill in
    the last round comes back in none."""
    return sorted(r for r in {0, *rounds_changed(cfg.roster.events)} if r < cfg.train.rounds)


def _leasing_rounds(cfg: RunConfig) -> list[int]:
    """The rounds whose leases the driver orders: every one under data.sampling = "chunks", none otherwise."""
    return list(range(cfg.train.rounds)) if cfg.data.sampling == "chunks" else []


def _stop(island: str, round_: int) -> str:
    return f"{island}:before_push:{round_}"


def _lease_stop(island: str, round_: int) -> str:
    return f"{island}:before_lease:{round_}"


def _leasing(cfg: RunConfig, round_: int) -> list[str]:
    return leasing_at(cfg.roster.events, cfg.islands.island_names, round_)


def _held(cfg: RunConfig, round_: int) -> list[str]:
    """The islands that stop before their push of `round_`: the steady ones, the retirees and the killees."""
    arriving = changes_at(cfg.roster.events, round_).arriving
    return [name for name in _leasing(cfg, round_) if name not in arriving]


class RosterDriver:
    """The script's events, carried out one round at a time (module docstring); `retired` names the islands whose
    exit (with the code of a user error) is the script's doing."""

    def __init__(
        self,
        fed: Federation,
        cfg: RunConfig,
        pki: LocalPki,
        operator_ref: str,
        secrets: dict[str, str],
    ) -> None:
        """`secrets`: each configured island's secret (launch holds them all); a joiner's is added at its admission.
        Status is asked as an island enrolled in the round at hand, with its own certificate."""
        self.fed, self.cfg, self.pki = fed, cfg, pki
        self.operator_ref, self.operator_tls = operator_ref, pki.client_tls(OPERATOR_CLIENT)
        self.secrets = dict(secrets)
        self.retired: set[str] = set()
        self._steps = self._script()

    def poll(self) -> None:
        """Carry the script on as far as the federation allows now."""
        next(self._steps, None)

    def _script(self) -> Iterator[None]:
        for r in sorted({*_held_rounds(self.cfg), *_leasing_rounds(self.cfg)}):
            yield from self._round(r)

    def _round(self, r: int) -> Iterator[None]:
        """Round `r`'s leases and changes, steps 1 to 4 of the module docstring."""
        changes = changes_at(self.cfg.roster.events, r)
        held = _held(self.cfg, r) if r in _held_rounds(self.cfg) else []
        ordered = r in _leasing_rounds(self.cfg)
        if ordered:
            for name in _held(self.cfg, r):
                yield from self._lease(name, r)
        yield from self._until(lambda: all(self.fed.pauses.reached(_stop(n, r)) for n in held))
        for name in changes.retires:
            retire_island(self.fed.address, self.cfg.run.name, name, "roster.events", self.operator_tls,
                          operator_ref=self.operator_ref)  # fmt: skip
            self.retired.add(name)
            self.fed.release(_stop(name, r))
        for name in changes.arriving:
            if name in changes.joins:
                self._admit(name, r)
            if ordered:
                yield from self._lease(name, r)
        yield from self._until(lambda: self._pushed(r, list(changes.arriving)))
        steady = [n for n in held if n not in changes.retires and n not in changes.kills]
        for name in steady:
            self.fed.release(_stop(name, r))
        if not changes.kills:
            return
        yield from self._until(lambda: self._pushed(r, steady) and all(self._saved(n, r) for n in changes.kills))
        for name in changes.kills:
            marker = self.fed.pauses.reached(_stop(name, r))
            assert marker is not None
            os.kill(int(marker["pid"]), signal.SIGKILL)  # the worker, where it stands; its supervisor restarts it

    def _lease(self, name: str, round_: int) -> Iterator[None]:
        """Let `name` lease round `round_`'s chunks, once it stands at `before_lease`; done once it logged the lease."""
        stop = _lease_stop(name, round_)
        yield from self._until(lambda: self.fed.pauses.reached(stop) is not None)
        self.fed.release(stop)
        yield from self._until(lambda: any(e["round"] == round_ for e in self.fed.events("leased", island=name)))

    @staticmethod
    def _until(condition: Callable[[], bool]) -> Iterator[None]:
        while not condition():
            yield

    def _admit(self, name: str, round_: int) -> None:
        """Admit `name` with a kit of its own in RUN_DIR/kits/ROUND (a retired name joins again with a new one)."""
        kits = self.fed.run_dir / "kits" / str(round_)
        kit = admit_island(self.fed.address, self.cfg.run.name, name, self.operator_ref, kits, self.operator_tls)
        self.secrets[name] = resolve_secret(kit["secret"])
        args = [*self.pki.client_args(name), "--tls-server-name", "localhost", "--secret", kit["secret"]]
        self.fed.start_island(name, args=args)

    def _status(self, round_: int) -> pb.StatusReply:
        """The coordinator's Status, asked as the first island enrolled in `round_` that is not retired."""
        asking = next(n for n in enrolled_at(self.cfg.roster.events, self.cfg.islands.island_names, round_)
                      if n in self.secrets and n not in self.retired)  # fmt: skip
        tls = self.pki.client_tls(asking)
        with OperatorClient(self.fed.address, call_metadata(asking, self.secrets[asking]), tls) as client:
            return client.status()

    def _pushed(self, round_: int, names: list[str]) -> bool:
        """Whether every island of `names` has pushed into the open round `round_` (refused when it closed)."""
        if not names:
            return True
        try:
            status = self._status(round_)
        except TransportError:
            return False
        if status.round > round_:
            raise RosterScriptError(
                f"roster.events: round {round_} closed before {', '.join(names)} pushed into it (is quorum.min_islands "
                "1.0, every live island?)"
            )
        pushed = {island.name for island in status.islands if island.state == "pushed"}
        return status.round == round_ and set(names) <= pushed

    def _saved(self, island: str, round_: int) -> bool:
        """Whether `island`'s checkpoint of `round_` is complete (none is kept without train.checkpoint_every)."""
        if not self.cfg.train.checkpoint_every or round_ == 0:  # none before the first commit
            return True
        return (Path(self.fed.island_dir(island)) / "checkpoints" / str(round_)).is_dir()
