"""A step too big for the machine is one line and exit code 2 before it runs (islands/memory.py); one that fits runs,
compiled once."""

from __future__ import annotations

import logging
import resource
from pathlib import Path

import jax
import numpy as np
import pytest

from diloco.cli import main
from diloco.config import load_config
from diloco.run.setup import Evaluator, build_setup, eval_chunks, make_island
from islands.memory import (
    GB,
    Footprint,
    OutOfMemoryError,
    Room,
    _cgroup_free,
    _meminfo_available,
    format_bytes,
    host_room,
    step_advice,
    verdict,
)
from islands.models.registry import build_model
from tests.conftest import REPO

MB = 10**6
HOST = Room(free=21_300 * MB, text="the host has 21.3 GB available")


def _need(total: int) -> Footprint:
    return Footprint(arguments=total, outputs=0, aliased=0, temp=0, code=0)


@pytest.mark.parametrize(
    ("need", "room", "expected"),
    [
        (_need(1 * GB), HOST, None),  # fits
        (_need(21_300 * MB), HOST, None),  # exactly fits: no refusal on a tie
        (_need(21_300 * MB + 1), HOST, "island a needs about 21.3 GB for one step, the host has 21.3 GB available; X"),
        (_need(312 * GB), HOST, "island a needs about 312 GB for one step, the host has 21.3 GB available; X"),
        # on CPU every device of the mesh is the host's memory: 4 x 6 GB do not fit in 21.3 GB
        (_need(6 * GB), Room(21_300 * MB, "the host has 21.3 GB available", sharers=4), "needs about 24.0 GB"),
        (_need(6 * GB), Room(21_300 * MB, "the host has 21.3 GB available", sharers=3), None),
        # a device's own memory
        (_need(90 * GB), Room(80 * GB, "device cuda:0 has 80.0 GB free of 80.0 GB"), "device cuda:0 has 80.0 GB free"),
        # donated arguments are written over: outputs aliased to them count once
        (Footprint(arguments=12 * GB, outputs=12 * GB, aliased=12 * GB, temp=9 * GB, code=0), HOST, None),
        (Footprint(arguments=12 * GB, outputs=12 * GB, aliased=0, temp=9 * GB, code=0), HOST, "needs about 33.0 GB"),
        # unknown: no check, never a refusal on a guess
        (None, HOST, None),
        (_need(10**15), None, None),
    ],
)
def test_verdict(need: Footprint | None, room: Room | None, expected: str | None) -> None:
    message = verdict("island a", need, room, "one step", "X")
    if expected is None:
        assert message is None
    else:
        assert message is not None and expected in message


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (
            (200000, 0, 1, 1, False, False),
            "lower train.batch_size (200000), set train.microbatch (sequences per device "
            "per pass; gradients are accumulated), shard parameters over islands.devices "
            "> 1 (islands.shard_params) or turn on model.remat",
        ),
        (
            (64, 8, 8, 1, False, None),
            "lower train.batch_size (64), lower train.microbatch (8) or shard parameters over "
            "islands.devices > 1 (islands.shard_params)",
        ),
        ((64, 1, 32, 2, False, True), "lower train.batch_size (64) or shard parameters (islands.shard_params)"),
        ((64, 1, 32, 2, True, True), "lower train.batch_size (64)"),
    ],
)
def test_step_advice(args: tuple, expected: str) -> None:
    assert step_advice(*args) == expected


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0 bytes"),
        (999, "999 bytes"),
        (4200, "4.20 kB"),
        (850 * MB, "850 MB"),
        (21_349 * MB, "21.3 GB"),
        (312 * GB, "312 GB"),
        (1_500 * GB, "1.50 TB"),
    ],
)
def test_format_bytes(n: int, text: str) -> None:
    assert format_bytes(n) == text


