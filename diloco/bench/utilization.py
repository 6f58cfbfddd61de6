"""`diloco bench utilization`: how much of a round the islands spend training, plain DiLoCo vs Streaming DiLoCo with
overlap, over the config's WAN links, against the cost model.

Two real federations of one config (`diloco.harness.procs.Federation`, as `launch` starts them), one after the other:
plain rounds (P = 1, τ = 0), then Streaming DiLoCo (`--fragments` P, `--overlap` τ). Utilization is what the
islands report with each push, as in summary.json but without the first WARMUP_ROUNDS rounds (round 0: process
start, join, first compiles; round 1: an island that pushed round 0 early waited for the slowest one's start-up,
and that wait is in its round-1 wall time):
Σ compute_s / Σ wall_s, where wall_s is the time since the island's previous push.

The cost model of a plain round (docs/architecture.md, "Cost model"), from the run's own measured parts:

    period = max_i (down_i + c_i + up_i) + close            utilization = mean_i c_i / period

  c_i      island i's compute seconds of that round's H steps (its push's compute_s); the model is evaluated
           for every round after the warm-up ones, then averaged
  up_i     one push: `transport.shaper.transfer_time_s` of its median push bytes on its uplink (the one-way
           latency, then the bytes at the link's bandwidth); its reply's latency back is off the path, since the
           reply comes back beside the committed update
  down_i   the committed update: its bytes and one-way latency on the downlink. The pull's request went out right
           behind the push's last bytes (`PullRequest.after_push`), so it costs no latency of its own: a round
           costs one RTT plus its bytes, as docs/architecture.md's cost model says
  close    the coordinator's median commit (aggregate, outer step, downlink encode): all an island waits for;
           the evaluation and the checkpoint follow off the islands' path (docs/architecture.md)

The slowest island's push closes the round, so one island's slow link or step sets everyone's period. The model
leaves out encode/decode and apply on the islands and the islands' own checkpoints; what it misses shows as the
gap `model_points` (measured minus model, in percentage points). "wire_share" is the model's share of a round
that is link time: choose the model size and H (key=value overrides) to make it about one half.

With ``--kernel-link MBIT`` the links are the kernel's, not the user-space shaper's: both federations run, one after
the other, inside ONE fresh network namespace whose loopback carries a `tc tbf` qdisc at MBIT Mbit/s
(`diloco.harness.netns`; root, `ip` and `tc` needed, else the bench refuses with `netns_available()`'s reason), and
`network.links=""` turns the user-space shaper off, so real TCP under a real queue is the only bottleneck. The
namespace's TCP goodput is measured first (`measure_goodput_mbit`) and reported. Loopback has one egress queue:
every island's push and pull, both directions, share it, so the plain model is `shared_link_round_model` (the round's
pulls and pushes taking turns on the one goodput), not per-island up and down links; loopback's RTT is ~0.

Run: ``diloco bench utilization configs/local.toml [--rounds 6] [--fragments 5] [--overlap 2] [--kernel-link MBIT]
[key=value ...]``.
"""

from __future__ import annotations

import contextlib
import statistics
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from diloco.bench.errors import BenchError
from diloco.bench.federation import finished_run
from diloco.bench.variants import parse_variants
from diloco.config import RunConfig
from diloco.harness.netns import (
    LinkError,
    Namespace,
    NetnsUnavailable,
    ShapedLink,
    measure_goodput_mbit,
    netns_available,
    shaped_namespace,
)
from diloco.harness.procs import Federation, Wrap
from transport.shaper import UNSHAPED, LinkProfile, load_link_profiles, profile_for, transfer_time_s

WARMUP_ROUNDS = 2
"""Rounds left out of both the measured figure and the model: round 0's pushes hold the processes' start, the join
and, with streaming, every fragment's first encode and commit compiling; round 1's wall time of an island that pushed
round 0 early holds its wait for the slowest island's start-up (tens of seconds on a loaded machine)."""


def mode_overrides(fragments: int, overlap: int) -> dict[str, list[str]]:
    """The two kinds of round compared, as config overrides: "plain" (P = 1, τ = 0), then "streaming" (P
    `fragments`, τ `overlap`)."""
    return {
        "plain": ["stream.fragments=1", "stream.overlap_steps=0"],
        "streaming": [f"stream.fragments={fragments}", f"stream.overlap_steps={overlap}"],
    }


