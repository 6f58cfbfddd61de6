"""`diloco bench soak`: a real federation under seeded SIGKILLs of islands and of the coordinator, for many rounds.

What it answers: after many faults of the kinds docs/architecture.md's fault model promises to survive ("island
process killed mid-round", "island comes back", "coordinator killed"), are all replicas still bit-identical, and
does the model still train as well as without faults?

Two runs of one config and seed (`soak_config_text`: a small byte transformer on the built-in corpus, int8 codecs
with error feedback on both sides, `plan.islands` islands of which any 2 close a round, leases of a few seconds so
that a round closes soon after an island died), each a real coordinator and real island processes over gRPC
(`diloco.harness.procs.Federation`, islands unsupervised so that SIGKILL kills them):

* faulted: a seeded plan (`SoakPlan.schedule`) spreads the kills over the run, one in each of as many equal
  stretches of rounds (none in the last `TAIL_ROUNDS`, so that every restarted process trains again before the
  end). Each kill lands at a named point (docs/architecture.md, "Fault injection at named points"), never at a
  time: a seeded island at `before_push` of the kill's round (or of the first round it reaches after it, if it
  is down then), the coordinator at a seeded one of `before_commit` and `after_commit`; the process stops there,
  and the benchmark SIGKILLs it once it sees its marker. Each killed process is started again after a seeded
  delay with the very same command line (a coordinator on the address it had, from its last checkpoint; an island
  from its own checkpoint). A kill whose victim never reaches its point before the run ends is reported
  (`kills_not_reached`).
* fault-free: the same config, no kill. Acceptance: final eval losses within `LOSS_TOLERANCE`.

Digests (`DigestWatch`). The coordinator's `round` event of round r carries the digest of θ_{r+1}, and an
island's `synced` event of round r+1 the digest of the θ_{r+1} it holds. After every new commit the watch checks
every island's synced events against the coordinator's digests as they stand. A coordinator serves θ_{r+1} before
it has checkpointed it (docs/architecture.md, "Commits off the critical path"); killed in that window, it restarts
from its last checkpoint, drops the events of the rounds it did not save (diloco/run/rundir.py,
truncate_after_round) and commits them again, possibly with other contributions and another digest. Its islands
that held a lost θ roll back: they take the coordinator's full θ (a `rolled_back` event when it is an earlier round,
or the same round with another θ). So "every digest equal after every round" means: every θ_{r+1} an island synced
equals the LAST digest committed for round r, both while the run goes (against the digests committed so far) and
at the end (against the final ones), except a θ the run forgot, which is legal only when the coordinator resumed
before round r+1 and the island later took a full θ in its place; those are counted (`rolled_back_syncs`, with the
islands' `rolled_back` events) to show the case happened. Rounds committed twice are counted (`rounds_recommitted`);
the committed sequence must still be 0..R-1, each once. The islands' own `digest_mismatch` events (an update that
did not reproduce the coordinator's digest) are counted too. Every mismatch count must be 0.

Run: ``diloco bench soak [--rounds 50] [--island-kills 10] [--coordinator-kills 2] [--seed S] [--run-dir DIR]
[--no-fault-free]`` (JSON on stdout; a federation that fails ends it with one line naming its logs).
"""

from __future__ import annotations

import math
import random
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from diloco.bench.errors import BenchError
from diloco.bench.federation import _federation
from diloco.config import load_config
from diloco.faults import COMMIT_POINTS
from diloco.harness.procs import COORDINATOR, Federation

TAIL_ROUNDS = 4
"""No kill in the last rounds: a process restarted there could find the run over (and its coordinator gone)."""
MIN_ISLANDS = 2
"""Quorum of the soak: a round closes with any 2 pushes, so it goes on while islands are dead."""
LOSS_TOLERANCE = 0.02
"""Largest accepted relative difference between the faulted and fault-free final eval losses."""
RESTART_DELAY_S = (0.2, 3.0)
"""A killed process is started again after a delay drawn from this range (seconds)."""
TIMEOUT_S = 900.0
"""Longest a run may take before the benchmark gives up."""


