"""`diloco bench elastic`: the elastic federation's scenario, end to end, over real processes and real gRPC.

A federation starts with the config's two islands, A and B, and goes through every change of roster the system
promises to survive (docs/architecture.md, "Elastic federation"), each at a named pause point of one of its
processes (diloco/faults.py) or once an event it waits for is in the run's records, so the scenario is the same on a
fast machine and on a loaded one:

    round 1   A stops before its push; the operator admits JOINERS[0] (`admit_island`, with the operator's
              credential over gRPC); it starts with its own secret and joins while the round is open
    round 2   the same for JOINERS[1]
    round 5   A stops; once JOINERS[0] has pushed (its push still counts), the operator retires it: its process is
              refused and ends with code 2; round 5 is the one with all four islands
    round 6   A stops; JOINERS[1] is SIGKILLed for good and stays away: once the coordinator has retired it after
              islands.retire_after_s, A goes on
    end       the run ends at train.rounds; it is then lengthened: coordinator, A and B start again on the same
              run directories with train.rounds + EXTRA_ROUNDS and the warmup-stable-decay decay started over the
              extra rounds (a change README's "What a resumed run may change" permits), each holding its first push
              until both have joined
    R + 1     (R = train.rounds) B stops before its push and is SIGKILLed there; the round closes without it; B
              starts again, resumes from its own checkpoint and rejoins while A stops before its push of round
              R + 2 (so B is back for round R + 3 however long its start takes); the run goes on to its new end

No act waits for a time. A round closes only when every live island has pushed (no deadline: `_check_config` asks
for quorum.min_deadline_s = inf), so a round held at a pause never closes without
the island that holds it. The one rule that reads a clock, retirement after islands.retire_after_s, is met by
JOINERS[1] alone, while A holds round 6 and the scenario waits for the `island_retired` record; no other island is
absent while the first run goes on (a joiner is not absent before its first join). B's kill and return come in the
lengthened run, which sets islands.retire_after_s = 0 (a resumed run may: never retired for absence), so a restart
slowed by a loaded machine is never retired for being slow.

What is checked, from the run's own records (the metrics.jsonl of the coordinator and of every island):

* every round committed once, in order, across the lengthening;
* every θ an island adopted (`synced`) has the digest of the coordinator's commit it came from, for all four islands
  (the joiners, the one that came back) and in both phases;
* the roster's history: two admitted, one retired by the operator, one by timeout; B's pushes after its return;
* with `data.sampling = "chunks"` (configs/elastic.toml), from the `chunks_consumed` records of the committed rounds
  (diloco/run/chunk_ledger.py, `ConsumptionCheck`): no sequence consumed twice in a pass, none skipped (the spans
  a killed island read and never pushed, and a retired or lost island's chunks, are read again by others), and the
  first pass over the corpus read whole;
* the final eval loss against a fixed-roster run (A and B, `diloco simulate`, no faults) of as many tokens with the
  same schedule shape: within ELASTIC_TOLERANCE.

Run: ``diloco bench elastic configs/elastic.toml [--run-dir DIR] [key=value ...]``; prints JSON. A process that fails
or a wait that runs past its bound ends the benchmark with a BenchError naming the log directory.
"""

from __future__ import annotations

import math
import os
import secrets
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from diloco.bench.errors import BenchError
from diloco.bench.roster_acts import OPERATOR_ENV, admit_and_start, chunk_audit, retire_and_wait
from diloco.config import RunConfig, load_config
from diloco.harness.procs import Federation, FederationError
from diloco.run.rundir import read_events

JOINERS = ("sa-east", "af-south")
"""The islands the operator admits while the run goes on (not in the config)."""
EXTRA_ROUNDS = 4
"""Rounds added when the run is lengthened on resume; the learning rate decays over them. B is killed before its
push of the second and pushes again by the fourth (the module docstring), so at least 4."""
ELASTIC_TOLERANCE = 0.02
"""The issue's bound on |L_elastic - L_fixed| / L_fixed, at the same total tokens."""
WAIT_S = 300.0
"""The bound on any one wait of the scenario: for a run that hangs, never the measure of one that is merely slow."""