def measured_utilization(pushes: list[dict[str, Any]]) -> float:
    """Σ compute_s / Σ wall_s of the coordinator's `push` events after the warm-up rounds (WARMUP_ROUNDS)."""
    later = [e for e in pushes if e["round"] >= WARMUP_ROUNDS]
    wall = sum(e["wall_s"] for e in later)
    if wall <= 0:
        raise BenchError(f"bench utilization: no push after the {WARMUP_ROUNDS} warm-up rounds; raise --rounds")
    return sum(e["compute_s"] for e in later) / wall


def measured_period_s(rounds: list[dict[str, Any]]) -> float:
    """The median wall time between consecutive `round` events after the warm-up rounds: what a round costs, by the
    coordinator's clock. Utilization (compute over wall seconds) counts an island's steps slowed by the processes
    it shares cores with as compute, so two runs on one shared host compare by their periods, not by it alone."""
    times = [e["t"] for e in sorted(rounds, key=lambda e: e["round"]) if e["round"] >= WARMUP_ROUNDS - 1]
    if len(times) < 2:
        raise BenchError(f"bench utilization: fewer than two rounds after the {WARMUP_ROUNDS} warm-up rounds")
    return statistics.median(b - a for a, b in zip(times, times[1:], strict=False))


def plain_round_model(
    compute_s: dict[str, float], up: dict[str, float], down: dict[str, float], close_s: float
) -> dict[str, float]:
    """One plain round's period and utilization from its parts (module docstring); pure, so table-tested.
    `compute_s`: each island's H steps in that round (the slowest one's push closes it)."""
    period = max(down[n] + compute_s[n] + up[n] for n in compute_s) + close_s
    compute = statistics.fmean(compute_s.values())
    wire = max(down[n] + up[n] for n in compute_s)
    return {"period_s": period, "utilization": compute / period, "wire_share": wire / period}


def shared_link_round_model(
    compute_s: dict[str, float],
    push_bytes: dict[str, float],
    pull_bytes: float,
    goodput_mbit: float,
    close_s: float,
) -> dict[str, float]:
    """One plain round on a kernel-shaped link (`--kernel-link`), played out on one queue; pure, so table-tested.

    Why not `plain_round_model`: in the namespace every island's push and pull, both directions, pass the ONE
    egress queue of its loopback (diloco/harness/netns.py), so they do not run side by side on links of their own but
    take turns on one rate. The round opens with the commit: the islands' pulls (`pull_bytes` each) leave one after the
    other, the slowest island's first (with equal compute any order is the same); each island trains from the end
    of its own pull, and its push (`push_bytes`) takes the queue once its steps are done and the queue is free. The
    round closes when the last push has landed, and the commit (`close_s`) follows. On a kernel-shaped link the
    pushes of a round land one transfer time apart, as here; a model that shares the rate among all of a round's
    transfers at once puts every island's start after the last pull, which the runs do not show
    (benchmarks/log/utilization.md). Loopback's RTT is ~0, so there is no latency term."""
    rate = goodput_mbit * 1e6 / 8  # bytes per second
    link_free, ready = 0.0, []
    for name in sorted(compute_s, key=lambda n: -compute_s[n]):
        link_free += pull_bytes / rate
        ready.append((link_free + compute_s[name], name))
    for at, name in sorted(ready):
        link_free = max(link_free, at) + push_bytes[name] / rate
    period = link_free + close_s
    wire = (len(compute_s) * pull_bytes + sum(push_bytes[n] for n in compute_s)) / rate
    compute = statistics.fmean(compute_s.values())
    return {"period_s": period, "utilization": compute / period, "wire_share": wire / period}


def _links(cfg: RunConfig) -> dict[str, LinkProfile]:
    profiles = load_link_profiles(cfg.network.links) if cfg.network.links else {}
    return {n: profile_for(profiles, n) if profiles else UNSHAPED for n in cfg.islands.island_names}


