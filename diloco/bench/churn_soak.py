"""`diloco bench churn-soak`: the elastic federation under churn, cycle after cycle, for as long as asked, judged from
its own records (issue 34's measured acceptance: nothing lost, nothing counted twice, nothing hangs).

A bench of its own rather than a mode of `bench soak`: the soak runs a fixed roster for a fixed number of rounds,
twice (with and without faults), and compares the two losses; this runs one open-ended federation whose roster
changes all the time and whose config changes on resume, and its verdict comes from the records alone. It shares
the soak's digest check (`DigestWatch`), `bench elastic`'s operator acts and chunk audit (diloco/bench/roster_acts.py),
and the harness's named points (diloco/faults.py).

The run (`churn_config_text`): a small byte transformer, `data.sampling = "chunks"` over a corpus file, int8 codecs
both ways, configured islands us-east and eu-west, and ap-south, which joins and leaves islands.names on alternate
roster changes, `quorum.min_islands = 1.0` and no deadline: a round closes once every live island has
pushed, so an island held at a named point holds its round and nothing happens "about then". Cycle k spans
ROUNDS_PER_CYCLE rounds from b = k · ROUNDS_PER_CYCLE; its configured roster R and victim X (R's islands in turn)
follow from k, so every process is started with every stop of every cycle (DILOCO_PAUSE_AT, WHO:POINT:ROUND+) and
the cycle acts at them:

1. admit: the operator admits `join-k` (its kit in RUN_DIR/kits, its secret's digest sent with the operator's
   credential), which starts with its secret and, in even cycles, a data source of its own (`data.own_path`, one of
   two files in turn, so a later joiner reads on where an earlier one of the same tokens stopped); the benchmark
   waits for its first push (the coordinator's `push` event). Every island of R stands at `before_push` of b + 1
   meanwhile (however late it rejoined after the last restart: a round waits for no island that joined during it),
   so round b + 1 is open until the joiner has pushed into it or an earlier round;
2. island kill: X is SIGKILLed where it stands and started again with the same command line; the others are let
   go (round b + 1 closes) and the benchmark waits for X's next push;
3. retire: once the coordinator has checkpointed the round the joiner pushed into (its `checkpoint` event: the
   joiner's work is the run's for good, whatever the coordinator kill below undoes), the operator retires it; its
   process is refused and ends with exit code 2 and one line. The other islands of R, standing at `before_push` of
   b + 2, are then let go;
4. coordinator kill: the coordinator stops at `before_commit` of b + 2 (even cycles) or at `after_commit` (odd
   ones: a commit served and not yet saved, the window the islands roll back from); its RSS (VmRSS) and the run
   dir's size are sampled there, and it is SIGKILLed. In odd cycles and the last one the restart changes the
   config: every island is stopped (SIGTERM: it saves its checkpoint and exits 0), then the coordinator and the
   islands of the new roster start with it: ap-south added or dropped; the last cycle brings every configured
   island back and sets train.rounds = b + ROUNDS_PER_CYCLE + 1, which ends the run two rounds on, each island
   holding its push of the last round until all have joined. In even cycles the coordinator restarts with its
   command line and the islands find it again.

`--cycles N` runs N cycles; `--minutes M` runs cycles until M minutes have passed (the cycle under way then is the
last). The verdict, from the records once every process has ended (`passed`):

* exactly-once: `sequences_repeated` = `sequences_lost` = 0 over every source (the corpus and each own source), from
  the coordinator's `chunks_consumed` records (`chunk_audit`) and from its summary.json;
* digests: every θ an island synced (configured islands and joiners) is the coordinator's commit, live and at the
  end (`DigestWatch`: a θ the run forgot is legal only when the island took the full θ in its place, counted as
  `rolled_back_syncs`); every round committed once, in order; no island's `digest_mismatch` event;
* exits: every process ends by itself, with exit code 0 or with one `diloco: error:` line (a retired joiner: code 2,
  "not on this run's roster"); none is killed at the end;
* memory: the coordinator's VmRSS at its stop, one sample a cycle (each a coordinator that resumed the run and ran one
  cycle, holding its whole durable state: roster, retired credentials, ledgers); the samples after `warm_up` cycles
  stay within RSS_BOUND of the first of them;
* disk: the federation's state (the coordinator's run dir and the configured islands', less the append-only records:
  metrics.jsonl and logs) stays within DISK_BOUND of its first size after warm-up; the whole run dir is reported too.

Run: ``diloco bench churn-soak [--cycles N | --minutes M] [--warm-up W] [--seed S] [--run-dir DIR] [key=value ...]``
(JSON on stdout; a federation that fails ends it with one line naming its logs).
"""