def test_host_memory_sources(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemFree:         1000000 kB\nMemAvailable:   20000000 kB\n")
    assert _meminfo_available(meminfo) == 20_000_000 * 1024
    assert _meminfo_available(tmp_path / "missing") is None
    (tmp_path / "memory.max").write_text("max\n")
    assert _cgroup_free(tmp_path) is None  # no limit
    (tmp_path / "memory.max").write_text("8000000000\n")
    (tmp_path / "memory.current").write_text("3000000000\n")
    assert _cgroup_free(tmp_path) == 5 * GB
    room = host_room()  # this machine's, as the check reads it
    assert room is not None and room.free > 0 and room.text.startswith(("the host has", "the container has"))


def test_no_analysis_means_no_check() -> None:
    class NoAnalysis:
        def memory_analysis(self) -> None:
            return None

    class Raises:
        def memory_analysis(self) -> None:
            raise NotImplementedError

    assert Footprint.of(NoAnalysis()) is None and Footprint.of(Raises()) is None


def test_eval_chunks_keep_every_sequence_in_order() -> None:
    batches = [np.arange(i * 40, (i + 1) * 40, dtype=np.int32).reshape(4, 10) for i in range(3)]
    assert eval_chunks(batches, 0).shape == (3, 4, 10)
    chunked = eval_chunks(batches, 2)
    assert chunked.shape == (6, 2, 10)
    np.testing.assert_array_equal(chunked.reshape(-1, 10), np.concatenate(batches))


class _Compiles(logging.Handler):
    """Counts XLA compilations of the jitted train step (jax_log_compiles)."""

    def __init__(self) -> None:
        super().__init__()
        self.steps = 0

    def emit(self, record: logging.LogRecord) -> None:
        if "Finished XLA compilation of jit(step)" in record.getMessage():
            self.steps += 1


@pytest.mark.slow
def test_a_tiny_island_passes_the_check_and_compiles_its_step_once(tiny_config: Path) -> None:
    cfg = load_config(tiny_config, ["model.d_model=24"])  # a step no other test compiled
    setup = build_setup(cfg, islands=["island-0"])
    counter = _Compiles()
    logger = logging.getLogger("jax")
    logger.addHandler(counter)
    jax.config.update("jax_log_compiles", True)
    # Off for this test: a step loaded from the session's persistent cache would not count as compiled at all.
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        island = make_island(cfg, "island-0", setup.model, setup.streams["island-0"])  # compiles and checks
        compiled = island.check_memory()
        footprint = Footprint.of(compiled)
        assert footprint is not None and 0 < footprint.total < 100 * MB  # XLA's CPU backend reports it
        island.start(setup.init_params)
        run = island.train(3)  # checks again with the state held, and runs what was compiled
    finally:
        jax.config.update("jax_enable_compilation_cache", True)
        jax.config.update("jax_log_compiles", False)
        logger.removeHandler(counter)
    assert len(run.losses) == 3 and np.isfinite(run.losses).all()
    assert counter.steps == 1  # make_island's compilation served the later check and every step


@pytest.mark.slow
def test_an_evaluation_too_big_is_one_error(tiny_config: Path) -> None:
    """A vocabulary of 65536 over 200000 sequences: about 1.7 TB of logits per chunk, on any host a refusal."""
    cfg = load_config(tiny_config, ["model.vocab_size=65536", "train.batch_size=200000", "model.seq_len=32"])
    model = build_model(cfg.model)
    stack = np.zeros((1, 200000, 33), np.int32)
    evaluate = Evaluator(model, stack)
    with pytest.raises(
        OutOfMemoryError,
        match=r"evaluating the global model needs about .* TB for 1 chunk of 200000 "
        r"x 33 tokens, one at a time, the host has",
    ):
        evaluate(model.init(jax.random.key(0)))


@pytest.mark.slow
def test_the_evaluator_compiles_once(tiny_config: Path) -> None:
    """Its memory check compiles the evaluation ahead of time; the calls after it must reuse that executable, not
    compile again (one compile per commit would cost the coordinator seconds a round on a large model)."""
    from jax import monitoring

    cfg = load_config(tiny_config, [])
    model = build_model(cfg.model)
    evaluate = Evaluator(model, np.zeros((2, 4, cfg.model.seq_len + 1), np.int32))
    params = model.init(jax.random.key(0))
    others = [jax.block_until_ready(jax.tree.map(lambda x, i=i: x * (1 + i / 10), params)) for i in range(3)]
    compiles: list[str] = []
    monitoring.register_event_duration_secs_listener(
        lambda event, _secs, **_kw: compiles.append(event) if event.endswith("backend_compile_duration") else None
    )
    evaluate(params)
    first = len(compiles)
    losses = [evaluate(p) for p in others]
    assert first >= 1 and len(compiles) == first, compiles
    assert len(set(losses)) == 3  # really evaluated each parameter set


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["diloco", "sync"])
def test_the_users_oversized_batch_is_one_line_before_any_step(
    mode: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The report's command, as a new user typed it: a RESOURCE_EXHAUSTED traceback (327 GB) before the check."""
    room = host_room()
    if room is not None and room.free > 5000 * GB:
        pytest.skip("this host could hold the step")
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    args = [
        "simulate",
        str(REPO / "configs" / "tiny.toml"),
        "train.batch_size=200000",
        "model.d_model=512",
        "model.n_heads=8",
        "model.d_ff=2048",
        f"train.mode={mode}",
        "--run-dir",
        str(tmp_path / "run"),
        "--no-progress",
    ]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    island = "us-east" if mode == "diloco" else "sync"
    assert err.startswith(f"diloco: error: island {island} needs about "), err
    assert "for one train step (batch " in err and "lower train.batch_size" in err and "train.microbatch" in err, err
    assert "\n" not in err and "Traceback" not in err
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - peak_before
    assert grown < 2 * GB  # nothing of the step's hundreds of GB was ever allocated