def soak_config_text(rounds: int, islands: int, seed: int) -> str:
    """The soak's run config. Small enough that 50 rounds with faults and 50 without fit in ~10 minutes on 2 cores.
    A round waiting for a dead island closes at the adaptive deadline (never sooner than 5 s) or once its lease
    (10 s; heartbeats every 10/3 s, which a busy machine delays by seconds) expires. Islands retry a dead
    coordinator for minutes with backoff capped at 1 s, so they find a restarted one soon."""
    return f"""
[run]
name = "bench-soak"
seed = {seed}

[model]
kind = "transformer"
vocab_size = 256
seq_len = 32
d_model = 32
n_layers = 1
n_heads = 2
d_ff = 128

[data]
kind = "text"
path = "stdlib:"
val_fraction = 0.05

[train]
rounds = {rounds}
inner_steps = 10
batch_size = 8
eval_batches = 4
checkpoint_every = 1
log_every = 10

[inner]
lr = 3e-3
warmup_steps = 10

[islands]
count = {islands}

[codec]
uplink = "int8"
downlink = "int8"

[quorum]
min_islands = {MIN_ISLANDS}
lease_s = 10.0
min_deadline_s = 5.0
max_deadline_s = 60.0

[network]
pull_wait_s = 2.0
connect_timeout_s = 180.0
coordinator_wait_s = 300.0

[transport]
max_attempts = 3
backoff_max_s = 1.0
"""


# -- the plan ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Kill:
    """One planned SIGKILL: at `point` of round `at_round` (or the first round after it that the victim reaches),
    restarted after `delay_s`."""

    at_round: int
    coordinator: bool
    point: str
    """The named point (diloco/faults.py): `before_push` for an island, a coordinator's point for the coordinator."""
    delay_s: float
    pick: float
    """Which island dies (a fraction of the configured ones, in name order); unused for the coordinator."""

    def entry(self, islands: Sequence[str]) -> str:
        """Its DILOCO_PAUSE_AT entry (WHO:POINT:ROUND+) in a run of `islands`."""
        who = COORDINATOR if self.coordinator else islands[int(self.pick * len(islands))]
        return f"{who}:{self.point}:{self.at_round}+"


@dataclass(frozen=True)
class SoakPlan:
    """The benchmark's parameters; `schedule` turns them into seeded kills."""

    rounds: int = 50
    island_kills: int = 10
    coordinator_kills: int = 2
    seed: int = 0
    islands: int = 4

    def __post_init__(self) -> None:
        kills = self.island_kills + self.coordinator_kills
        if self.island_kills < 0 or self.coordinator_kills < 0:
            raise BenchError("--island-kills and --coordinator-kills must be >= 0")
        if self.islands < MIN_ISLANDS + 1:
            raise BenchError(f"the soak needs >= {MIN_ISLANDS + 1} islands (a round closes with {MIN_ISLANDS})")
        if self.rounds < TAIL_ROUNDS + 2 or kills > self.rounds - TAIL_ROUNDS - 1:
            raise BenchError(
                f"--rounds {self.rounds} leaves no room for {kills} kills: kills happen in rounds 1.."
                f"{self.rounds - TAIL_ROUNDS - 1}, at most one per round"
            )

    def schedule(self) -> list[Kill]:
        """One kill in each of `kills` equal stretches of rounds 1..rounds-TAIL_ROUNDS-1 (spread over the run),
        the coordinator's at seeded positions among them."""
        rng = random.Random(self.seed)
        n = self.island_kills + self.coordinator_kills
        first, last = 1, self.rounds - TAIL_ROUNDS - 1
        span = (last - first + 1) / max(n, 1)
        coordinator_at = set(rng.sample(range(n), self.coordinator_kills))
        kills = []
        for i in range(n):
            lo = first + math.floor(i * span)
            hi = max(lo, first + math.floor((i + 1) * span) - 1)
            coordinator = i in coordinator_at
            kills.append(
                Kill(
                    at_round=rng.randint(lo, hi),
                    coordinator=coordinator,
                    point=rng.choice(COMMIT_POINTS) if coordinator else "before_push",
                    delay_s=rng.uniform(*RESTART_DELAY_S),
                    pick=rng.random(),
                )
            )
        return kills


# -- digests -----------------------------------------------------------------------------------------------------


