"""run.tensorboard (diloco/ops/tensorboard.py): event files written from metrics.jsonl's events, read back and compared;
a missing tensorboardX is one line at startup."""

from __future__ import annotations

import struct
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from diloco.cli import main
from diloco.config import load_config, to_dict
from diloco.ops.tensorboard import INSTALL_HINT, TensorBoardWriter
from diloco.run.rundir import read_events
from diloco.simulator.simulate import run_simulation

pytest.importorskip("tensorboardX")

H = 4  # TINY_TOML's train.inner_steps


def tf_records(path: Path) -> Iterator[bytes]:
    """The records of a tfevents file: u64 length, u32 CRC of the length, data, u32 CRC of the data (CRCs unchecked:
    what is tested is what was written, and tensorboardX checksums its own records)."""
    data = path.read_bytes()
    offset = 0
    while offset < len(data):
        (length,) = struct.unpack_from("<Q", data, offset)
        offset += 12
        yield data[offset : offset + length]
        offset += length + 4


def read_scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] of every scalar in every event file under `logdir`, in file then write order, parsed
    with the protobuf classes tensorboardX ships (no TensorFlow or tensorboard needed)."""
    from tensorboardX.proto.event_pb2 import Event

    out: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(logdir.glob("events.out.tfevents.*")):
        for record in tf_records(path):
            event = Event.FromString(record)
            for value in event.summary.value:
                out.setdefault(value.tag, []).append((event.step, value.simple_value))
    return out


@pytest.mark.slow
def test_scalars_match_metrics_jsonl(tiny_config: Path, tmp_path: Path) -> None:
    cfg = load_config(tiny_config, ["run.tensorboard=true"])
    run_dir = tmp_path / "run"
    run_simulation(cfg, run_dir, show_progress=False)
    scalars = read_scalars(run_dir / "tensorboard")
    events = read_events(run_dir / "metrics.jsonl")

    # The global model's eval loss: θ_0 at step 0, then round r's commit at (r + 1)·H inner steps per island.
    expected = [(0, e["eval_loss"]) for e in events if e["event"] == "eval"]
    expected += [((e["round"] + 1) * H, e["eval_loss"]) for e in events if e["event"] == "round"]
    assert len(expected) == cfg.train.rounds + 1
    got = scalars["global/eval_loss"]
    assert [s for s, _ in got] == [s for s, _ in expected]
    assert [v for _, v in got] == pytest.approx([v for _, v in expected], rel=1e-6)  # float32 in the file
    rounds = [e for e in events if e["event"] == "round"]
    for key in ("loss", "tokens", "bytes_up", "bytes_down", "seconds"):
        assert [v for _, v in scalars[f"global/{key}"]] == pytest.approx([e[key] for e in rounds], rel=1e-6), key

    # Each island's inner loss, tagged by its name, at its own step.
    for name in cfg.islands.island_names:
        inner = [(e["step"], e["loss"]) for e in events if e["event"] == "inner" and e["island"] == name]
        assert inner and [s for s, _ in scalars[f"island/{name}/loss"]] == [s for s, _ in inner]
        assert [v for _, v in scalars[f"island/{name}/loss"]] == pytest.approx([v for _, v in inner], rel=1e-6)
    assert set(scalars) == {
        f"global/{k}" for k in ("eval_loss", "loss", "tokens", "bytes_up", "bytes_down", "seconds")
    } | {f"island/{n}/loss" for n in cfg.islands.island_names}
    assert "tensorboard" not in to_dict(cfg)["run"]  # per process: not part of the run's identity


def test_off_by_default_writes_nothing(tiny_config: Path, tmp_path: Path) -> None:
    from diloco.run.rundir import RunDir

    rd = RunDir(tmp_path / "run", load_config(tiny_config, []))
    rd.log("round", round=0, eval_loss=1.0)
    rd.close()
    assert rd.tensorboard is None and not (tmp_path / "run" / "tensorboard").exists()


def test_unknown_island_names_and_odd_values_make_no_tags(tiny_config: Path, tmp_path: Path) -> None:
    writer = TensorBoardWriter(load_config(tiny_config, ["stream.fragments=2"]), tmp_path / "tb")
    assert writer.scalars("inner", {"island": "mallory", "step": 2, "loss": 1.0}) == []
    assert writer.scalars("push", {"island": "../x", "round": 0, "compute_s": 1.0}) == []
    assert writer.scalars("inner", {"island": "island-0", "step": True, "loss": 1.0}) == []
    assert writer.scalars("round", {"round": 0, "loss": None, "eval_loss": 2.0}) == [("global/eval_loss", 2.0, 4)]
    # Streaming, P = 2: fragment 0 of round 1 lands at 1·H + H/2, a push into it at the same x.
    assert writer.scalars("sync", {"round": 1, "fragment": 0, "seconds": 0.5}) == [("global/seconds", 0.5, 6)]
    assert writer.scalars(
        "push", {"round": 1, "fragment": 0, "island": "island-1", "compute_s": 0.25, "wall_s": 0.5}
    ) == [("island/island-1/compute_s", 0.25, 6), ("island/island-1/wall_s", 0.5, 6)]


def test_resume_purges_from_the_first_rerun_step(tiny_config: Path, tmp_path: Path) -> None:
    """A resumed process's event file starts with a purge marker where it reruns (TensorBoard hides older points
    from there); closed, nothing more is written."""
    from tensorboardX.proto.event_pb2 import Event, SessionLog

    writer = TensorBoardWriter(load_config(tiny_config, []), tmp_path / "tb")
    writer.observe("resumed", {"round": 2, "digest": "x"})
    writer.observe("round", {"round": 2, "eval_loss": 3.0})
    writer.close()
    writer.observe("round", {"round": 3, "eval_loss": 2.0})
    (path,) = (tmp_path / "tb").glob("events.out.tfevents.*")
    events = [Event.FromString(r) for r in tf_records(path)]
    assert [e.step for e in events if e.session_log.status == SessionLog.START] == [2 * H + 1]
    assert read_scalars(tmp_path / "tb") == {"global/eval_loss": [(3 * H, 3.0)]}


def test_missing_extra_is_one_line(
    tiny_config: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # `import tensorboardX` now raises ImportError
    run_dir = tmp_path / "run"
    args = ["simulate", str(tiny_config), "--run-dir", str(run_dir), "--no-progress", "run.tensorboard=true"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and INSTALL_HINT in err and "Traceback" not in err
    assert not (run_dir / "metrics.jsonl").exists()  # refused before the run directory was written


def test_post_training_scores_are_curves(tiny_config: Path, tmp_path: Path) -> None:
    writer = TensorBoardWriter(load_config(tiny_config, []), tmp_path / "tb")
    scores = {"sft_exact_match": 0.25, "sft_ce": 1.5, "odd": "text"}  # post-training's held-out figures
    assert writer.scalars("eval", {"step": 0, "eval_loss": 1.5, "scores": scores}) == [
        ("global/eval_loss", 1.5, 0),
        ("scores/sft_ce", 1.5, 0),
        ("scores/sft_exact_match", 0.25, 0),
    ]
    assert ("scores/sft_ce", 1.5, 4) in writer.scalars("round", {"round": 0, "eval_loss": 1.5, "scores": scores})
