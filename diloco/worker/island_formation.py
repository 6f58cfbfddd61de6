"""Which processes a multi-host island runs on now (its formation), and which of them leads it, decided before the
island joins.

jax.distributed joins a fixed number of processes, all of them before the first computation, for the life of the
processes. So an island of N processes (islands.processes) that loses one for good can only go on as a new JAX
program over the processes it has left, and grow back only as another one: each change of its processes is a
restart of all of them into a new formation, its leader's word, written before anyone joins:

    RUN_DIR/formation.json   {"epoch": 3, "members": [[0, nonce], [1, nonce]], "refused": {nonce: reason},
                              "service": "HOST:PORT", "successor": null}

The leader is members[0] (rank 0): it serves jax.distributed at `service`, talks to the coordinator as the island
and writes the run directory. Every process says that it is ready in its own lock file, RUN_DIR/process-I.lock
(diloco/run/rundir.py: a flock the kernel drops however the process ends): a nonce new at each start, its release,
its config, its --num-processes and whether it can lead (it was given the coordinator's address). So a live lock
holder that says so is a candidate, and a dead process's file is no one's (`live_holder`).

Leading is holding RUN_DIR/run.lock, the run directory's own lock: the kernel lets one process hold it, so two
processes never lead the island at once, whatever their clocks and however slow one of them is (across hosts the
shared filesystem must honour flock, as it must for the checkpoints' one writer). A process takes it only when no
live process holds it, and only when the island's rule names it (`elected`):

    every process, at each start   says it is ready, then waits (`take_place`) until a formation names its nonce (it
                                   follows: it is ready no more and joins as the rank of its place), or run.lock is
                                   free and `elected` names it (it leads), or its patience runs out
                                   (network.coordinator_wait_s): one line naming what it waited for, exit 69, and
                                   its supervisor starts it again; refused, it stops with one line (exit 2)
    who leads                      the preferred leader (the newest formation's, or the process it named to succeed
                                   it; process 0 before the first formation) at once; when it is not back after
                                   islands.regroup_wait_s without a leader, the lowest process id alive, ready and
                                   able to lead
    the leader, at its start       waits up to islands.regroup_wait_s for the other N - 1 to be candidates, forms the
                                   island of those present (`decide`: itself first, then by process id), writes the
                                   formation (epoch + 1) and joins jax.distributed as rank 0 of that many
    the leader, at a round's end   a candidate outside the formation (a lost process back) makes the island re-form
                                   there (`Lead.returning`): the round's checkpoint is complete, every process exits
                                   with supervisor.REGROUP and is started again at once, and the next formation has
                                   them all. When one that is back has a lower process id and can lead, the leader
                                   names it its successor: the island re-forms under it, so an island whose process
                                   0 is back has the ranks, and the floats, it always had

So when process 0 is lost for good, its followers (their collectives failed; their supervisors restarted them) find
run.lock free, wait islands.regroup_wait_s for it, and the lowest of them able to lead takes the island over: it
resumes from the island's checkpoint and data cursor in the shared run directory and talks to the coordinator with
the island's name and credentials, as a restarted process 0 would. A process 0 that comes back while another leads
finds run.lock held: it waits as a candidate like any returning follower, and the island re-forms under it at the
next round's end. A leader that finds a newer formation than its own (a filesystem without flock, where run.lock
fences nothing) steps down at its round's end.

With fewer processes the island's mesh has fewer devices and the same batch (islands/mesh.py: more rows per device,
or more accumulation passes): every process draws the island's batch from the checkpoint's data cursor, so the
island trains on the batches a full island would.

The run directory is already a filesystem that every process of the island shares (its checkpoints), so the
formation needs no socket of its own: no port to secure beyond jax.distributed's, and it outlives every restart. A
candidate whose release, config or process count differs from the leader's is refused (`refusal`): it would compute
something else, and jax.distributed would join it all the same. Lock files are the island's own processes' words, but
a malformed one only makes that process no candidate. This module is JAX-free: it decides before JAX starts.
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from diloco import RELEASE
from diloco.config import RunConfig, diff_keys, to_dict
from diloco.run.rundir import LOCK_FILE, PROBE_GRACE_S, RunDirBusy, RunDirLock, live_holder
from floor.errors import UserError, WaitedTooLong

log = logging.getLogger("diloco.worker.island_formation")

FORMATION_FILE = "formation.json"
POLL_S = 0.1
"""How often a waiting process looks at the files again (a local or shared filesystem read, nothing more)."""
MAX_NONCE = 64


class FormationRefused(UserError, ValueError):
    """The island's leader refused this process (another release, config or process count): one line, exit code 2,
    not restarted."""


def lock_name(process_id: int) -> str:
    """The run directory's lock of process `process_id` of a multi-process island; it also says that the process is
    ready to join (`announce`). The leader holds run.lock besides."""
    return f"process-{process_id}.lock"


@dataclass(frozen=True)
class Candidate:
    """A process ready to join, as its lock file says: its process id, its nonce (new at each start), release,
    config (`to_dict`: the shared keys, none of a process's own), the island's process count it was started for
    (--num-processes), and whether it can lead (it was given the coordinator's address)."""

    process: int
    nonce: str
    release: str
    config: Mapping[str, Any]
    processes: int
    leads: bool = False

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
        return cls(process, nonce, release, config, n, ready.get("leads") is True)


@dataclass(frozen=True)
class Formation:
    """The island's processes for one epoch: (process id, nonce) with rank = position, its leader first; the nonces
    the leader refused, with why; where the leader serves jax.distributed (`service`, HOST:PORT); and the process the
    leader named to lead the next formation (`successor`, set when it re-forms the island for a lower process id
    back)."""

    epoch: int
    members: tuple[tuple[int, str], ...]
    refused: Mapping[str, str] = field(default_factory=dict)
    service: str = ""
    successor: int | None = None

    @property
    def processes(self) -> tuple[int, ...]:
        """The process ids in rank order, the leader's first."""
        return tuple(process for process, _ in self.members)

    @property
    def leader(self) -> int:
        return self.members[0][0]

    @property
    def preferred(self) -> int:
        """The process that leads the next formation when it is there: the successor named, else this leader."""
        return self.leader if self.successor is None else self.successor

    def rank(self, nonce: str) -> int | None:
        """The JAX process index of the process started with `nonce`, or None when the formation does not name it."""
        return next((i for i, (_, n) in enumerate(self.members) if n == nonce), None)

    def to_json(self) -> str:
        return json.dumps(
            {
                "epoch": self.epoch,
                "members": [list(m) for m in self.members],
                "refused": self.refused,
                "service": self.service,
                "successor": self.successor,
            }
        )

    @classmethod
    def from_json(cls, text: str) -> Formation:
        data = json.loads(text)
        members = tuple((int(process), str(nonce)) for process, nonce in data["members"])
        if not members:
            raise ValueError("a formation without members")
        successor = data.get("successor")
        return cls(
            int(data["epoch"]),
            members,
            {str(k): str(v) for k, v in data.get("refused", {}).items()},
            str(data.get("service", "")),
            None if successor is None else int(successor),
        )


def refusal(candidate: Candidate, n: int, config: Mapping[str, Any], release: str, leader: int = 0) -> str | None:
    """Why the leader (process `leader` of `n`, running `config` and `release`) refuses `candidate`, or None when it
    may join."""
    me = f"process {candidate.process}"
    if not 0 <= candidate.process < n or candidate.process == leader:
        others = ", ".join(str(p) for p in range(n) if p != leader)
        return f"{me} is not a follower of process {leader} in an island of {n} processes ({others})"
    if candidate.processes != n:
        return f"{me} was started for an island of {candidate.processes} processes, process {leader} for {n}"
    if candidate.release != release:
        return f"{me} runs release {candidate.release[:40]!r}, process {leader} runs {release!r}"
    differing = diff_keys(dict(candidate.config), dict(config))
    if differing:
        return f"{me}'s config differs from process {leader}'s in: {', '.join(differing[:8])}"
    return None


def decide(
    previous: Formation | None,
    n: int,
    leader: tuple[int, str],
    candidates: Sequence[Candidate],
    config: Mapping[str, Any],
    release: str,
    service: str = "",
) -> Formation:
    """The leader's (process id, nonce) formation of an island of `n` processes from the candidates present: the
    leader first, then each candidate that may join, one per process id, in process order; a refusal for each that
    may not. Its epoch follows `previous`."""
    process, nonce = leader
    members: dict[int, str] = {}
    refused: dict[str, str] = {}
    for candidate in sorted(candidates, key=lambda c: (c.process, c.nonce)):
        why = refusal(candidate, n, config, release, process)
        if why is not None:
            refused[candidate.nonce] = why
        else:
            members.setdefault(candidate.process, candidate.nonce)
    epoch = previous.epoch + 1 if previous is not None else 1
    return Formation(epoch, ((process, nonce), *sorted(members.items())), refused, service)


def elected(me: int, preferred: int, able: Collection[int], waited_out: bool, wait_s: float) -> str | None:
    """Why process `me`, able to lead, takes an island that no process leads now (its run.lock free), or None to
    wait. `preferred` leads the next formation when it is there (`Formation.preferred`; process 0 before the first);
    `able`: the other processes alive, ready and able to lead; `waited_out`: `wait_s` (islands.regroup_wait_s) has
    passed since this process last saw the island led."""
    if me == preferred:
        return f"process {me} leads the island's next formation"
    if preferred in able or not waited_out:
        return None  # the preferred leader is back, or may still come back
    if any(p < me for p in able):
        return None  # a lower process id takes it
    return f"process {preferred} did not lead the island within {wait_s:g} s; process {me} is the lowest able to lead"


class FormationFiles:
    """An island's formation in its run directory (RUN_DIR/formation.json, written by its leader alone), and its
    candidates (the processes' live lock files)."""

    def __init__(self, run_dir: Path, n: int) -> None:
        self.run_dir, self.n = run_dir, n
        self.path = run_dir / FORMATION_FILE

    def read(self) -> Formation | None:
        """The newest formation, or None when there is none (or it cannot be read: the leader writes a new one)."""
        try:
            return Formation.from_json(self.path.read_text())
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def write(self, formation: Formation) -> None:
        """Atomically: a reader sees the old formation or the new one, never half of one."""
        staging = self.path.with_name(f".{FORMATION_FILE}.{os.getpid()}")
        staging.write_text(formation.to_json())
        os.replace(staging, self.path)

    def candidates(self, exclude: int = 0) -> list[Candidate]:
        """The processes that are alive and ready now (each process id's own lock file only), but `exclude`."""
        ids = [i for i in range(self.n) if i != exclude]
        found = (Candidate.read(live_holder(self.run_dir / lock_name(i))) for i in ids)
        return [c for i, c in zip(ids, found, strict=True) if c is not None and c.process == i]

    def leader(self) -> dict[str, Any] | None:
        """What run.lock says about the process that leads the island now; None when no live process holds it."""
        return live_holder(self.run_dir / LOCK_FILE)

    def led_by(self, process: int) -> bool:
        """Whether the newest formation's leader is `process` (its supervisor speaks for the island when it dies)."""
        formation = self.read()
        return formation is not None and formation.leader == process


def announce(lock: RunDirLock, process: int, n: int, cfg: RunConfig, leads: bool = False) -> str:
    """A process (holding `lock`, its process-I.lock) of an island of `n` processes says it is ready to join, and
    whether it can lead (`leads`); returns its nonce."""
    nonce = uuid.uuid4().hex
    ready = {"process": process, "of": n, "nonce": nonce, "release": RELEASE, "config": to_dict(cfg), "leads": leads}
    lock.update(ready=ready)
    return nonce


@dataclass(frozen=True)
class Follows:
    """`take_place`'s answer to a follower: the formation that names it, and its rank there."""

    formation: Formation
    rank: int


@dataclass(frozen=True)
class Leads:
    """`take_place`'s answer to the island's new leader: run.lock, now held (RunDir takes it over), and why."""

    lock: RunDirLock
    why: str


@dataclass(frozen=True)
class Patience:
    """How long `take_place` waits: `regroup_s` (islands.regroup_wait_s) for the preferred leader before another
    process takes the island, `give_up_s` (network.coordinator_wait_s) in all before it ends with one line."""

    regroup_s: float
    give_up_s: float


def take_place(
    files: FormationFiles,
    lock: RunDirLock,
    nonce: str,
    name: str,
    process: int,
    patience: Patience,
    able: bool,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> Follows | Leads:
    """Wait until a formation names this process (`nonce`, announced in `lock`), or (`able` to lead) until the
    island has no leader and `elected` names this process; say in `lock` that it is no longer ready either way (a
    process on its way out of this formation is no candidate of the next, whose leader waits for its restart
    instead). A refusal is one line (FormationRefused); so is a wait longer than `patience.give_up_s` (WaitedTooLong,
    naming what it waited for: its supervisor starts it again)."""
    start = unled_since = clock()
    told = False
    while True:
        formation = files.read()
        if formation is not None and nonce in formation.refused:
            raise FormationRefused(
                f"island {name}: process {formation.leader} refuses this process: {formation.refused[nonce]} (start "
                f"it with process {formation.leader}'s release and config)"
            )
        rank = formation.rank(nonce) if formation is not None else None
        if formation is not None and rank is not None:
            lock.update(ready=None)
            return Follows(formation, rank)
        holder = files.leader()
        now = clock()
        if holder is not None:
            unled_since = now
        elif able:
            preferred = formation.preferred if formation is not None else 0
            others = [c.process for c in files.candidates(exclude=process) if c.leads]
            why = elected(process, preferred, others, now - unled_since >= patience.regroup_s, patience.regroup_s)
            taken = _take_lead(files) if why is not None else None
            if taken is not None:
                lock.update(ready=None)
                return Leads(taken, why or "")
        if now - start >= patience.give_up_s:
            raise WaitedTooLong(
                f"island {name} process {process}: no place in the island after {patience.give_up_s:g} s "
                f"(network.coordinator_wait_s) waiting for {_awaited(holder, formation, able)}"
            )
        if not told:
            log.info("island %s process %d is ready; waiting for %s", name, process, _awaited(holder, formation, able))
            told = True
        sleep(POLL_S)


def _take_lead(files: FormationFiles) -> RunDirLock | None:
    """run.lock, or None when another process took it first."""
    try:
        return RunDirLock(files.run_dir, wait_s=PROBE_GRACE_S)
    except RunDirBusy:
        return None


def _awaited(holder: Mapping[str, Any] | None, formation: Formation | None, able: bool) -> str:
    """What a waiting process waits for, in words."""
    if holder is not None:
        return f"the island's leader (pid {holder.get('pid')}) to take it in at a round's end"
    preferred = formation.preferred if formation is not None else 0
    if able:
        return f"process {preferred} or a lower process able to lead to take the island"
    return f"process {preferred} to lead the island (this process cannot: it has no --coordinator)"


class Lead:
    """The leader's side of the formation: it forms the island at its start (`form`) and, at each round's end, looks
    for a process that can join (`returning`). `log` writes an event to its run directory (RunDir.log); `process` is
    the leader's process id, `service` where it serves jax.distributed."""

    def __init__(
        self,
        files: FormationFiles,
        cfg: RunConfig,
        name: str,
        log: Callable[..., None],
        process: int = 0,
        service: str = "",
    ) -> None:
        self.files, self.name, self.log = files, name, log
        self.process, self.service = process, service
        self.config = to_dict(cfg)
        self.nonce = uuid.uuid4().hex
        self.formation: Formation | None = None

    def _propose(self) -> tuple[Formation, list[Candidate]]:
        candidates = self.files.candidates(exclude=self.process)
        previous = self.formation or self.files.read()
        me = (self.process, self.nonce)
        return decide(previous, self.files.n, me, candidates, self.config, RELEASE, self.service), candidates

    def form(self, wait_s: float) -> Formation:
        """Wait up to `wait_s` for every other process to be ready, then write the formation of those that are."""
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
        """At a round's end: why the island should re-form now, or None. It re-forms when a process outside the
        formation is ready and may join (under the lowest of those back and this leader that can lead: named the
        successor), or when a newer formation than this leader's exists (another leads: this one steps down).
        Refuses, once each, the candidates that may not join (written to the formation, where they read it)."""
        assert self.formation is not None, "form the island first"
        newest = self.files.read()
        if newest is not None and newest.epoch > self.formation.epoch:
            return f"formation {newest.epoch} of process {newest.leader} supersedes this one ({self.formation.epoch})"
        proposal, candidates = self._propose()
        new = {nonce: why for nonce, why in proposal.refused.items() if nonce not in self.formation.refused}
        if new:
            self.formation = replace(self.formation, refused={**self.formation.refused, **new})
            self.files.write(self.formation)
            self._log_refused(new, candidates)
        back = sorted(set(proposal.processes) - set(self.formation.processes))
        if not back:
            return None
        successor = min([self.process, *(c.process for c in candidates if c.leads and c.process in back)])
        if successor != self.process:
            self.formation = replace(self.formation, successor=successor)
            self.files.write(self.formation)
            return f"process {', '.join(map(str, back))} ready to join (process {successor} to lead)"
        return f"process {', '.join(map(str, back))} ready to join"

    def _log_refused(self, refused: Mapping[str, str], candidates: Sequence[Candidate]) -> None:
        for candidate in candidates:
            why = refused.get(candidate.nonce)
            if why is not None:
                log.warning("island %s refuses a process: %s", self.name, why)
                self.log("process_refused", island=self.name, process=candidate.process, reason=why)
