"""Which processes a multi-host island runs on now (its formation), decided by process 0 before the island joins.

jax.distributed joins a fixed number of processes, all of them before the first computation, for the life of the
processes. So an island of N processes (islands.processes) that loses one for good can only go on as a new JAX
program over the processes it has left, and grow back only as another one: each change of its processes is a
restart of all of them into a new formation, process 0's word, written before anyone joins:

    RUN_DIR/formation.json   {"epoch": 3, "members": [[0, nonce], [1, nonce]], "refused": {nonce: reason}}

A follower says that it is ready in its own lock file, RUN_DIR/process-I.lock (diloco/run/rundir.py: a flock the
kernel drops however the process ends): a nonce new at each start, its release, its config and its --num-processes.
So a live lock holder that says so is a candidate, and a dead process's file is no one's (`live_holder`).

    process 0, at each start       waits up to islands.regroup_wait_s for its N - 1 followers to be candidates,
                                   forms the island of those present (`decide`), writes the formation (epoch + 1)
                                   and joins jax.distributed as rank 0 of that many processes
    a follower, at each start      says it is ready, waits for a formation that names its nonce (`take_place`), says
                                   it no more and joins as the rank of its place in it; refused, it stops with one
                                   line (exit 2)
    process 0, at each round's end a candidate outside the formation (a lost process back) makes the island re-form
                                   there (`Lead.returning`): the round's checkpoint is complete, every process exits
                                   with supervisor.REGROUP and is started again at once, and process 0's next start
                                   finds them all

Ranks follow the process ids, so an island with all its processes has the ranks it always had and trains as it
always did. With fewer, its mesh has fewer devices and the same batch (islands/mesh.py: more rows per device, or more
accumulation passes): every process draws the island's batch from the checkpoint's data cursor, so the island trains
on the batches a full island would.

The run directory is already a filesystem that every process of the island shares (its checkpoints), so the
formation needs no socket of its own: no port to secure beyond jax.distributed's, and it outlives every restart. A
candidate whose release, config or process count differs from process 0's is refused (`refusal`): it would compute
something else, and jax.distributed would join it all the same. Lock files are the island's own processes' words, but
a malformed one only makes that process no candidate.

Process 0 is the formation's author and the island's voice to the coordinator: if it is lost, its followers wait for
it to come back (no other process takes the island over). This module is JAX-free: it decides before JAX starts.
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from diloco import RELEASE
from diloco.config import RunConfig, diff_keys, to_dict
from diloco.run.rundir import RunDirLock, live_holder
from floor.errors import UserError

log = logging.getLogger("diloco.worker.island_formation")

FORMATION_FILE = "formation.json"
POLL_S = 0.1
"""How often a waiting process looks at the files again (a local or shared filesystem read, nothing more)."""
MAX_NONCE = 64


class FormationRefused(UserError, ValueError):
    """Process 0 refused this process (another release, config or process count): one line, exit code 2, not
    restarted."""


def lock_name(process_id: int) -> str:
    """The run directory's lock of a follower (the leader takes the directory's own, run.lock); it also says that
    the follower is ready to join (`announce`)."""
    return f"process-{process_id}.lock"


@dataclass(frozen=True)
class Candidate:
    """A follower ready to join, as its lock file says: its process id, its nonce (new at each start), release,
    config (`to_dict`: the shared keys, none of a process's own) and the island's process count it was started for
    (--num-processes)."""

    process: int
    nonce: str
    release: str
    config: Mapping[str, Any]
    processes: int

    @classmethod
    def read(cls, holder: Mapping[str, Any] | None) -> Candidate | None:
        """The candidate a live lock holder's info names; None when it says no such thing (not ready yet, or
        malformed)."""
        ready = (holder or {}).get("ready")
        if not isinstance(ready, dict):
            return None
        process, nonce, release, config, n = (ready.get(k) for k in ("process", "nonce", "release", "config", "of"))
        if not (isinstance(process, int) and isinstance(n, int) and isinstance(nonce, str)):
            return None
        if not (0 < len(nonce) <= MAX_NONCE and isinstance(release, str) and isinstance(config, dict)):
            return None
        return cls(process, nonce, release, config, n)


@dataclass(frozen=True)
class Formation:
    """The island's processes for one epoch: (process id, nonce) in process order, rank = position; and the nonces
    process 0 refused, with why."""

    epoch: int
    members: tuple[tuple[int, str], ...]
    refused: Mapping[str, str] = field(default_factory=dict)

    @property
    def processes(self) -> tuple[int, ...]:
        return tuple(process for process, _ in self.members)

    def rank(self, nonce: str) -> int | None:
        """The JAX process index of the process started with `nonce`, or None when the formation does not name it."""
        return next((i for i, (_, n) in enumerate(self.members) if n == nonce), None)

    def to_json(self) -> str:
        return json.dumps({"epoch": self.epoch, "members": [list(m) for m in self.members], "refused": self.refused})

    @classmethod
    def from_json(cls, text: str) -> Formation:
        data = json.loads(text)
        members = tuple((int(process), str(nonce)) for process, nonce in data["members"])
        return cls(int(data["epoch"]), members, {str(k): str(v) for k, v in data.get("refused", {}).items()})


def refusal(candidate: Candidate, n: int, config: Mapping[str, Any], release: str) -> str | None:
    """Why process 0 (of `n`, running `config` and `release`) refuses `candidate`, or None when it may join."""
    me = f"process {candidate.process}"
    if not 0 < candidate.process < n:
        return f"{me} is not a follower of an island of {n} processes (1 .. {n - 1})"
    if candidate.processes != n:
        return f"{me} was started for an island of {candidate.processes} processes, process 0 for {n}"
    if candidate.release != release:
        return f"{me} runs release {candidate.release[:40]!r}, process 0 runs {release!r}"
    differing = diff_keys(dict(candidate.config), dict(config))
    if differing:
        return f"{me}'s config differs from process 0's in: {', '.join(differing[:8])}"
    return None


def decide(
    previous: Formation | None,
    n: int,
    leader: str,
    candidates: Sequence[Candidate],
    config: Mapping[str, Any],
    release: str,
) -> Formation:
    """Process 0's (nonce `leader`) formation of an island of `n` processes from the candidates present: each that
    may join, one per process id, in process order; a refusal for each that may not. Its epoch follows `previous`."""
    members: dict[int, str] = {0: leader}
    refused: dict[str, str] = {}
    for candidate in sorted(candidates, key=lambda c: (c.process, c.nonce)):
        why = refusal(candidate, n, config, release)
        if why is not None:
            refused[candidate.nonce] = why
        else:
            members.setdefault(candidate.process, candidate.nonce)
    epoch = previous.epoch + 1 if previous is not None else 1
    return Formation(epoch, tuple(sorted(members.items())), refused)


class FormationFiles:
    """An island's formation in its run directory (RUN_DIR/formation.json, written by process 0 alone), and its
    candidates (the followers' live lock files)."""

    def __init__(self, run_dir: Path, n: int) -> None:
        self.run_dir, self.n = run_dir, n
        self.path = run_dir / FORMATION_FILE

    def read(self) -> Formation | None:
        """The newest formation, or None when there is none (or it cannot be read: process 0 writes a new one)."""
        try:
            return Formation.from_json(self.path.read_text())
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def write(self, formation: Formation) -> None:
        """Atomically: a reader sees the old formation or the new one, never half of one."""
        staging = self.path.with_name(f".{FORMATION_FILE}.{os.getpid()}")
        staging.write_text(formation.to_json())
        os.replace(staging, self.path)

    def candidates(self) -> list[Candidate]:
        """The followers that are alive and ready now (each process id's own lock file only)."""
        found = (Candidate.read(live_holder(self.run_dir / lock_name(i))) for i in range(1, self.n))
        return [c for i, c in enumerate(found, start=1) if c is not None and c.process == i]


def announce(lock: RunDirLock, process: int, n: int, cfg: RunConfig) -> str:
    """A follower (holding `lock`, its process-I.lock) of an island of `n` processes says it is ready to join;
    returns its nonce."""
    nonce = uuid.uuid4().hex
    lock.update(ready={"process": process, "of": n, "nonce": nonce, "release": RELEASE, "config": to_dict(cfg)})
    return nonce


def take_place(files: FormationFiles, lock: RunDirLock, nonce: str, name: str, process: int) -> tuple[Formation, int]:
    """Wait until process 0 names this follower (`nonce`, announced in `lock`) in a formation; returns it and this
    process's rank there, and says in `lock` that it is no longer ready: a follower on its way out of this formation
    (the island re-forming) is no candidate of the next, whose process 0 waits for its restart instead. A refusal is
    one line (FormationRefused). No time limit: process 0 takes a returning follower at a round's end."""
    told = False
    while True:
        formation = files.read()
        if formation is not None and nonce in formation.refused:
            raise FormationRefused(
                f"island {name}: process 0 refuses this process: {formation.refused[nonce]} (start it with process "
                "0's release and config)"
            )
        rank = formation.rank(nonce) if formation is not None else None
        if formation is not None and rank is not None:
            lock.update(ready=None)
            return formation, rank
        if not told:
            log.info("island %s process %d is ready; waiting for process 0 to take it in", name, process)
            told = True
        time.sleep(POLL_S)


class Lead:
    """Process 0's side of the formation: it forms the island at its start (`form`) and, at each round's end, looks
    for a process that can join (`returning`). `log` writes an event to its run directory (RunDir.log)."""

    def __init__(self, files: FormationFiles, cfg: RunConfig, name: str, log: Callable[..., None]) -> None:
        self.files, self.name, self.log = files, name, log
        self.config = to_dict(cfg)
        self.nonce = uuid.uuid4().hex
        self.formation: Formation | None = None

    def _propose(self) -> tuple[Formation, list[Candidate]]:
        candidates = self.files.candidates()
        previous = self.formation or self.files.read()
        return decide(previous, self.files.n, self.nonce, candidates, self.config, RELEASE), candidates

    def form(self, wait_s: float) -> Formation:
        """Wait up to `wait_s` for every follower to be ready, then write the formation of those that are."""
        deadline = time.monotonic() + wait_s
        proposal, candidates = self._propose()
        while len(proposal.members) < self.files.n and time.monotonic() < deadline:
            time.sleep(POLL_S)
            proposal, candidates = self._propose()
        self.formation = proposal
        self.files.write(proposal)
        self._log_refused(proposal.refused, candidates)
        missing = sorted(set(range(self.files.n)) - set(proposal.processes))
        if missing:
            log.warning(
                "island %s forms on processes %s: %s not ready after %g s (they join at a round's end when back)",
                self.name,
                list(proposal.processes),
                missing,
                wait_s,
            )
        return proposal

    def returning(self) -> str | None:
        """At a round's end: why the island should re-form now (a process outside the formation is ready and may
        join), or None. Refuses, once each, the candidates that may not join (written to the formation, where they
        read it)."""
        assert self.formation is not None, "form the island first"
        proposal, candidates = self._propose()
        new = {nonce: why for nonce, why in proposal.refused.items() if nonce not in self.formation.refused}
        if new:
            self.formation = replace(self.formation, refused={**self.formation.refused, **new})
            self.files.write(self.formation)
            self._log_refused(new, candidates)
        back = sorted(set(proposal.processes) - set(self.formation.processes))
        return f"process {', '.join(map(str, back))} ready to join" if back else None

    def _log_refused(self, refused: Mapping[str, str], candidates: Sequence[Candidate]) -> None:
        for candidate in candidates:
            why = refused.get(candidate.nonce)
            if why is not None:
                log.warning("island %s refuses a process: %s", self.name, why)
                self.log("process_refused", island=self.name, process=candidate.process, reason=why)