def _plain_model(cfg: RunConfig, fed: Federation, goodput_mbit: float | None) -> dict[str, Any]:
    """The model of every round after the warm-up ones (each from that round's own compute times), averaged: over the
    config's links (`plain_round_model`), or over one shared kernel link of `goodput_mbit` when that is given
    (`shared_link_round_model`)."""
    pushes = fed.events("push")
    names = cfg.islands.island_names
    up_bytes = {n: statistics.median(e["bytes_up"] for e in pushes if e["island"] == n) for n in names}
    # Every island pulls each round's update once: the coordinator's downlink bytes grow by n updates a round.
    totals = [e["bytes_down"] for e in fed.events("round")]
    per_pull = statistics.median(b - a for a, b in zip(totals, totals[1:], strict=False)) / len(names)
    round_bytes = sum(up_bytes.values()) + len(names) * per_pull  # every push and every pull of one round
    close = statistics.median(e["close_s"]["commit"] for e in fed.events("round")[1:])
    parts: dict[str, Any]
    if goodput_mbit is None:
        links = _links(cfg)
        chunk = cfg.transport.chunk_bytes
        up = {n: transfer_time_s(links[n], int(up_bytes[n]), "up", chunk) for n in names}
        down = {n: transfer_time_s(links[n], int(per_pull), "down", chunk) for n in names}
        parts = {"up": {n: round(v, 4) for n, v in up.items()}, "down": {n: round(v, 4) for n, v in down.items()}}

        def model_of(compute: dict[str, float]) -> dict[str, float]:
            return plain_round_model(compute, up, down, close)
    else:
        parts = {"wire": round(round_bytes * 8 / (goodput_mbit * 1e6), 4)}

        def model_of(compute: dict[str, float]) -> dict[str, float]:
            return shared_link_round_model(compute, up_bytes, per_pull, goodput_mbit, close)

    per_round = []
    for r in range(WARMUP_ROUNDS, cfg.train.rounds):
        compute = {e["island"]: e["compute_s"] for e in pushes if e["round"] == r}
        if set(compute) == set(names):
            per_round.append(model_of(compute))
    if not per_round:
        raise BenchError("bench utilization: no round after the warm-up ones held every island; raise --rounds")
    model = {k: statistics.fmean(m[k] for m in per_round) for k in per_round[0]}
    return {
        **{k: round(v, 4) for k, v in model.items()},
        "parts_s": {
            "compute_median": round(statistics.median(e["compute_s"] for e in pushes), 4),
            **parts,
            "close": round(close, 4),
        },
        "bytes": {
            "push_median": int(statistics.median(up_bytes.values())),
            "pull": int(per_pull),
            "round": int(round_bytes),
        },
    }


def _run(
    config: str | Path,
    overrides: list[str],
    run_dir: Path,
    rounds: int,
    wrap: Wrap | None = None,
    goodput_mbit: float | None = None,
) -> tuple[RunConfig, dict, Any]:
    with finished_run(config, overrides, run_dir, rounds, slack_s=180.0, wrap=wrap) as (cfg, fed, summary):
        result = {
            "utilization": round(measured_utilization(fed.events("push")), 4),
            "period_s": round(measured_period_s(fed.rounds()), 4),
            "summary_utilization": summary["compute_utilization"],
            "final_eval_loss": summary["final_eval_loss"],
            "wall_s": summary["wall_s"],
            "bytes_up": summary["bytes_up"],
            # what one push carries: a round may close without an island still starting, so totals of two runs
            # differ by their pushes as well as by their codecs
            "bytes_up_per_push": round(summary["bytes_up"] / max(1, sum(len(r["islands"]) for r in fed.rounds()))),
        }
        model = _plain_model(cfg, fed, goodput_mbit) if not cfg.stream.streaming else None
    return cfg, result, model


GOODPUT_PROBE_S = 2.0
"""About how long the goodput measurement of a `--kernel-link` namespace sends for (at least 100 kB)."""


def kernel_shaped_link(rate_mbit: float) -> ShapedLink:
    """The `--kernel-link` link; a rate out of range is the user's one-line BenchError."""
    try:
        return ShapedLink(rate_mbit=rate_mbit)
    except LinkError as exc:
        raise BenchError(f"bench utilization: --kernel-link: {exc}") from None


@contextlib.contextmanager
def _kernel_namespace(link: ShapedLink) -> Iterator[tuple[Namespace, float]]:
    """A fresh shaped namespace and its measured TCP goodput (Mbit/s); a machine that cannot make one is a BenchError
    naming why."""
    ok, why = netns_available()
    if not ok:
        raise BenchError(f"bench utilization: --kernel-link needs a kernel-shaped network namespace: {why}")
    try:
        with shaped_namespace(link, name_prefix="diloco-ut") as ns:
            nbytes = max(100_000, int(link.rate_mbit * 1e6 / 8 * GOODPUT_PROBE_S))
            try:
                goodput = measure_goodput_mbit(ns, nbytes, timeout=60.0 + 10 * GOODPUT_PROBE_S)
            except (RuntimeError, ValueError, OSError, subprocess.SubprocessError) as exc:  # timeout included
                raise BenchError(f"bench utilization: measuring the namespace's goodput failed: {exc}") from None
            yield ns, goodput
    except NetnsUnavailable as exc:
        raise BenchError(f"bench utilization: --kernel-link: {exc}") from None