from __future__ import annotations

import os
import random
import secrets
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diloco.bench.errors import BenchError
from diloco.bench.federation import _federation
from diloco.bench.load import Sample
from diloco.bench.roster_acts import OPERATOR_ENV, admit_and_start, chunk_audit, retire_and_wait
from diloco.bench.soak import DigestWatch
from diloco.faults import ENV_AT
from diloco.harness.procs import COORDINATOR, Federation
from diloco.run.chunk_ledger import CONSUMPTION_KEYS

CONFIGURED = ("us-east", "eu-west", "ap-south")
"""The configured islands of the first roster; the last is dropped and restored on alternate roster changes."""
ROUNDS_PER_CYCLE = 3
"""Rounds of one cycle: b + 1 holds the island kill, b + 2 the coordinator kill, b + 3 is free."""
RSS_BOUND = 1.10
"""The coordinator's VmRSS samples after warm-up stay within this factor of the first of them."""
DISK_BOUND = 1.5
"""The federation's state after warm-up stays within this factor of its first size: three checkpoints are kept per
process and a fourth exists while it is written (4/3), the rest is bounded by the roster."""
WAIT_S = 300.0
"""How long any one condition of a cycle may take to come true on a slow, loaded machine."""
POLL_S = 0.5
"""How often a wait on the records reads them (they grow with the run; the kills wait on markers, not on these)."""
WARM_UP_CYCLES = 3
"""Cycles before the memory and disk samples are compared: the checkpoint stores of the coordinator and of each island
fill their `max_to_keep` steps over the first three (state 3.3 -> 3.7 -> 4.6 MiB, then flat)."""
CYCLES_PER_MINUTE = 6
"""No cycle is faster than this on any machine: the stops a `--minutes` run is started with cover this many."""
CORPUS_BYTES = 60_000
OWN_BYTES = 20_000


def churn_config_text(corpus: Path, seed: int) -> str:
    """The run's config: small enough for a cycle in well under a minute on 2 busy cores."""
    return f"""
[run]
name = "bench-churn-soak"
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
path = "{corpus}"
val_fraction = 0.05
sampling = "chunks"
chunk_sequences = 16

[train]
rounds = 1000000
inner_steps = 5
batch_size = 8
eval_batches = 2
checkpoint_every = 1
log_every = 5

# Warmup-stable-decay with no decay: the learning rate does not depend on train.rounds, which the last restart sets.
[inner]
lr = 3e-3
warmup_steps = 5
schedule = "wsd"

[islands]
count = {len(roster(0))}
names = {list(roster(0))}
max = {len(CONFIGURED) + 1}

[codec]
uplink = "int8"
downlink = "int8"

# A round closes once every live island pushed, never at a deadline: a held island holds it.
[quorum]
min_islands = 1.0
lease_s = 10.0
min_deadline_s = inf
max_deadline_s = inf

[network]
operator_secret = "env:{OPERATOR_ENV}"
pull_wait_s = 2.0
connect_timeout_s = 180.0
coordinator_wait_s = 300.0

[transport]
max_attempts = 3
backoff_max_s = 1.0
"""


# -- the plan: what each cycle does, a pure function of its index ----------------------------------------------


