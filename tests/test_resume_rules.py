"""A resumed run may change its length, roster, quorum, links and logging, never its model, data or seed; a run
lengthened with the warmup-stable-decay schedule ends where one planned that long does."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from diloco.config import RunConfig, load_config
from diloco.run.resume_rules import MAY_CHANGE, ResumeRefused, may_change, resume_changes
from diloco.run.rundir import RunDir, RunDirError, read_events
from diloco.simulator.simulate import run_simulation
from islands.config import InnerConfig
from islands.inner import learning_rate_schedule

README = Path(__file__).resolve().parents[1] / "README.md"


@pytest.mark.parametrize(
    ("key", "allowed"),
    [
        ("train.rounds", True),
        ("quorum.min_islands", True),  # a whole section
        ("network.links", True),
        ("islands.names", True),
        ("inner.decay_start_step", True),
        ("init.from", True),
        ("run.seed", False),
        ("model.d_model", False),
        ("data.path", False),
        ("inner.lr", False),  # the saved moments were taken under it
        ("codec.uplink", False),  # residuals are saved in its terms
        ("stream.fragments", False),
        ("train.inner_steps", False),
        ("islands.tensor", True),  # restored into the new layout
        ("islands.shard_params", False),
        ("a.key.nobody.knows", False),  # unknown keys are refused until someone decides
    ],
)
def test_the_table_decides_each_key(key: str, allowed: bool) -> None:
    assert may_change(key) is allowed


def test_changes_carry_old_and_new_values_and_refusals_name_every_key() -> None:
    stored = {"train": {"rounds": 8}, "quorum": {"min_islands": 2}, "run": {"seed": 0}, "model": {"d_model": 64}}
    resumed = {"train": {"rounds": 16}, "quorum": {"min_islands": 0.5}, "run": {"seed": 1}, "model": {"d_model": 32}}
    assert resume_changes(stored, resumed, ["quorum.min_islands", "train.rounds"]) == {
        "quorum.min_islands": [2, 0.5],
        "train.rounds": [8, 16],
    }
    with pytest.raises(ResumeRefused) as refused:
        resume_changes(stored, resumed, ["model.d_model", "run.seed", "train.rounds"])
    assert refused.value.keys == ["model.d_model", "run.seed"]


def test_a_file_key_changes_with_its_path_only_when_its_bytes_are_the_same() -> None:
    stored = {"data": {"tokenizer": "/old/ckpt/tokenizer.json"}, "init": {"from": "/old/ckpt"}}
    resumed = {"data": {"tokenizer": "/new/ckpt/tokenizer.json"}, "init": {"from": "/new/ckpt"}}
    differing = ["data.tokenizer", "init.from"]
    assert resume_changes(stored, resumed, differing, same_content={"data.tokenizer"}) == {
        "data.tokenizer": ["/old/ckpt/tokenizer.json", "/new/ckpt/tokenizer.json"],
        "init.from": ["/old/ckpt", "/new/ckpt"],
    }
    with pytest.raises(ResumeRefused) as refused:  # other bytes (or a file that cannot be read): another run
        resume_changes(stored, resumed, differing)
    assert refused.value.keys == ["data.tokenizer"]
    with pytest.raises(ResumeRefused):  # only the keys that name files are compared by content
        resume_changes({"data": {"path": "a"}}, {"data": {"path": "b"}}, ["data.path"], same_content={"data.path"})


def test_readme_shows_the_table_the_code_holds() -> None:
    text = README.read_text()
    section = text.split("### What a resumed run may change", 1)[1].split("**May not**", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    documented = {key for row in rows for key in re.findall(r"`([a-z_.]+)`", row.split("|")[1])}
    assert documented == set(MAY_CHANGE)


def _cfg(tiny_config: Path, *overrides: str) -> RunConfig:
    return load_config(tiny_config, list(overrides))


def test_a_permitted_change_is_logged_and_written_back(tiny_config: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    rd = RunDir(run_dir, _cfg(tiny_config), role="test")
    rd.log("round", round=1)  # the run has started (a run that saved nothing is started afresh instead)
    rd.close()
    resumed = RunDir(run_dir, _cfg(tiny_config, "train.rounds=9", "quorum.min_islands=0.5"), role="test")
    resumed.close()
    [changed] = read_events(run_dir / "metrics.jsonl", "config_changed")
    assert changed["changes"] == {"quorum.min_islands": [1, 0.5], "train.rounds": [3, 9]}
    stored = tomllib.loads((run_dir / "config.toml").read_text())
    assert stored["train"]["rounds"] == 9 and stored["quorum"]["min_islands"] == 0.5
    # The same config again changes nothing and logs nothing.
    RunDir(run_dir, _cfg(tiny_config, "train.rounds=9", "quorum.min_islands=0.5"), role="test").close()
    assert len(read_events(run_dir / "metrics.jsonl", "config_changed")) == 1


def test_a_forbidden_change_is_refused_and_leaves_the_run_as_it_was(tiny_config: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    rd = RunDir(run_dir, _cfg(tiny_config), role="test")
    rd.log("round", round=1)  # the run has started: a config that differs is not a corrected first attempt
    rd.close()
    before = (run_dir / "config.toml").read_text()
    with pytest.raises(RunDirError) as refused:
        RunDir(run_dir, _cfg(tiny_config, "train.rounds=9", "model.d_model=64", "run.seed=3"), role="test")
    message = str(refused.value)
    assert (
        "(config differs in: model.d_model, run.seed)" in message
        and "may not change" in message
        and "train.rounds" not in message
    )
    assert (run_dir / "config.toml").read_text() == before
    assert not read_events(run_dir / "metrics.jsonl", "config_changed")


@pytest.mark.slow
def test_wsd_before_its_decay_does_not_depend_on_the_planned_length() -> None:
    held = InnerConfig(lr=1.0, warmup_steps=4, schedule="wsd", min_lr_ratio=0.1)
    short, long = learning_rate_schedule(held, 40), learning_rate_schedule(held, 400)
    assert [float(short(s)) for s in range(60)] == [float(long(s)) for s in range(60)]
    assert float(short(2)) == 0.5 and float(short(300)) == 1.0  # warmup, then the peak held past the plan
    decaying = InnerConfig(lr=1.0, warmup_steps=4, schedule="wsd", min_lr_ratio=0.1, decay_start_step=10, decay_steps=4)
    rates = [round(float(learning_rate_schedule(decaying, 1000)(s)), 4) for s in (9, 10, 12, 14, 500)]
    assert rates == [1.0, 1.0, 0.55, 0.1, 0.1]
    to_the_end = InnerConfig(lr=1.0, warmup_steps=0, schedule="wsd", min_lr_ratio=0.0, decay_start_step=10)
    assert float(learning_rate_schedule(to_the_end, 20)(15)) == pytest.approx(0.5)


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["inner.schedule=linear"], "inner.schedule must be one of cosine, wsd"),
        (["inner.decay_start_step=10"], 'apply to inner.schedule = "wsd" only'),
        (["inner.schedule=wsd", "inner.decay_start_step=1"], "must be >= inner.warmup_steps"),
        (["inner.schedule=wsd", "inner.decay_steps=-1"], "must be >= 0"),
    ],
)
def test_bad_schedules_are_one_line(
    overrides: list[str], expected: str, tiny_config: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.conftest import fails

    fails(capsys, ["simulate", str(tiny_config), *overrides], expected)


@pytest.mark.slow
def test_a_run_lengthened_from_4_to_8_rounds_ends_as_one_planned_for_8(tiny_config: Path, tmp_path: Path) -> None:
    wsd = ["inner.schedule=wsd", "train.inner_steps=2", "train.eval_batches=1"]
    decay = ["inner.decay_start_step=12", "inner.decay_steps=4"]  # rounds 6 to 8
    planned = run_simulation(_cfg(tiny_config, *wsd, *decay, "train.rounds=8"), tmp_path / "planned", False)
    first = run_simulation(_cfg(tiny_config, *wsd, "train.rounds=4"), tmp_path / "grown", False)
    grown = run_simulation(_cfg(tiny_config, *wsd, *decay, "train.rounds=8"), tmp_path / "grown", False)
    assert first["rounds"] == 4 and grown["rounds"] == planned["rounds"] == 8
    assert grown["params_digest"] == planned["params_digest"] != first["params_digest"]
    [changed] = read_events(tmp_path / "grown" / "metrics.jsonl", "config_changed")
    assert changed["changes"]["train.rounds"] == [4, 8]
    assert changed["changes"]["inner.decay_start_step"] == [0, 12]
    # The cosine schedule stretches over the new length: a lengthened run ends elsewhere, as README says.
    cosine = ["train.inner_steps=2", "train.eval_batches=1"]
    cosine_planned = run_simulation(_cfg(tiny_config, *cosine, "train.rounds=4"), tmp_path / "cosine4", False)
    run_simulation(_cfg(tiny_config, *cosine, "train.rounds=2"), tmp_path / "cosine", False)
    stretched = run_simulation(_cfg(tiny_config, *cosine, "train.rounds=4"), tmp_path / "cosine", False)
    assert stretched["params_digest"] != cosine_planned["params_digest"]
