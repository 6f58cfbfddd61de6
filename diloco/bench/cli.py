"""The `diloco bench` subcommands: their arguments, and the dispatch to the benchmark that runs.

Why here and not in diloco/cli.py: the benchmarks are a package apart from the product, and the product's CLI
only needs two entry points, `add_bench_parser` and `run_bench`. A benchmark module is imported when its
subcommand runs, never to build the parser, so `diloco --help` does not load JAX. A benchmark that writes runs
gets `--run-dir` (default runs/bench-NAME-TIMESTAMP); one given a config takes trailing key=value overrides.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

Result = dict[str, Any]

HELP = {
    "overhead": "island inner-step throughput vs a bare jitted optax loop",
    "convergence": "L1 / LM / sync on one config: the DiLoCo acceptance runs",
    "codec": "pseudo-gradient codecs: ratio, GB/s, error",
    "transport": "gRPC goodput on loopback, unshaped and shaped; receiver peak memory",
    "recovery": "time for a SIGKILLed island to rejoin vs params/bandwidth + 10 s",
    "faults": "final eval loss with an island killed at R/3, back at 2R/3, vs fault-free",
}


def _with_config(p: argparse.ArgumentParser, run_dir: bool = True) -> None:
    p.add_argument("config", help="TOML run config (e.g. configs/local.toml)")
    if run_dir:
        p.add_argument("--run-dir", type=Path, default=None, help="where the runs go (default: runs/bench-NAME-TIME)")
    p.epilog = "Trailing section.key=value arguments override the config, e.g. outer.lr=0.5 data.path=my.txt."
    p.set_defaults(accepts_overrides=True)


def add_bench_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `bench` and its subcommands to the CLI's subparsers (what `add_subparsers` returned)."""
    bench = subparsers.add_parser("bench", help="benchmarks that print JSON")
    bsub = bench.add_subparsers(dest="bench", required=True)
    parsers = {name: bsub.add_parser(name, help=text) for name, text in HELP.items()}

    ov = parsers["overhead"]
    _with_config(ov, run_dir=False)
    ov.add_argument("--repeats", type=int, default=5, help="ABBA pairs of timed runs")
    ov.add_argument("--steps", type=int, default=50, help="inner steps per timed run")

    conv = parsers["convergence"]
    _with_config(conv)
    conv.add_argument("--islands", type=int, default=4, help="M, the islands of the DiLoCo and sync runs")

    codec = parsers["codec"]
    codec.add_argument("--size-mb", type=float, default=64.0, help="MiB of float32 pseudo-gradient")
    codec.add_argument("--repeats", type=int, default=5, help="timed calls per codec (median)")

    tr = parsers["transport"]
    tr.add_argument("--payload-mb", type=float, default=256.0, help="MiB per unshaped push")
    tr.add_argument("--shaped-mbps", type=float, default=50.0, help="the shaped link's rate, Mbit/s")
    tr.add_argument("--shaped-mb", type=float, default=20.0, help="MiB of the shaped push")

    for name in ("recovery", "faults"):
        _with_config(parsers[name])
        parsers[name].add_argument(
            "--victim", default=None, help="island to kill (default: slowest downlink / last name)"
        )
    parsers["recovery"].add_argument(
        "--kill-after", type=int, default=3, help="committed rounds before the victim is killed"
    )


def _run_dir(args: argparse.Namespace) -> Path:
    return args.run_dir or Path("runs") / f"bench-{args.bench}-{time.strftime('%Y%m%d-%H%M%S')}"


def _overhead(args: argparse.Namespace) -> Result:
    from diloco.bench.overhead import run_overhead_bench
    from diloco.config import load_config

    return run_overhead_bench(load_config(args.config, args.overrides), args.steps, args.repeats)


def _convergence(args: argparse.Namespace) -> Result:
    from diloco.bench.convergence import run_convergence_bench
    from diloco.config import load_config

    return run_convergence_bench(load_config(args.config, args.overrides), _run_dir(args), args.islands)


def _codec(args: argparse.Namespace) -> Result:
    from diloco.bench.codec import run_codec_bench

    return run_codec_bench(args.size_mb, args.repeats)


def _transport(args: argparse.Namespace) -> Result:
    from diloco.bench.transport import run_transport_bench

    return run_transport_bench(args.payload_mb, args.shaped_mbps, args.shaped_mb)


def _recovery(args: argparse.Namespace) -> Result:
    from diloco.bench.federation import run_recovery_bench

    return run_recovery_bench(args.config, args.overrides, _run_dir(args), args.victim, args.kill_after)


def _faults(args: argparse.Namespace) -> Result:
    from diloco.bench.federation import run_fault_bench

    return run_fault_bench(args.config, args.overrides, _run_dir(args), args.victim)


RUNNERS: dict[str, Callable[[argparse.Namespace], Result]] = {
    "overhead": _overhead,
    "convergence": _convergence,
    "codec": _codec,
    "transport": _transport,
    "recovery": _recovery,
    "faults": _faults,
}


def run_bench(args: argparse.Namespace) -> Result:
    """Run the benchmark `args.bench` names and return its JSON-able result; a failure raises BenchError."""
    return RUNNERS[args.bench](args)