def roster(cycle: int) -> tuple[str, ...]:
    """The configured islands during `cycle`: the last one joins the roster at the coordinator restart of cycle 1,
    leaves it at cycle 3's, and so on; the run's last restart always brings the whole roster back (`FINAL_ROSTER`)."""
    return CONFIGURED[:-1] if (cycle // 2) % 2 == 0 else CONFIGURED


FINAL_ROSTER = CONFIGURED
"""The roster of the run's last rounds: every configured island, so that each one that ever ran is checked at the end
(one that holds a commit the last coordinator kill undid takes the coordinator's θ in its place)."""


def roster_changes(cycle: int, last: bool) -> bool:
    """Whether the coordinator's restart at the end of `cycle` changes the config (the roster, and at the end the
    length)."""
    return cycle % 2 == 1 or last


@dataclass(frozen=True)
class Cycle:
    """Cycle `index`'s stops (WHO:POINT:ROUND+ entries of DILOCO_PAUSE_AT) and its actors."""

    index: int

    @property
    def base(self) -> int:
        return self.index * ROUNDS_PER_CYCLE

    @property
    def victim(self) -> str:
        names = roster(self.index)
        return names[self.index % len(names)]

    @property
    def steady(self) -> tuple[str, ...]:
        return tuple(n for n in roster(self.index) if n != self.victim)

    @property
    def joiner(self) -> str:
        return f"join-{self.index}"

    @property
    def victim_stop(self) -> str:
        return f"{self.victim}:before_push:{self.base + 1}+"

    def steady_stops(self, round_offset: int) -> list[str]:
        """Where the islands other than the victim stop: before their push of round b + 1 (with the victim's stop,
        the round stays open for the joiner however late each rejoined after the last restart), then of b + 2
        (open for the victim back)."""
        return [f"{name}:before_push:{self.base + round_offset}+" for name in self.steady]

    @property
    def coordinator_stop(self) -> str:
        point = "before_commit" if self.index % 2 == 0 else "after_commit"
        return f"{COORDINATOR}:{point}:{self.base + 2}+"

    def stops(self) -> list[str]:
        return [self.victim_stop, *self.steady_stops(1), *self.steady_stops(2), self.coordinator_stop]


# -- measurements ------------------------------------------------------------------------------------------------


def disk_kib(path: Path, skip: Sequence[str] = ()) -> int:
    """Allocated KiB under `path` (as du counts them), less the entries named in `skip` (at any depth)."""
    total = 0
    for root, dirs, files in os.walk(path):
        dirs[:] = [d for d in dirs if d not in skip]
        for name in files:
            if name not in skip:
                try:
                    total += os.lstat(os.path.join(root, name)).st_blocks * 512
                except FileNotFoundError:  # a checkpoint pruned while counted
                    pass
    return total // 1024


RECORDS = ("logs", "pauses", "kits", "metrics.jsonl")
"""What `state_kib` leaves out: append-only records and the benchmark's own files."""


def state_kib(fed: Federation) -> int:
    """The federation's state on disk: the coordinator's run dir and the configured islands' (less the records)."""
    own = disk_kib(fed.run_dir, skip=("islands", *RECORDS))
    return own + sum(disk_kib(fed.island_dir(name), skip=RECORDS) for name in CONFIGURED)


def bounded(samples: Sequence[float], warm_up: int, bound: float) -> dict[str, Any]:
    """The samples after `warm_up`, against the first of them: first, last, max, their ratio and the verdict."""
    after = list(samples[warm_up:])
    if not after:
        return {"samples_after_warm_up": 0, "within_bound": False, "bound": bound}
    first, top = after[0], max(after)
    return {
        "first_after_warm_up": first,
        "last": after[-1],
        "max_after_warm_up": top,
        "max_over_first": round(top / first, 4) if first else None,
        "bound": bound,
        "within_bound": top <= bound * first,
        "samples_after_warm_up": len(after),
    }


def text_bytes(n: int, seed: int) -> bytes:
    """`n` bytes of seeded lower-case words: a corpus with something to learn and no file to fetch."""
    rng = random.Random(seed)
    words = ["".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(2, 8))) for _ in range(400)]
    out = bytearray()
    while len(out) < n:
        out += (" ".join(rng.choices(words, k=12)) + ".\n").encode()
    return bytes(out[:n])


# -- the run -----------------------------------------------------------------------------------------------------