def _check_config(cfg: RunConfig) -> None:
    names = cfg.islands.island_names
    if len(names) != 2:
        raise BenchError(f"bench elastic starts from 2 configured islands (islands.count = {len(names)})")
    if cfg.train.rounds < 8:
        raise BenchError(f"bench elastic acts up to round 6 and needs train.rounds >= 8 (got {cfg.train.rounds})")
    if cfg.islands.max < 4 or cfg.islands.retire_after_s <= 0:
        raise BenchError("bench elastic needs islands.max >= 4 and islands.retire_after_s > 0 (configs/elastic.toml)")
    if not math.isinf(cfg.quorum.min_deadline_s):
        raise BenchError(
            "bench elastic holds rounds at named points: quorum.min_deadline_s = quorum.max_deadline_s = inf, or a "
            f"held round closes at its deadline (got {cfg.quorum.min_deadline_s:g}; configs/elastic.toml)"
        )
    if cfg.inner.schedule != "wsd" or cfg.inner.decay_start_step:
        raise BenchError('bench elastic lengthens the run: inner.schedule = "wsd" with its decay not started')
    if cfg.network.operator_secret != f"env:{OPERATOR_ENV}":
        raise BenchError(f"bench elastic gives the operator's secret in {OPERATOR_ENV}: network.operator_secret")


def _decay(cfg: RunConfig, rounds: int, decay_rounds: int) -> list[str]:
    """Overrides that end a run of `rounds` rounds with a decay over its last `decay_rounds`."""
    H = cfg.train.inner_steps
    return [
        f"train.rounds={rounds}",
        f"inner.decay_start_step={(rounds - decay_rounds) * H}",
        f"inner.decay_steps={decay_rounds * H}",
    ]