@dataclass
class DigestWatch:
    """Checks every island's synced digests against the coordinator's committed ones (module docstring)."""

    islands: tuple[str, ...]
    committed: dict[int, list[str]] = field(default_factory=dict)
    """Round -> every distinct digest the coordinator logged for it, in the order seen."""
    live_mismatches: set[tuple[str, int, str]] = field(default_factory=set)
    """(island, synced round, its digest) that differed from the coordinator's digest at the time."""
    _seen: frozenset[tuple[int, str]] = frozenset()

    def follow(self, name: str) -> None:
        """Check island `name` too (an island that joins the run later: admitted, or added to the roster)."""
        if name not in self.islands:
            self.islands = (*self.islands, name)

    def observe(self, fed: Federation) -> int:
        """Record the coordinator's commits; when they changed, check the islands. Returns the highest round
        committed so far (the coordinator's file may shrink while a restarted one truncates it; this never does)."""
        now = frozenset((r["round"], r["digest"]) for r in fed.rounds())
        if now != self._seen:
            self._seen = now
            for r, digest in sorted(now):
                if digest not in self.committed.setdefault(r, []):
                    self.committed[r].append(digest)
            current = dict(now)
            for name in self.islands:
                for s in fed.events("synced", island=name):
                    expected = current.get(s["round"] - 1)
                    if s["round"] > 0 and expected is not None and s["digest"] != expected:
                        self.live_mismatches.add((name, s["round"], s["digest"]))
        return max(self.committed, default=-1)

    def final(self, fed: Federation, rounds: int) -> dict[str, Any]:
        """The end-of-run check against the last committed digest of every round."""
        self.observe(fed)
        commits = fed.rounds()
        sequence = [c["round"] for c in commits]
        digest_after = {c["round"] + 1: c["digest"] for c in commits}
        resumed_at = [e["round"] for e in fed.events("resumed")]
        mismatches: list[dict[str, Any]] = []
        forgotten: set[tuple[str, int, str]] = set()
        initial: set[str] = set()
        checked = 0
        last_synced: dict[str, int] = {}
        for name in self.islands:
            synced = fed.events("synced", island=name)
            for i, s in enumerate(synced):
                if s["round"] == 0:
                    initial.add(s["digest"])
                    continue
                checked += 1
                if s["digest"] == digest_after.get(s["round"]):
                    continue
                if was_forgotten(s, synced[i + 1 :], resumed_at):
                    forgotten.add((name, s["round"], s["digest"]))
                    continue
                mismatches.append(
                    {
                        "island": name,
                        "round": s["round"],
                        "digest": s["digest"],
                        "coordinator": digest_after.get(s["round"]),
                    }
                )
            last_synced[name] = synced[-1]["round"] if synced else -1
        return {
            "rounds_committed": len(commits),
            "commit_sequence_ok": sequence == list(range(rounds)),
            "synced_checked": checked,
            "digest_mismatches": len(mismatches) + max(0, len(initial) - 1),
            "mismatch_examples": mismatches[:5],
            "live_digest_mismatches": len(self.live_mismatches - forgotten),
            "island_digest_mismatch_events": sum(len(fed.events("digest_mismatch", island=n)) for n in self.islands),
            "rolled_back_syncs": len(forgotten),
            "rolled_back_events": sum(len(fed.events("rolled_back", island=n)) for n in self.islands),
            "rounds_recommitted": sorted(r for r, ds in self.committed.items() if len(ds) > 1),
            "islands_at_final_round": sorted(n for n, r in last_synced.items() if r == rounds),
        }


def was_forgotten(synced: dict[str, Any], later: list[dict[str, Any]], resumed_at: list[int]) -> bool:
    """Whether an island's synced θ that differs from the run's final one is a θ the run forgot, legally: a
    coordinator resumed from a checkpoint before that round (it served a commit it had not saved yet) and the island
    took a full θ in its place later."""
    before = any(r < synced["round"] for r in resumed_at)
    return before and any(s["kind"] == "full" for s in later)


# -- the runs ----------------------------------------------------------------------------------------------------


@dataclass
class Chaos:
    """Carries out a kill plan on a running federation whose processes stop at the plan's entries."""

    fed: Federation
    pending: dict[str, Kill]
    """Entry (WHO:POINT:ROUND+) -> its kill, until its victim stops there."""
    done: list[dict[str, Any]] = field(default_factory=list)
    restarts: dict[str, float] = field(default_factory=dict)
    """Process name -> when to start it again."""

    def step(self, committed: int, t0: float) -> None:
        """Restart what is due, then SIGKILL every process that stands at a pending entry."""
        now = time.monotonic()
        for name, when in sorted(self.restarts.items(), key=lambda kv: kv[1]):
            if now >= when:
                del self.restarts[name]
                if name == COORDINATOR:
                    self.fed.start_coordinator()
                else:
                    self.fed.start_island(name)
        for entry, kill in list(self.pending.items()):
            marker = self.fed.pauses.reached(entry)
            if marker is None:
                continue
            victim = entry.split(":", 1)[0]
            del self.pending[entry]
            self.fed.kill(victim)
            self.restarts[victim] = time.monotonic() + kill.delay_s
            self.done.append(
                {
                    "victim": victim,
                    "point": kill.point,
                    "round": marker["round"],
                    "committed_rounds": committed + 1,
                    "t": round(time.monotonic() - t0, 1),
                }
            )

    def finished(self) -> bool:
        """Every kill done and restarted, or the run over (the coordinator ended by itself) with none restarting."""
        coordinator = self.fed.coordinator
        over = coordinator is not None and COORDINATOR not in self.fed.killed and coordinator.poll() is not None
        return not self.restarts and (not self.pending or over)

    def let_go(self) -> None:
        """Release the entries never reached, so that no process stops at one after the kills are over."""
        for entry in self.pending:
            self.fed.release(entry)