class ChurnSoak:
    """One federation under the cycles of the module docstring: each act, and what the run's records say of it."""

    def __init__(self, fed: Federation, own_sources: Sequence[Path], kits: Path, overrides: Sequence[str]) -> None:
        self.fed, self.own_sources, self.kits, self.overrides = fed, list(own_sources), kits, list(overrides)
        self.watch = DigestWatch(CONFIGURED)
        self.log: list[dict[str, Any]] = []
        self.rss_mib: list[float] = []
        self.state_kib: list[int] = []
        self.run_dir_kib: list[int] = []

    def _wait(self, probe: Callable[[], bool], what: str) -> None:
        """Wait for `probe`, checking every synced θ against the commits while it waits."""
        self.fed.wait_for(lambda: (self.watch.observe(self.fed), probe())[1], WAIT_S, what, POLL_S)

    def _pushed(self, name: str, from_round: int) -> bool:
        return any(e["island"] == name and e["round"] >= from_round for e in self.fed.events("push"))

    def _saved(self, round_: int) -> bool:
        """Whether the coordinator's checkpoint holds round `round_`'s commit (its `checkpoint` event follows the
        save's end)."""
        return any(e["round"] >= round_ for e in self.fed.events("checkpoint"))

    def cycle(self, c: Cycle, last: bool) -> None:
        """Cycle `c`'s four acts (the module docstring), each at its stop or on an event it waits for."""
        fed, t0 = self.fed, time.monotonic()
        acts: dict[str, Any] = {"cycle": c.index, "victim": c.victim, "joiner": c.joiner}
        # 1: a joiner admitted, with its own source in even cycles; it pushes (the victim holds round b + 1 open).
        own = self.own_sources[(c.index // 2) % len(self.own_sources)] if c.index % 2 == 0 else None
        self.watch.follow(c.joiner)
        args = [f"data.own_path={own}"] if own else []
        admit_and_start(fed, c.joiner, self.kits, WAIT_S, args, pushed=True, poll_s=POLL_S)
        joiner_round = min(e["round"] for e in fed.events("push") if e["island"] == c.joiner)
        acts["own_source"] = own.name if own else None
        # 2: the victim SIGKILLed where it stands and started again with the same command line; round b + 1 closes
        # once the others, standing before their push of it, are let go.
        marker = fed.paused(c.victim_stop, WAIT_S)
        for entry in c.steady_stops(1):
            fed.paused(entry, WAIT_S)
        fed.kill(c.victim)
        fed.start_island(c.victim)
        for entry in c.steady_stops(1):
            fed.release(entry)
        self._wait(lambda: self._pushed(c.victim, marker["round"]), f"{c.victim} to push again after its kill")
        acts["victim_killed_at_round"] = marker["round"]
        # 3: the joiner retired once the round it pushed into is checkpointed (its work is part of the run for good).
        self._wait(lambda: self._saved(joiner_round), f"the checkpoint of round {joiner_round}")
        retire_and_wait(fed, c.joiner, "churn soak", WAIT_S)
        acts["joiner_pushed_in_round"] = joiner_round
        for entry in c.steady_stops(2):
            fed.paused(entry, WAIT_S)
            fed.release(entry)
        # 4: the coordinator sampled and SIGKILLed at its stop, and restarted (with another config in odd cycles).
        marker = fed.paused(c.coordinator_stop, WAIT_S)
        assert fed.coordinator is not None
        self.rss_mib.append(round(Sample.of(fed.coordinator.pid).rss_kib / 1024, 1))
        self.state_kib.append(state_kib(fed))
        self.run_dir_kib.append(disk_kib(fed.run_dir))
        fed.kill(COORDINATOR)
        acts["coordinator_killed_at"] = f"{c.coordinator_stop.split(':')[1]} of round {marker['round']}"
        if roster_changes(c.index, last):
            self._restart_changed(c, last)
            acts["restart"] = {"islands.names": list(fed.names), "train.rounds": fed.cfg.train.rounds}
        else:
            fed.start_coordinator()
        self.watch.observe(fed)
        acts["s"] = round(time.monotonic() - t0, 1)
        self.log.append(acts)

    def _restart_changed(self, c: Cycle, last: bool) -> None:
        """Every island stopped (SIGTERM), then the coordinator and the next roster's islands with the new config."""
        fed = self.fed
        running = [name for name, proc in fed.islands.items() if proc.poll() is None]
        for name in running:
            fed.signal(name, signal.SIGTERM)
        fed.wait_for(
            lambda: all(fed.islands[n].poll() is not None for n in running),
            WAIT_S,
            "the islands to stop",
            POLL_S,
            coordinator_needed=False,
        )
        names = FINAL_ROSTER if last else roster(c.index + 1)
        changed = [*self.overrides, f"islands.names={list(names)}", f"islands.count={len(names)}"]
        env = {}
        if last:
            changed.append(f"train.rounds={c.base + ROUNDS_PER_CYCLE + 1}")
            env = {ENV_AT: ",".join([fed.env[ENV_AT], *self.final_stops(c)])}
        fed.reconfigure(changed)
        fed.start_coordinator()
        for name in names:
            self.watch.follow(name)
            fed.start_island(name, env=env)

    @staticmethod
    def final_stops(c: Cycle) -> list[str]:
        """Where every island of the last rounds stops (before its push of the last round: an entry of that round
        alone, so no earlier stop's marker passes it) until all have joined: a round waits for no island that has not
        joined, and one that starts late would find the run over."""
        return [f"{name}:before_push:{c.base + ROUNDS_PER_CYCLE}" for name in FINAL_ROSTER]

    def finish(self, last: Cycle) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
        """The run to its end (its last round held until every island of it stands before its push): summary.json,
        and every process's exit code and last line once all have ended."""
        fed = self.fed
        fed.release_together(self.final_stops(last), WAIT_S)
        summary = fed.wait_done(WAIT_S * 2)
        procs = fed.processes()
        fed.wait_for(
            lambda: all(p.poll() is not None for p in procs.values()),
            WAIT_S,
            "every process to end",
            POLL_S,
            coordinator_needed=False,
        )
        exits = {name: {"rc": proc.returncode, "last_line": fed.last_line(name)} for name, proc in procs.items()}
        return summary, exits


def exits_explained(exits: dict[str, dict[str, Any]]) -> bool:
    """Every process ended by itself: code 0 with a last line, or a user error's code with its one line."""
    return all(
        bool(e["last_line"]) and (e["rc"] == 0 or (e["rc"] > 0 and e["last_line"].startswith("diloco: error:")))
        for e in exits.values()
    )


@dataclass(frozen=True)
class ChurnPlan:
    """How long the soak runs (`cycles`, or until `minutes` have passed), its warm-up and seed."""

    cycles: int | None = None
    minutes: float | None = None
    warm_up: int = WARM_UP_CYCLES
    seed: int = 0

    def __post_init__(self) -> None:
        if (self.cycles is None) == (self.minutes is None):
            raise BenchError("give one of --cycles N and --minutes M")
        if self.cycles is not None and self.cycles < 2:
            raise BenchError(f"--cycles must be >= 2: an odd cycle changes the roster (got {self.cycles})")
        if self.minutes is not None and self.minutes <= 0:
            raise BenchError(f"--minutes must be > 0 (got {self.minutes})")
        if self.warm_up < 0 or (self.cycles is not None and self.warm_up >= self.cycles):
            raise BenchError(f"--warm-up must be in [0, cycles) (got {self.warm_up})")

    @property
    def most_cycles(self) -> int:
        """The cycles whose stops the processes are started with."""
        if self.cycles is not None:
            return self.cycles
        assert self.minutes is not None
        return max(2, int(self.minutes * CYCLES_PER_MINUTE) + 1)

    def last(self, cycle: int, t0: float) -> bool:
        """Whether `cycle` is the run's last."""
        if self.minutes is not None and time.monotonic() - t0 >= self.minutes * 60:
            return cycle >= 1  # at least one cycle that changes the roster
        return cycle == self.most_cycles - 1


def run_churn_soak_bench(plan: ChurnPlan, run_dir: Path, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """The churn soak (module docstring) in `run_dir`; its figures and verdict as one JSON-able dict. `overrides`
    (key=value) change its config (the roster and train.rounds are the benchmark's)."""
    t0 = time.monotonic()
    data = run_dir / "data"
    data.mkdir(parents=True, exist_ok=True)
    corpus = data / "corpus.txt"
    corpus.write_bytes(text_bytes(CORPUS_BYTES, plan.seed))
    own_sources = []
    for i in range(2):
        own_sources.append(data / f"own-{i}.txt")
        own_sources[-1].write_bytes(text_bytes(OWN_BYTES, plan.seed + 1 + i))
    config = run_dir / "churn-soak.toml"
    config.write_text(churn_config_text(corpus, plan.seed))
    stops = [entry for k in range(plan.most_cycles) for entry in Cycle(k).stops()]
    os.environ[OPERATOR_ENV] = secrets.token_hex(32)  # the operator's calls and the coordinator resolve it
    cycles = 0
    # Restarted processes load their compiled steps from a cache: the user's, or one of the run's own.
    jax_cache = None if os.environ.get("JAX_COMPILATION_CACHE_DIR") else run_dir / "jax-cache"
    with _federation(config, overrides, run_dir / "run", pause_at=stops, jax_cache=jax_cache) as fed:
        soak = ChurnSoak(fed, own_sources, run_dir / "kits", overrides)
        fed.start()
        while True:
            last = plan.last(cycles, t0)
            soak.cycle(Cycle(cycles), last)
            cycles += 1
            if last:
                break
        summary, exits = soak.finish(Cycle(cycles - 1))
        digests = soak.watch.final(fed, fed.cfg.train.rounds)
        events = fed.events()
    audit = chunk_audit(events)
    sources = summary.get("sequences_by_source") or {}
    exactly_once = (
        audit["sequences_repeated"] == 0
        and audit["sequences_lost"] == 0
        and all(s["sequences_repeated"] == 0 and s["sequences_lost"] == 0 for s in audit["by_source"].values())
        and summary.get("sequences_repeated") == 0
        and summary.get("sequences_lost") == 0
    )
    digests_ok = (
        digests["digest_mismatches"] == 0
        and digests["live_digest_mismatches"] == 0
        and digests["island_digest_mismatch_events"] == 0
        and digests["commit_sequence_ok"]
    )
    rss = bounded(soak.rss_mib, plan.warm_up, RSS_BOUND)
    disk = bounded(soak.state_kib, plan.warm_up, DISK_BOUND)
    explained = exits_explained(exits)
    return {
        "bench": "churn-soak",
        "plan": {"cycles": plan.cycles, "minutes": plan.minutes, "warm_up": plan.warm_up, "seed": plan.seed},
        "run_dir": str(run_dir),
        "wall_s": round(time.monotonic() - t0, 1),
        "cycles": cycles,
        "cycle_log": soak.log,
        "rounds_committed": digests["rounds_committed"],
        "islands_admitted": sum(e["event"] == "island_admitted" for e in events),
        "islands_retired": sum(e["event"] == "island_retired" for e in events),
        "coordinator_resumes": sum(e["event"] == "resumed" for e in events),
        "config_changes": [e["changes"] for e in events if e["event"] == "config_changed"],
        "chunks": audit,
        "summary_sequences": {k: summary.get(k) for k in CONSUMPTION_KEYS},
        "summary_sources": sorted(sources),
        "exactly_once": exactly_once,
        "digests": digests,
        "digests_ok": digests_ok,
        "exits": exits,
        "exits_explained": explained,
        "coordinator_rss_mib": soak.rss_mib,
        "rss": rss,
        "state_kib": soak.state_kib,
        "disk": disk,
        "run_dir_kib": {
            "per_cycle": soak.run_dir_kib,
            "first": soak.run_dir_kib[0],
            "last": soak.run_dir_kib[-1],
            "max": max(soak.run_dir_kib),
        },
        "final_eval_loss": summary.get("final_eval_loss"),
        "passed": exactly_once and digests_ok and explained and rss["within_bound"] and disk["within_bound"],
    }
