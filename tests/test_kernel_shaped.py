"""The cost model (docs/architecture.md) against a real federation on a kernel-shaped link (tbf on a namespace's loopback).

A coordinator and 2 islands run as processes inside one network namespace (diloco/harness/netns.py) whose loopback carries
a token-bucket filter at a WAN-like rate; the user-space shaper is off (`network.links=""`), so the kernel's
queue is the only bottleneck, and TCP, gRPC chunking and HTTP/2 flow control all pay for it for real. The model
is a few MB of fp32 so that each round moves several MB and communication is most of the round.

Cost model (docs/architecture.md): T_round ≈ H·t_step + T_comm. Per committed round r (from the coordinator's `round`
events; rounds 0 and 1 are skipped: round 0 compiles the islands' train step and pulls the full θ, round 1's
window holds the first outer step, which jit-compiles on the coordinator at round 0's close):

* H·t_step: the islands' own measurement, `inner` event time minus `train_start` time of round r (the H steps
  plus Δ and its encoding), the slower island (the round waits for it; both islands compute at once);
* T_comm: the bytes moved in round r's window (Δ pushes of round r plus the pulls of round r-1's update: the
  growth of the coordinator's `bytes_up` + `bytes_down` totals) over the link's TCP goodput, measured in the
  same namespace just before. Loopback has one egress queue: both directions and both islands share it, so
  the bytes add up on one link (see diloco/harness/netns.py). RTT on loopback is ~0.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from diloco.harness.netns import ShapedLink, measure_goodput_mbit, netns_available, shaped_namespace
from diloco.harness.procs import Federation

_OK, _WHY = netns_available()

RATE_MBIT = 32.0
ROUNDS = 5
H = 40
"""Inner steps per round: few enough that the link stays most of the round (the test's precondition) when other
work on the machine doubles the steps' time."""

CONFIG = """
[run]
name = "kshaped"
seed = 0

[model]
kind = "transformer"
vocab_size = 256
seq_len = 16
d_model = 128
n_layers = 2
n_heads = 4
d_ff = 512

[data]
kind = "text"
path = "{corpus}"
val_fraction = 0.1

[train]
rounds = {rounds}
inner_steps = {h}
batch_size = 4
eval_batches = 1
checkpoint_every = 0
log_every = {h}

[inner]
lr = 1e-3
warmup_steps = 2

[islands]
count = 2
names = ["a", "b"]

[quorum]
min_islands = 2
lease_s = 60.0
min_deadline_s = 120.0
max_deadline_s = 300.0

[network]
links = ""
"""


def _compute_s(events: list[dict[str, Any]], rnd: int) -> float:
    """Island seconds from `train_start` of round rnd to its `inner` event (logged right after the H steps)."""
    start = next(e["t"] for e in events if e["event"] == "train_start" and e["round"] == rnd)
    end = next(e["t"] for e in events if e["event"] == "inner" and e["round"] == rnd)
    return end - start


@pytest.mark.bench  # a timed comparison with the cost model: run with `pytest -m bench`, not README's command
@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(240)
@pytest.mark.skipif(not _OK, reason=f"kernel-shaped namespaces unavailable here: {_WHY}")
def test_round_time_matches_cost_model_on_kernel_shaped_link(
    tmp_path: Path, corpus: Path, shared_jax_cache: Path
) -> None:
    config = tmp_path / "kshaped.toml"
    config.write_text(CONFIG.format(corpus=corpus, rounds=ROUNDS, h=H))
    with shaped_namespace(ShapedLink(rate_mbit=RATE_MBIT), name_prefix=f"dlks{os.getpid()}") as ns:
        goodput_mbit = measure_goodput_mbit(ns, nbytes=3_000_000)
        with Federation(config, [], tmp_path / "run", wrap=ns.wrap) as fed:
            fed.start(timeout_s=120)
            summary = fed.wait_done(timeout_s=180)
            rounds = fed.rounds()
            islands = {name: fed.events(island=name) for name in fed.names}
    assert summary["rounds"] == ROUNDS
    assert [r["round"] for r in rounds] == list(range(ROUNDS))

    rows = []
    for prev, cur in zip(rounds[1:], rounds[2:], strict=False):
        rnd = cur["round"]
        nbytes = cur["bytes_up"] - prev["bytes_up"] + cur["bytes_down"] - prev["bytes_down"]
        compute = max(_compute_s(ev, rnd) for ev in islands.values())
        comm = nbytes * 8 / (goodput_mbit * 1e6)
        rows.append((rnd, cur["seconds"], compute, comm, nbytes))
    measured = sum(r[1] for r in rows)
    compute = sum(r[2] for r in rows)
    comm = sum(r[3] for r in rows)
    predicted = compute + comm
    print(f"\nkernel-shaped link: tbf {RATE_MBIT} Mbit/s, TCP goodput {goodput_mbit:.2f} Mbit/s")
    print("round  T_round_s  H*t_step_s  T_comm_s  MB_moved  predicted_s")
    for rnd, sec, comp, com, nb in rows:
        print(f"{rnd:5d}  {sec:9.2f}  {comp:10.2f}  {com:8.2f}  {nb / 1e6:8.2f}  {comp + com:11.2f}")
    print(
        f"total: measured {measured:.2f}s, predicted {predicted:.2f}s (compute {compute:.2f}s + comm {comm:.2f}s), "
        f"comm share {comm / predicted:.0%}, ratio {measured / predicted:.3f}"
    )
    # The setup must make the link matter, or the comparison says nothing about the communication term.
    assert comm / predicted > 0.4, f"communication is only {comm / predicted:.0%} of the round"
    assert abs(measured - predicted) / predicted < 0.2, (
        f"rounds took {measured:.2f}s, the cost model predicts {predicted:.2f}s"
    )