def soak_run(
    config: Path, overrides: Sequence[str], run_dir: Path, rounds: int, kills: list[Kill] | None
) -> dict[str, Any]:
    """One federation run of `config`, with the kills carried out (None: fault-free); checks digests throughout."""
    t0 = time.monotonic()
    islands = load_config(config, overrides).islands.island_names
    pending = {kill.entry(islands): kill for kill in kills or []}
    with _federation(config, overrides, run_dir, pause_at=list(pending)) as fed:
        watch = DigestWatch(fed.names)
        chaos = Chaos(fed, pending)
        fed.start()
        deadline = t0 + TIMEOUT_S
        while not chaos.finished():
            if time.monotonic() > deadline:
                raise BenchError(f"the soak did not finish its kills in {TIMEOUT_S:.0f}s (logs: {run_dir / 'logs'})")
            fed.check_alive()
            chaos.step(watch.observe(fed), t0)
            time.sleep(0.1)
        chaos.let_go()
        summary = fed.wait_done(max(60.0, deadline - time.monotonic()))
        fed.wait_exit(120.0)  # every process, restarted ones included, ends by itself with exit code 0
        digests = watch.final(fed, rounds)
        last = fed.rounds()[-1]["digest"] if fed.rounds() else None
        exit_codes = {name: proc.returncode for name, proc in fed.processes().items()}
    return {
        "run_dir": str(run_dir),
        "wall_s": round(time.monotonic() - t0, 1),
        "kills": chaos.done,
        "island_kills": sum(k["victim"] != COORDINATOR for k in chaos.done),
        "coordinator_kills": sum(k["victim"] == COORDINATOR for k in chaos.done),
        "kills_not_reached": sorted(chaos.pending),
        **digests,
        "final_eval_loss": summary["final_eval_loss"],
        "islands_lost": summary["islands_lost"],
        "rejected": summary["rejected"],
        "tokens": summary["tokens"],
        "summary_digest_is_last_commit": summary["params_digest"] == last,
        "exit_codes": exit_codes,
    }


def run_soak_bench(
    plan: SoakPlan, run_dir: Path, overrides: Sequence[str] = (), fault_free: bool = True
) -> dict[str, Any]:
    """The faulted run, then (unless told not to) the fault-free one, and their comparison. `overrides`
    (key=value) change the soak's config (model, H, ...; train.rounds and islands.count come from `plan`)."""
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-soak-") as tmp:
        config = Path(tmp) / "soak.toml"
        config.write_text(soak_config_text(plan.rounds, plan.islands, plan.seed))
        faulted = soak_run(config, overrides, run_dir / "faulted", plan.rounds, plan.schedule())
        clean = soak_run(config, overrides, run_dir / "fault_free", plan.rounds, None) if fault_free else None
    out: dict[str, Any] = {
        "bench": "soak",
        "plan": {
            "rounds": plan.rounds,
            "island_kills": plan.island_kills,
            "coordinator_kills": plan.coordinator_kills,
            "seed": plan.seed,
            "islands": plan.islands,
        },
        "faulted": faulted,
        "digest_mismatches": faulted["digest_mismatches"] + faulted["live_digest_mismatches"],
    }
    if clean is not None:
        a, b = clean["final_eval_loss"], faulted["final_eval_loss"]
        ratio = b / a if a and math.isfinite(a) and math.isfinite(b) else math.inf
        out |= {
            "fault_free": clean,
            "digest_mismatches": out["digest_mismatches"]
            + clean["digest_mismatches"]
            + clean["live_digest_mismatches"],
            "final_eval_loss_faulted": b,
            "final_eval_loss_fault_free": a,
            "loss_ratio": round(ratio, 5),
            "tolerance": LOSS_TOLERANCE,
            "pass_loss": abs(ratio - 1.0) <= LOSS_TOLERANCE,
        }
    out["wall_s"] = round(time.monotonic() - t0, 1)
    return out
