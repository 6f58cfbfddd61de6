"""Churn by script (roster.events, docs/architecture.md "Churn by script"): the script's validation as a table of
cases, the changes each round opens with, `simulate` under churn (exactly-once under chunks), and `launch` of the
same script over real processes ending with simulate's parameter digest."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from diloco.config import ConfigError, load_config
from diloco.run.roster_script import RosterEvent, RoundChanges, changes_at, enrolled_at, leasing_at, rounds_changed
from tests.conftest import FAST, REPO, TINY_TOML, child_env, fails, write_corpus

pytestmark = pytest.mark.timeout(120)

CONFIGURED = ("island-0", "island-1")


def script(*events: str) -> str:
    """roster.events as an override: `script("{round=1, join='ap-1'}")`."""
    return f"roster.events=[{', '.join(events)}]"


@pytest.mark.parametrize(
    ("events", "expected"),
    [
        (['{round=1, jion="ap-1"}'], "unknown config key 'roster.events[0].jion' (did you mean 'roster.events[0].join'?)"),
        (["3"], "roster.events[0] must be a table (got 3)"),
        (['{round=1, retire="island-0", kill="island-1"}'], "roster.events[0] sets exactly one of join, retire, kill (got retire, kill)"),
        (["{round=1}"], "roster.events[0] sets exactly one of join, retire, kill (got none)"),
        (['{round=1, join="a b"}'], "roster.events[0].join must be an [A-Za-z0-9_-] name of 1 to 64 characters (got 'a b')"),
        (['{round=3, kill="island-0"}'], "roster.events[0].round must be a round of the run, 0 to 2 (got 3)"),
        (['{round=0, join="ap-1"}'], "roster.events[0]: an island that trains from round 0 is configured: list 'ap-1' in islands.names"),
        (['{round=1, join="island-1"}'], "roster.events[0] (round 1, join 'island-1'): 'island-1' is on the roster already at round 1"),
        (['{round=1, join="ap-1"}', '{round=1, join="ap-2"}'], "roster.events[1] (round 1, join 'ap-2'): 3 islands are enrolled at round 1, islands.max is 3"),
        (['{round=1, retire="ap-1"}'], "roster.events[0] (round 1, retire 'ap-1'): 'ap-1' is not on the roster at round 1"),
        (['{round=1, retire="island-0"}', '{round=2, kill="island-0"}'], "roster.events[1] (round 2, kill 'island-0'): 'island-0' is not on the roster at round 2"),
        (['{round=1, kill="island-0"}', '{round=2, retire="island-0"}'], "roster.events[1] (round 2, retire 'island-0'): 'island-0' comes back at round 2 from its kill at round 1"),
        (['{round=1, join="ap-1"}', '{round=1, kill="ap-1"}'], "roster.events[1] (round 1, kill 'ap-1'): 'ap-1' already joins at round 1: one event per island and round"),
        (['{round=0, kill="island-0"}', '{round=0, retire="island-1"}'], "roster.events: no island pushes in round 0 (every island is retired or killed there)"),
    ],
)  # fmt: skip
def test_a_bad_script_is_one_line_naming_the_event(tiny_config: Path, events: list[str], expected: str) -> None:
    with pytest.raises(ConfigError) as refused:
        load_config(tiny_config, ["islands.max=3", script(*events)])
    assert str(refused.value) == expected


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("train.mode=async", "roster.events changes the roster between DiLoCo rounds"),
        ("stream.fragments=2", "without streaming"),
        ("train.vectorize=true", "or train.vectorize"),
    ],
)
def test_a_script_needs_plain_diloco_rounds(tiny_config: Path, override: str, expected: str) -> None:
    with pytest.raises(ConfigError, match=expected):
        load_config(tiny_config, [override, script('{round=1, kill="island-0"}')])


def test_a_script_is_no_part_of_the_runs_identity(tiny_config: Path) -> None:
    from diloco.config import config_digest, to_dict

    scripted = load_config(tiny_config, [script('{round=1, kill="island-0"}')])
    assert "roster" not in to_dict(scripted)
    assert config_digest(scripted) == config_digest(load_config(tiny_config))


def test_each_round_opens_with_the_scripts_changes() -> None:
    events = (
        RosterEvent(round=2, retire="island-1"),
        RosterEvent(round=1, join="ap-1"),
        RosterEvent(round=2, kill="island-0"),
        RosterEvent(round=1, join="ap-2"),
    )
    assert changes_at(events, 0) == RoundChanges() and not changes_at(events, 0)
    assert changes_at(events, 1) == RoundChanges(joins=("ap-1", "ap-2"))
    assert changes_at(events, 2) == RoundChanges(retires=("island-1",), kills=("island-0",))
    assert changes_at(events, 3) == RoundChanges(restarts=("island-0",))
    assert enrolled_at(events, CONFIGURED, 2) == ["island-0", "ap-1", "ap-2"]
    assert rounds_changed(events) == [1, 2, 3]
    # Leases: the roster as the round opens (leavers included) by enrolment, then who comes back, then who joins.
    assert leasing_at(events, CONFIGURED, 0) == ["island-0", "island-1"]
    assert leasing_at(events, CONFIGURED, 1) == ["island-0", "island-1", "ap-1", "ap-2"]
    assert leasing_at(events, CONFIGURED, 2) == ["island-0", "island-1", "ap-1", "ap-2"]
    assert leasing_at(events, CONFIGURED, 3) == ["ap-1", "ap-2", "island-0"]
    rejoin = (RosterEvent(round=1, retire="island-0"), RosterEvent(round=2, join="island-0"))
    assert leasing_at(rejoin, CONFIGURED, 1) == ["island-0", "island-1"]
    assert leasing_at(rejoin, CONFIGURED, 2) == ["island-1", "island-0"]


def test_a_scripted_launch_under_chunks_orders_every_rounds_leases(tiny_config: Path) -> None:
    from diloco.harness.roster_driver import held_entries

    events = ['{round=1, join="ap-1"}', '{round=2, kill="island-0"}']
    windows = held_entries(load_config(tiny_config, ["islands.max=3", script(*events)]))
    assert windows == [f"{n}:before_push:{r}" for r, names in [(0, CONFIGURED), (1, CONFIGURED),
                       (2, ["island-0", "island-1", "ap-1"])] for n in names]  # fmt: skip
    chunks = held_entries(load_config(tiny_config, ["islands.max=3", "data.sampling=chunks", script(*events)]))
    assert chunks == windows + [f"{n}:before_lease:{r}" for r, names in [(0, CONFIGURED), (1, [*CONFIGURED, "ap-1"]),
                                (2, [*CONFIGURED, "ap-1"])] for n in names]  # fmt: skip
    # without a script nothing would release a stop: a plain launch holds no island anywhere
    assert held_entries(load_config(tiny_config, ["data.sampling=chunks"])) == []


def test_the_cli_refuses_a_bad_script_and_a_scripted_resume(
    tiny_config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    fails(capsys, ["simulate", str(tiny_config), "--run-dir", str(run_dir), script('{round=1, retire="x"}')],
          "'x' is not on the roster at round 1")  # fmt: skip
    assert not run_dir.exists()
    run_dir.mkdir()
    (run_dir / "config.toml").write_text("")
    fails(capsys, ["simulate", str(tiny_config), "--run-dir", str(run_dir), script('{round=1, kill="island-0"}')],
          "simulate replays the script from round 0")  # fmt: skip
    fails(capsys, ["launch", str(tiny_config), "--run-dir", str(tmp_path / "l"), script('{round=1, kill="island-0"}')],
          "set network.operator_secret")  # fmt: skip
    for written, expected in [
        ("quorum.min_islands=1", "quorum.min_islands = 1 is set"),
        ("quorum.max_deadline_s=20", "quorum.max_deadline_s = 20.0 is set"),
        ("islands.retire_after_s=30", "islands.retire_after_s = 30.0 is set: remove it"),
    ]:
        fails(capsys, ["launch", str(tiny_config), "--run-dir", str(tmp_path / "l"), written,
                       script('{round=1, kill="island-0"}')], expected)  # fmt: skip
    assert not (tmp_path / "l").exists()
    fails(capsys, ["launch", str(tiny_config), "--run-dir", str(tmp_path / "l"), "network.operator_secret=env:OP",
                   "islands.processes=2", script('{round=1, kill="island-0"}')],
          "with islands.processes = 1")  # fmt: skip


def test_the_sweeps_scripts_are_valid_for_the_config_they_are_placed_by(tiny_config: Path) -> None:
    from dataclasses import replace

    from diloco.bench.roster_sweep import scripts
    from diloco.run.roster_script import RosterConfig

    cfg = load_config(tiny_config, ["train.rounds=6", "islands.max=3"])
    made = scripts(cfg)
    assert list(made) == ["none", "join", "retire", "kill", "churn"]
    for events in made.values():
        assert replace(cfg, roster=RosterConfig(events=events)).roster.events == events  # validated on construction
    assert list(scripts(load_config(tiny_config, ["train.rounds=3"]))) == ["none"]


CHURN = ['{round=1, join="ap-1"}', '{round=2, kill="island-0"}', '{round=3, retire="island-1"}']
"""A join, a kill and a retirement: rounds 1 to 4 hold three islands, two (island-0 killed), two (island-0 back,
island-1 retired) and two."""
RUN = [*(o for o in FAST if "deadline" not in o), "train.rounds=5", "islands.max=3", "quorum.lease_s=60",
       "network.operator_secret=env:DILOCO_TEST_OPERATOR"]  # fmt: skip
"""A scripted launch runs without round deadlines (launch.SCRIPTED), and refuses any it is given."""


def _rounds(run_dir: Path) -> dict[int, list[str]]:
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {e["round"]: e["islands"] for e in events if e["event"] == "round"}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_simulate_under_churn_reads_every_chunk_once(tiny_config: Path, tmp_path: Path) -> None:
    from diloco.simulator.simulate import run_simulation

    cfg = load_config(tiny_config, [*RUN, "data.sampling=chunks", script(*CHURN)])
    summary = run_simulation(cfg, tmp_path / "run", show_progress=False)
    assert _rounds(tmp_path / "run") == {
        0: ["island-0", "island-1"],
        1: ["ap-1", "island-0", "island-1"],
        2: ["ap-1", "island-1"],
        3: ["ap-1", "island-0"],
        4: ["ap-1", "island-0"],
    }
    assert summary["sequences_repeated"] == 0 and summary["sequences_lost"] == 0, summary
    assert summary["islands_admitted"] == 1 and summary["islands_retired"] == 1, summary


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
@pytest.mark.parametrize("sampling", ["windows", "chunks"])
def test_launch_of_a_script_ends_with_simulates_digest(tmp_path: Path, sampling: str) -> None:
    """The same script, `simulate` and `launch` side by side: launch admits ap-1 as the operator at round 1, SIGKILLs
    island-0's worker before its push of round 2 (its supervisor restarts it from its checkpoint), retires island-1
    at round 3; both end with one θ. Under chunks island-0's chunk, returned by its kill, goes to ap-1 in round 3 and
    island-1's, returned by its retirement, to island-0 back from its kill (roster_script.leasing_at): both runs
    record the same leases and consume the same sequences, none twice, none lost."""
    config = tmp_path / "tiny.toml"
    config.write_text(TINY_TOML.format(corpus=write_corpus(tmp_path / "corpus.txt")))
    args = [*RUN, f"data.sampling={sampling}", script(*CHURN), "--no-progress"]
    cli = [sys.executable, "-m", "diloco.cli"]
    env = {**child_env(jax_cache=True), "DILOCO_TEST_OPERATOR": "the-operators-secret"}
    procs = [
        subprocess.Popen([*cli, cmd, str(config), "--run-dir", str(tmp_path / cmd), *args], env=env, cwd=REPO,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
        for cmd in ("simulate", "launch")
    ]  # fmt: skip
    try:
        errors = [proc.communicate(timeout=540)[1] for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    assert [proc.returncode for proc in procs] == [0, 0], [e[-2000:] for e in errors]
    simulated, launched = (json.loads((tmp_path / cmd / "summary.json").read_text()) for cmd in ("simulate", "launch"))
    assert _rounds(tmp_path / "launch") == _rounds(tmp_path / "simulate")
    assert launched["params_digest"] == simulated["params_digest"]
    assert launched["islands_admitted"] == simulated["islands_admitted"] == 1
    assert launched["islands_retired"] == simulated["islands_retired"] == 1
    island0 = [json.loads(line) for line in (tmp_path / "launch" / "islands" / "island-0" / "metrics.jsonl").open()]
    assert any(e["event"] == "resumed" and e["round"] == 2 for e in island0), "island-0 did not resume its checkpoint"
    if sampling == "chunks":
        assert _leases(tmp_path / "launch") == _leases(tmp_path / "simulate")
        for key in ("sequences_consumed", "sequences_repeated", "sequences_lost", "sequences_unread"):
            assert launched[key] == simulated[key], (key, launched[key], simulated[key])
        assert launched["sequences_repeated"] == launched["sequences_lost"] == 0


def _leases(run_dir: Path) -> dict[int, dict[str, list[list[int]]]]:
    """The chunk spans each island's pushes were credited with, by round (`chunks_consumed` records)."""
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {e["round"]: e["spans"] for e in events if e["event"] == "chunks_consumed"}
