"""The asynchronous mode in the coordinator (`train.mode = "async"`, diloco/coordinator/coordinator.py): each validated push is
one outer update, committed at once, its Δ weighted by its staleness; checked by hand on an in-process coordinator.

The outer step here is plain SGD with lr 1 and fp32 on the wire both ways, so θ_{u+1} = θ_u - w(τ)·Δ exactly; Δ is
a constant tensor (every element `fill`), so every parameter moves by the same short binary fraction.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import numpy as np
import pytest

import diloco.coordinator.settler as settler_module
from diloco import RELEASE
from diloco.config import load_config
from diloco.coordinator.coordinator import Coordinator
from diloco.run.rundir import RunDir, read_events
from diloco.run.setup import build_setup
from floor.codec import CodecSpec, decode
from pytrees.digest import tree_digest
from pytrees.encode import encode_named
from pytrees.naming import flatten_named
from transport import diloco_pb2 as pb
from transport.chunking import payload_digest
from transport.errors import Rejected


@pytest.fixture
def coordinator(tiny_config: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    # No island of these tests pulls or beats: each commit is evaluated at once, as `EVAL_YIELD_S` = 0 says.
    monkeypatch.setattr(settler_module, "EVAL_YIELD_S", 0.0)
    cfg = load_config(
        tiny_config,
        [
            "train.mode=async",
            "train.rounds=6",
            "train.checkpoint_every=0",
            "outer.kind=sgd",
            "outer.lr=1.0",
            "outer.momentum=0.0",
            "outer.staleness_exponent=1.0",
            "outer.max_staleness=2",
            "codec.uplink=fp32",
            "codec.downlink=fp32",
            "outer.aggregate=mean",
            "islands.count=3",
        ],
    )
    rd = RunDir(tmp_path / "run", cfg)
    coord = Coordinator(cfg, rd, build_setup(cfg, islands=()))
    yield coord
    coord.close()
    rd.close()


def _theta(coord: Coordinator) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in flatten_named(coord.loop.params).items()}


def push(coord: Coordinator, island: str, base: int, digest: str, fill: float) -> pb.PushReply:
    """Island `island` pushes Δ = `fill` everywhere, taken from θ_base (whose digest it names)."""
    named = {k: np.full(np.shape(v), fill, np.float32) for k, v in _theta(coord).items()}
    meta = pb.PushMeta(
        run_id=coord.run_id, island=island, round=base, tokens=128, loss=1.0, base_digest=bytes.fromhex(digest)
    )
    tensors = encode_named(named, CodecSpec(kind="fp32"))
    return coord.push(meta, tensors, named, payload_digest(tensors))


def refused(call, code: grpc.StatusCode, words: str) -> None:
    with pytest.raises(Rejected) as info:
        call()
    assert info.value.code == code and words in info.value.reason, info.value


@pytest.mark.slow
def test_each_push_is_one_update_weighted_by_its_staleness(coordinator: Coordinator) -> None:
    theta0, digest0 = _theta(coordinator), coordinator.world.params_digest
    for name in ("island-0", "island-1", "island-2"):
        coordinator.join(
            pb.JoinRequest(
                run_id=coordinator.run_id, island=name, config_digest=coordinator.digest, last_round=-1, release=RELEASE
            )
        )
    # island-0 pushes from θ_0 while θ_0 is current: τ = 0, w = 1, θ_1 = θ_0 - 1·0.5.
    assert push(coordinator, "island-0", 0, digest0, 0.5).round == 0
    assert coordinator.loop.round == 1
    theta1, digest1 = _theta(coordinator), coordinator.world.params_digest
    assert all(np.array_equal(theta1[k], theta0[k] - np.float32(0.5)) for k in theta0)
    # island-1 also took its Δ from θ_0: one update is applied since, τ = 1, w = (1 + 1)^-1 = ½: θ_2 = θ_1 - ½·1.
    assert push(coordinator, "island-1", 0, digest0, 1.0).round == 1
    theta2 = _theta(coordinator)
    assert all(np.array_equal(theta2[k], theta1[k] - np.float32(0.5)) for k in theta0)
    # island-0 pushes again from θ_1 (τ = 1): w = ½ of 0.25.
    assert push(coordinator, "island-0", 1, digest1, 0.25).round == 2
    theta3 = _theta(coordinator)
    assert all(np.array_equal(theta3[k], theta2[k] - np.float32(0.125)) for k in theta0)
    assert coordinator.settled(60)
    rounds = [e for e in read_events(coordinator.rd.metrics_path) if e["event"] == "round"]
    assert [(e["round"], e["islands"], e["staleness"], e["weight"]) for e in rounds] == [
        (0, ["island-0"], 0, 1.0),
        (1, ["island-1"], 1, 0.5),
        (2, ["island-0"], 1, 0.5),
    ]
    pushes = [e for e in read_events(coordinator.rd.metrics_path) if e["event"] == "push"]
    assert [(e["round"], e["base"]) for e in pushes] == [(0, 0), (1, 0), (2, 1)]


@pytest.mark.slow
def test_an_island_catches_up_by_pulling_each_update_it_missed(coordinator: Coordinator) -> None:
    digest0 = coordinator.world.params_digest
    push(coordinator, "island-0", 0, digest0, 0.5)
    push(coordinator, "island-1", 0, digest0, 1.0)  # applied as update 1
    # island-1 holds θ_0: it pulls û_0 then û_1, each proved by the digest of the θ it makes.
    theta = _theta(coordinator)
    digests = []
    for have in (0, 1):
        payload = coordinator.pull(pb.PullRequest(run_id=coordinator.run_id, island="island-1", have_round=have))
        assert payload.kind == "update" and payload.round == have + 1
        digests.append(payload.param_digest.hex())
        assert {t.name for t in payload.tensors} == set(theta)
        assert all(np.all(decode(t) != 0) for t in payload.tensors)
    assert digests[-1] == coordinator.world.params_digest == tree_digest(coordinator.loop.params)
    # Nothing to wait for: the island holds the newest θ only after pushing again.
    refused(
        lambda: coordinator.pull(pb.PullRequest(run_id=coordinator.run_id, island="island-1", have_round=2)),
        grpc.StatusCode.FAILED_PRECONDITION,
        "push it first",
    )


def test_a_push_too_stale_ahead_or_from_an_unknown_theta_is_refused(coordinator: Coordinator) -> None:
    digest0 = coordinator.world.params_digest
    refused(
        lambda: push(coordinator, "island-0", 1, digest0, 0.5),
        grpc.StatusCode.FAILED_PRECONDITION,
        "ahead of the coordinator's θ_0",
    )
    refused(
        lambda: push(coordinator, "island-0", 0, "ab" * 16, 0.5),
        grpc.StatusCode.FAILED_PRECONDITION,
        "was not taken from θ_0",
    )
    for i in range(3):  # three updates: θ_0 is now 3 updates old, over outer.max_staleness = 2
        push(coordinator, f"island-{i}", i, coordinator.world.params_digest, 0.25)
    before = coordinator.world.params_digest
    refused(
        lambda: push(coordinator, "island-1", 0, digest0, 0.5),
        grpc.StatusCode.FAILED_PRECONDITION,
        "3 updates stale, over outer.max_staleness = 2",
    )
    assert coordinator.world.params_digest == before and coordinator.loop.round == 3


def test_the_run_ends_after_train_rounds_updates(coordinator: Coordinator) -> None:
    for u in range(6):
        push(coordinator, f"island-{u % 3}", u, coordinator.world.params_digest, 0.125)
    assert coordinator.settled(60) and coordinator.done
    refused(
        lambda: push(coordinator, "island-0", 6, coordinator.world.params_digest, 0.125),
        grpc.StatusCode.FAILED_PRECONDITION,
        "the run is complete",
    )