class Scenario:
    """The elastic run's processes and the operator's acts on them (the module docstring's timeline)."""

    def __init__(self, config: str | Path, overrides: Sequence[str], run_dir: Path) -> None:
        self.config, self.overrides, self.run_dir = str(config), list(overrides), run_dir
        self.cfg = load_config(config, overrides)
        self.a, self.b = self.cfg.islands.island_names
        self.env = {OPERATOR_ENV: secrets.token_hex(32), "JAX_PLATFORMS": "cpu"}
        self.kits = run_dir / "kits"
        self.acts: dict[str, float] = {}
        """Wall seconds of each act, from its pause to its effect being seen."""

    def _federation(self, extra: Sequence[str], pause_at: Sequence[str] = ()) -> Federation:
        return Federation(
            self.config, [*self.overrides, *extra], self.run_dir / "elastic", env=self.env, pause_at=pause_at
        )

    def _admit(self, fed: Federation, name: str) -> None:
        t0 = time.monotonic()
        admit_and_start(fed, name, self.kits, WAIT_S)
        self.acts[f"admit_{name}_s"] = round(time.monotonic() - t0, 2)

    def _kill_and_return(self, fed: Federation, pause: str) -> None:
        """SIGKILL B where it stands at `pause` and start it again; back once the coordinator records its join."""
        fed.paused(pause, WAIT_S)
        t0 = time.monotonic()
        joins = len(fed.events("island_joined"))  # B's join is the next one
        fed.kill(self.b)
        fed.start_island(self.b)
        fed.wait_for(
            lambda: any(e["island"] == self.b for e in fed.events("island_joined")[joins:]), WAIT_S, f"{self.b} back"
        )
        self.acts["kill_and_return_s"] = round(time.monotonic() - t0, 2)

    def _retire(self, fed: Federation, name: str) -> None:
        t0 = time.monotonic()
        retire_and_wait(fed, name, "region closed", WAIT_S)
        self.acts["retire_s"] = round(time.monotonic() - t0, 2)

    def _lose(self, fed: Federation, name: str) -> None:
        t0 = time.monotonic()
        fed.kill(name)
        fed.wait_for(
            lambda: any(e["island"] == name for e in fed.events("island_retired")), WAIT_S, f"{name} retired by timeout"
        )
        self.acts["lost_until_retired_s"] = round(time.monotonic() - t0, 2)

    def first_phase(self) -> None:
        """The run to train.rounds, with every change of roster at its round (the module docstring)."""
        a = self.a
        pauses = [f"{a}:before_push:{r}" for r in (1, 2, 5, 6)]
        # Both islands hold their first push until both are there: on a loaded host one that starts late joins as a
        # late joiner, rounds behind, while the other closes the first rounds alone.
        first = [f"{name}:before_push:0" for name in (self.a, self.b)]
        with self._federation([], [*first, *pauses]) as fed:
            fed.start()
            fed.release_together(first, WAIT_S)
            for joiner, pause in zip(JOINERS, pauses[:2], strict=True):
                fed.paused(pause, WAIT_S)
                self._admit(fed, joiner)
                fed.release(pause)
            fed.paused(pauses[2], WAIT_S)
            # Its push of round 5 is in before it is retired (it still counts): round 5 holds all four islands.
            fed.wait_for(
                lambda: any(e["round"] == 5 and e["island"] == JOINERS[0] for e in fed.events("push")),
                WAIT_S,
                f"{JOINERS[0]}'s push of round 5",
            )
            self._retire(fed, JOINERS[0])
            fed.release(pauses[2])
            fed.paused(pauses[3], WAIT_S)
            self._lose(fed, JOINERS[1])
            fed.release(pauses[3])
            for name in JOINERS:
                fed.others.pop(name)  # ended as the scenario meant: not part of the run's clean end
            fed.wait_done(WAIT_S * 2)
            fed.wait_exit(WAIT_S)

    @property
    def kill_round(self) -> int:
        """The round B is SIGKILLed before its push of: the lengthened run's second."""
        return self.cfg.train.rounds + 1

    def lengthen(self) -> dict[str, Any]:
        """Resume the finished run with EXTRA_ROUNDS more, the decay started over them, B killed and back in them;
        its summary. islands.retire_after_s = 0 from here on: no island is retired for its absence, however long
        B's restart takes."""
        rounds, k = self.cfg.train.rounds + EXTRA_ROUNDS, self.kill_round
        # A round does not wait for an island that has not joined: each holds its first push until both have, or
        # the first one back could close the resumed rounds alone.
        held = [f"{name}:before_push:{self.cfg.train.rounds}" for name in (self.a, self.b)]
        killed, waiting = f"{self.b}:before_push:{k}", f"{self.a}:before_push:{k + 1}"
        extra = [*_decay(self.cfg, rounds, EXTRA_ROUNDS), "islands.retire_after_s=0"]
        with self._federation(extra, [*held, killed, waiting]) as fed:
            fed.start()
            resumed = self.cfg.train.rounds  # the first run's joins are in the records too, at earlier rounds
            fed.wait_for(
                lambda: {self.a, self.b} <= {e["island"] for e in fed.events("island_joined") if e["round"] >= resumed},
                WAIT_S,
                "both islands to join the lengthened run",
            )
            for entry in held:
                fed.release(entry)
            self._kill_and_return(fed, killed)
            fed.release(waiting)  # B is back: round k + 1 may close (B pushes from round k + 2 on)
            summary = fed.wait_done(WAIT_S * 2)
            fed.wait_exit(WAIT_S)
        return summary


def _digests_checked(run_dir: Path, events: Sequence[dict[str, Any]], islands: Sequence[str]) -> dict[str, int]:
    """For each island, how many θ it adopted (`synced`), each checked against the coordinator's commit (`events`:
    the coordinator's records)."""
    after = {r["round"] + 1: r["digest"] for r in events if r["event"] == "round"}
    checked: dict[str, int] = {}
    theta_0: set[str] = set()  # θ_0 is no commit: every island that pulled it must hold the same one
    for name in islands:
        synced = read_events(run_dir / "islands" / name / "metrics.jsonl", "synced")
        theta_0 |= {s["digest"] for s in synced if s["round"] == 0}
        wrong = [s for s in synced if s["round"] > 0 and s["digest"] != after.get(s["round"])]
        if wrong:
            raise BenchError(f"island {name} adopted θ that is not the coordinator's: {wrong[0]}")
        checked[name] = len(synced)
    if len(theta_0) > 1:
        raise BenchError(f"the islands started from different θ_0: {sorted(theta_0)}")
    return checked