def run_utilization_bench(
    config: str | Path,
    overrides: list[str],
    run_dir: Path,
    rounds: int,
    fragments: int,
    overlap: int,
    kernel_link: float | None = None,
    variants: list[str] | None = None,
) -> dict[str, Any]:
    """Plain, then streaming, federations of the config (module docstring); with `kernel_link` (Mbit/s), inside
    one namespace shaped by tbf at that rate, the user-space shaper off. With `variants` (`NAME:key=v,...`, say a
    codec each) every variant's pair runs in turn on the same links, side by side in one result under "variants"."""
    if rounds < WARMUP_ROUNDS + 2:
        raise BenchError(
            f"bench utilization: --rounds must be >= {WARMUP_ROUNDS + 2} (the first {WARMUP_ROUNDS} "
            f"rounds are left out; got {rounds})"
        )
    named = parse_variants(variants or [], "--variant")
    with _link_context(kernel_link) as (wrap, goodput, kernel):
        if kernel is not None:
            overrides = [*overrides, 'network.links=""']
        runs = [(v.name, [*overrides, *v.overrides], run_dir / v.name) for v in named] or [("", overrides, run_dir)]
        pairs = {name: _pair(config, o, where, rounds, fragments, overlap, wrap, goodput) for name, o, where in runs}
    cfg = next(iter(pairs.values()))[0]
    links = cfg.network.links or None
    if kernel is not None:
        links = f"kernel tbf {kernel['rate_mbit']:g} Mbit/s"
    head = {
        "bench": "utilization",
        "islands": cfg.islands.count,
        "H": cfg.train.inner_steps,
        "rounds": rounds,
        "links": links,
        **({"kernel_link": kernel} if kernel is not None else {}),
        "run_dir": str(run_dir),
    }
    if named:
        return {**head, "variants": {name: result for name, (_, result) in pairs.items()}}
    return {**head, **pairs[""][1]}


def _pair(
    config: str | Path,
    overrides: list[str],
    run_dir: Path,
    rounds: int,
    fragments: int,
    overlap: int,
    wrap: Wrap | None,
    goodput_mbit: float | None,
) -> tuple[RunConfig, dict[str, Any]]:
    """One config's plain federation, then its streaming one, and how they compare (with the plain run's config)."""
    modes = mode_overrides(fragments, overlap)
    plain, stream = modes["plain"], modes["streaming"]
    cfg, plain_run, model = _run(config, [*overrides, *plain], run_dir / "plain", rounds, wrap, goodput_mbit)
    _, stream_run, _ = _run(config, [*overrides, *stream], run_dir / "streaming", rounds, wrap)
    assert model is not None
    return cfg, {
        "codec": {"uplink": cfg.codec.uplink, "downlink": cfg.codec.downlink},
        "plain": {
            **plain_run,
            "model": model,
            "model_points": round(100 * (plain_run["utilization"] - model["utilization"]), 1),
        },
        "streaming": {"fragments": fragments, "overlap_steps": overlap, **stream_run},
        "streaming_over_plain": round(stream_run["utilization"] / plain_run["utilization"], 3),
        "streaming_period_over_plain": round(stream_run["period_s"] / plain_run["period_s"], 3),
    }


@contextlib.contextmanager
def _link_context(kernel_link: float | None) -> Iterator[tuple[Wrap | None, float | None, dict[str, Any] | None]]:
    """The links every federation of the bench runs on: the config's (nothing to set up), or with `kernel_link` one
    fresh kernel-shaped namespace: its command wrapper, measured goodput (Mbit/s) and description."""
    if kernel_link is None:
        yield None, None, None
        return
    link = kernel_shaped_link(kernel_link)
    with _kernel_namespace(link) as (ns, goodput):
        yield ns.wrap, goodput, {"rate_mbit": link.rate_mbit, "goodput_mbit": round(goodput, 3), "namespace": ns.name}
