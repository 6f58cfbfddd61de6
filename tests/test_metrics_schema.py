"""docs/metrics.md documents metrics.jsonl: every event and field that real `simulate` runs write is in its tables,
and every event name the code logs has a section, so the document cannot silently fall behind the code."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from diloco.config import load_config
from diloco.run.rundir import read_events
from diloco.simulator.simulate import run_simulation
from tests.conftest import REPO

DOC = REPO / "docs" / "metrics.md"
PROCESSES = {"simulate", "coordinator", "island"}
RUNS = {
    "diloco": ["train.rounds=2"],
    "stream": ["train.rounds=2", "stream.fragments=2", "init.from={diloco}", "init.inner_state=true"],
    "async": ["train.mode=async", "train.rounds=3"],
    "sync": ["train.mode=sync", "train.rounds=2"],
    "chunks": ["data.sampling=chunks", "train.rounds=2", "stream.fragments=2"],  # a record per fragment
    "workloads": [
        "train.rounds=1",
        "islands.count=3",
        "workload.kind=dpo",
        "workload.task=addition",
        "workload.task_digits=2",
        "workload.heldout_examples=4",
        "workload.max_new_tokens=4",
        "workload.reward=builtin:addition",
        'workload.islands=["island-1=sft", "island-2=rl"]',
    ],
}
"""Tiny simulate runs between them writing every event `simulate` has: plain rounds, streaming `sync` commits, a
warm start (θ_0 and inner states), async annotations, the data-parallel baseline, chunked sampling's records (of
streaming syncs), and every post-training kind's held-out figures."""


@dataclass
class Schema:
    common: set[str] = field(default_factory=set)
    """The fields every event has (the "Every event" table)."""
    events: dict[str, set[str]] = field(default_factory=dict)
    """Event name -> its documented fields; a nested object's keys as `field.key`."""
    writers: dict[str, set[str]] = field(default_factory=dict)
    """Event name -> the processes its "Written by:" line names."""


def parse_doc(text: str) -> Schema:
    """The tables of docs/metrics.md: a `### \\`name\\`` heading opens an event, a row whose first cell is a
    backquoted name is one of its fields (before the first event heading: a field of every event)."""
    schema, current = Schema(), None
    for line in text.splitlines():
        heading = re.match(r"^### `(\w+)`\s*$", line)
        if heading:
            current = heading.group(1)
            assert current not in schema.events, f"event {current} documented twice"
            schema.events[current] = set()
            continue
        if line.startswith("## "):
            current = None
        row = re.match(r"^\|\s*`([\w.]+)`\s*\|", line)
        if row:
            (schema.events[current] if current else schema.common).add(row.group(1))
        written = re.match(r"^Written by: ([^.]*)\.", line)
        if written and current:  # "simulate (when ...), coordinator": the names, without the remarks in brackets
            schema.writers[current] = {w.strip() for w in re.sub(r"\([^)]*\)", "", written.group(1)).split(",")}
    return schema


def undocumented(record: dict[str, Any], schema: Schema) -> list[str]:
    """What of one metrics.jsonl record docs/metrics.md lacks: the event, or fields (`close_s.commit` for the keys of
    an object whose keys the doc lists; an object documented without keys is a map, e.g. island -> share)."""
    event = record.get("event")
    if event not in schema.events:
        return [f"event {event!r}"]
    documented = schema.events[event] | schema.common
    missing = []
    for key, value in record.items():
        if key not in documented:
            missing.append(f"{event}.{key}")
        elif isinstance(value, dict) and any(f.startswith(f"{key}.") for f in documented):
            missing += [f"{event}.{key}.{k}" for k in value if f"{key}.{k}" not in documented]
    return missing


@pytest.fixture(scope="module")
def schema() -> Schema:
    return parse_doc(DOC.read_text())


@pytest.mark.slow
def test_simulate_events_are_documented(schema: Schema, tiny_config: Path, tmp_path: Path) -> None:
    seen: set[str] = set()
    missing: set[str] = set()
    for name, overrides in RUNS.items():
        run_dir = tmp_path / name
        run_simulation(
            load_config(tiny_config, [o.format(diloco=tmp_path / "diloco") for o in overrides]),
            run_dir,
            show_progress=False,
        )
        for record in read_events(run_dir / "metrics.jsonl"):
            seen.add(record["event"])
            missing.update(undocumented(record, schema))
    assert not missing, f"docs/metrics.md lacks: {sorted(missing)}"
    # The runs really wrote what this test is meant to cover.
    assert {"eval", "round", "sync", "inner", "island_joined", "checkpoint", "warm_start", "chunks_consumed"} <= seen
    for event in seen:
        assert "simulate" in schema.writers[event], f"docs/metrics.md: {event} is written by simulate too"


def test_every_logged_event_has_a_section(schema: Schema) -> None:
    """Event names the code logs (`.log("name", ...)` anywhere in diloco/), also those no simulate run writes (the
    coordinator's and the islands'); and no section for an event the code no longer has."""
    logged = set()
    for path in (REPO / "diloco").rglob("*.py"):
        logged |= set(re.findall(r'\.log\(\s*"(\w+)"', path.read_text()))
    logged.add("sync")  # global_run.py logs `"round" if the round closed else "sync"`
    assert logged - set(schema.events) == set(), "events without a section in docs/metrics.md"
    assert set(schema.events) - logged == set(), "sections of docs/metrics.md for events no code logs"


def test_every_section_says_who_writes_it(schema: Schema) -> None:
    assert schema.common == {"event", "t"}
    for event, fields in schema.events.items():
        assert fields, f"docs/metrics.md: {event} has no field table"
        assert schema.writers.get(event) and schema.writers[event] <= PROCESSES, event


def test_undocumented_fields_are_reported() -> None:
    doc = "| `event` | str |\n### `round`\nWritten by: simulate (here).\n| `close_s` | object |\n| `close_s.eval` | float |"
    schema = parse_doc(doc)
    assert schema.writers == {"round": {"simulate"}}
    assert undocumented({"event": "round", "close_s": {"eval": 1.0}}, schema) == []
    assert undocumented({"event": "round", "new": 1, "close_s": {"x": 1}}, schema) == ["round.new", "round.close_s.x"]
    assert undocumented({"event": "nope"}, schema) == ["event 'nope'"]
