"""Config loading: TOML, dotted overrides, type and range checks, typo suggestions, the resolved file."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from diloco.config import (
    ConfigError,
    RunConfig,
    config_digest,
    diff_keys,
    dump_toml,
    from_dict,
    load_config,
    to_dict,
)
from islands.data import load_sources

REPO = Path(__file__).resolve().parent.parent


SHIPPED = ["tiny.toml", "local.toml", "faults.toml", "convergence.toml"]


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_configs_load(name: str) -> None:
    cfg = load_config(REPO / "configs" / name)
    assert cfg.outer.kind == "nesterov"
    assert cfg.data.path == "stdlib:"  # the built-in corpus: a fresh clone runs with no data files


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_configs_data_loads_on_a_fresh_clone(name: str) -> None:
    cfg = load_config(REPO / "configs" / name)
    n = len(cfg.islands.island_names)
    shards, val = load_sources(cfg.data, n, cfg.model.vocab_size, cfg.run.seed, cfg.model.seq_len, only={n - 1})
    assert len(shards[n - 1]) > 100_000 and len(val) > 100_000


def test_overrides_are_typed_and_nested() -> None:
    cfg = load_config(
        REPO / "configs" / "tiny.toml",
        ["outer.lr=0.5", "train.mode=sync", "islands.names=['a','b']", "data.path=/x/y.txt", "inner.lr=1e-3"],
    )
    assert cfg.outer.lr == 0.5
    assert cfg.train.mode == "sync"
    assert cfg.islands.names == ("a", "b")
    assert cfg.data.path == "/x/y.txt"
    assert cfg.inner.lr == pytest.approx(1e-3)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["outer.lrr=0.5"], "unknown config key 'outer.lrr' (did you mean 'outer.lr'?)"),
        (["trian.mode=sync"], "unknown config key 'trian' (did you mean 'train'?)"),
        (["outer.lr=abc"], "outer.lr must be a number (got 'abc')"),
        (["train.rounds=1.5"], "train.rounds must be an integer (got 1.5)"),
        (["train.rounds=0"], "train.rounds must be >= 1 (got 0)"),
        (
            ["outer.kind=rmsprop"],
            "outer.kind must be one of nesterov, sgd, adam, delayed_nesterov, sparseloco (got 'rmsprop')",
        ),
        (["train.mode=lockstep"], "train.mode must be 'diloco', 'sync' or 'async'"),
        (["islands.shard_params=1"], "islands.shard_params must be true or false (got 1)"),
        (["model.d_model=30"], "model.d_model"),
        (["outer=3"], "'outer' must be a table/section"),
        (["noequals"], "must look like section.key=value"),
        (["islands.count=3"], "islands.names has 2 names but islands.count is 3"),
        (["train.microbatch=5"], "train.batch_size (16) must be a multiple of train.microbatch (5)"),
        (["islands.regroup_wait_s=-1"], "islands.regroup_wait_s must be between 0 and 3600 seconds (got -1"),
    ],
)
def test_bad_values_name_the_key(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(REPO / "configs" / "tiny.toml", overrides)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_broken_and_missing_files(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\nrounds = 3")
    with pytest.raises(ConfigError, match="is not valid TOML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.toml")


def test_resolved_config_round_trips_through_toml() -> None:
    cfg = load_config(REPO / "configs" / "convergence.toml", ["outer.lr=0.3"])
    text = dump_toml(to_dict(cfg))
    again = from_dict(RunConfig, tomllib.loads(text))
    assert again == cfg
    assert config_digest(again) == config_digest(cfg)


def test_digest_and_diff_name_what_changed() -> None:
    a = load_config(REPO / "configs" / "tiny.toml")
    b = load_config(REPO / "configs" / "tiny.toml", ["outer.lr=0.1", "train.rounds=2"])
    assert config_digest(a) != config_digest(b)
    assert diff_keys(to_dict(a), to_dict(b)) == ["outer.lr", "train.rounds"]


def test_defaults_build_without_a_file() -> None:
    cfg = from_dict(RunConfig, {"data": {"kind": "synthetic"}})
    assert cfg.islands.island_names == ("island-0", "island-1")
    assert cfg.total_inner_steps == cfg.train.rounds * cfg.train.inner_steps


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("islands.names=[a,b]", ["a", "b"]),  # as a shell leaves `[a,b]`: bare words in a list are strings
        ("islands.names=[us-east, eu-west]", ["us-east", "eu-west"]),
        ('islands.names=["a","b"]', ["a", "b"]),
        ("islands.names=[]", []),
        ("outer.lr=0.5", 0.5),
        ("data.path=my.txt", "my.txt"),
        ("x.y=[a,[b]]", "[a,[b]]"),  # not a list of bare words: left as typed (its key then refuses it in one line)
    ],
)
def test_an_override_reads_as_toml_and_bare_words_as_strings(text: str, value: object) -> None:
    from diloco.config import parse_override

    assert parse_override(text)[1] == value