def _roster_history(events: Sequence[dict[str, Any]], a: str, b: str, kill_round: int) -> dict[str, Any]:
    rounds = [e for e in events if e["event"] == "round"]
    if [r["round"] for r in rounds] != list(range(len(rounds))):
        raise BenchError(f"committed rounds are not 0..N-1 once each: {[r['round'] for r in rounds]}")
    retired = {e["island"]: e["reason"] for e in events if e["event"] == "island_retired"}
    admitted = [e["island"] for e in events if e["event"] == "island_admitted"]
    changed = [e["changes"] for e in events if e["event"] == "config_changed"]
    history = {
        "rounds": len(rounds),
        "islands_per_round": [len(r["islands"]) for r in rounds],
        "admitted": admitted,
        "retired": retired,
        "config_changed": changed,
        "b_back_in_rounds": [r["round"] for r in rounds if r["round"] > kill_round and b in r["islands"]],
        "a_in_every_round": all(a in r["islands"] for r in rounds),
    }
    problems = []
    if admitted != list(JOINERS):
        problems.append(f"admitted {admitted}")
    if set(retired) != set(JOINERS) or "retire_after_s" not in retired.get(JOINERS[1], ""):
        problems.append(f"retired {retired}")
    if not history["b_back_in_rounds"]:
        problems.append(f"{b} never pushed again after its return")
    if not changed or changed[-1].get("train.rounds", [0, 0])[1] != len(rounds):
        problems.append(f"the lengthening is not logged as config_changed: {changed}")
    if problems:
        raise BenchError("the elastic run's records disagree with the scenario: " + "; ".join(problems))
    return history


def _fixed_roster(config: str | Path, overrides: Sequence[str], run_dir: Path, tokens: int) -> dict[str, Any]:
    """`simulate` of the config's two islands, no faults, for the rounds that come closest to `tokens`, the decay
    over the same share of the run as the elastic one's."""
    from diloco.simulator.simulate import run_simulation

    cfg = load_config(config, overrides)
    per_round = 2 * cfg.train.inner_steps * cfg.train.batch_size * cfg.model.seq_len
    rounds = max(EXTRA_ROUNDS + 1, round(tokens / per_round))
    decay_rounds = max(1, round(rounds * EXTRA_ROUNDS / (cfg.train.rounds + EXTRA_ROUNDS)))
    return run_simulation(load_config(config, [*overrides, *_decay(cfg, rounds, decay_rounds)]), run_dir, False)


def run_elastic_bench(config: str | Path, overrides: Sequence[str], run_dir: Path) -> dict[str, Any]:
    """The scenario, its checks and the fixed-roster comparison, as one JSON-able dict."""
    scenario = Scenario(config, overrides, run_dir)
    _check_config(scenario.cfg)
    t0 = time.monotonic()
    try:
        os.environ[OPERATOR_ENV] = scenario.env[OPERATOR_ENV]  # the operator's calls resolve the env: reference
        scenario.first_phase()
        summary = scenario.lengthen()
    except FederationError as exc:
        raise BenchError(f"the elastic federation failed ({run_dir / 'elastic' / 'logs'}): {exc}") from None
    wall_s = time.monotonic() - t0
    elastic_dir = run_dir / "elastic"
    events = read_events(elastic_dir / "metrics.jsonl")  # the coordinator's records, read once for every check
    history = _roster_history(events, scenario.a, scenario.b, scenario.kill_round)
    checked = _digests_checked(elastic_dir, events, [scenario.a, scenario.b, *JOINERS])
    audit = chunk_audit(events) if scenario.cfg.data.sampling == "chunks" else None
    fixed = _fixed_roster(config, overrides, run_dir / "fixed", summary["tokens"])
    a, b = summary["final_eval_loss"], fixed["final_eval_loss"]
    rel = abs(a - b) / abs(b) if b and math.isfinite(a) and math.isfinite(b) else math.inf
    exactly_once = audit is None or (
        audit["sequences_repeated"] == 0 and audit["sequences_lost"] == 0 and audit["complete_epochs"] >= 1
    )
    return {
        "bench": "elastic",
        "config": str(config),
        "overrides": list(overrides),
        "wall_s": round(wall_s, 1),
        "acts_s": scenario.acts,
        **history,
        "synced_checked": checked,
        "chunks": audit,
        "exactly_once": exactly_once,
        "tokens": summary["tokens"],
        "fixed_roster_rounds": fixed["rounds"],
        "fixed_roster_tokens": fixed["tokens"],
        "final_eval_loss_elastic": a,
        "final_eval_loss_fixed": b,
        "rel_diff": round(rel, 5),
        "tolerance": ELASTIC_TOLERANCE,
        "pass": rel <= ELASTIC_TOLERANCE and exactly_once,
    }
