"""The `diloco` command line: simulate, bench (launch, coordinator, island, status follow the federation issue).

Every command takes `--run-dir DIR` (where one applies) and trailing `key=value` config overrides. A user
mistake (config, data, model path, run directory) ends with one line on stderr and exit code 2, never a
traceback.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from diloco.errors import USER_ERRORS


def _add_common(p: argparse.ArgumentParser, with_config: bool = True) -> None:
    if with_config:
        p.add_argument("config", help="TOML run config (e.g. configs/tiny.toml)")
    p.add_argument("--run-dir", type=Path, default=None, help="run directory (default: runs/NAME-TIMESTAMP)")
    p.epilog = "Trailing section.key=value arguments override the config, e.g. outer.lr=0.5 train.mode=sync."
    p.set_defaults(accepts_overrides=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="diloco", description="DiLoCo training across islands over a WAN.")
    sub = parser.add_subparsers(dest="command", required=True)

    sim = sub.add_parser("simulate", help="every island and the coordinator in one process")
    _add_common(sim)
    sim.add_argument("--no-progress", action="store_true", help="no live progress line")

    bench = sub.add_parser("bench", help="benchmarks that print JSON")
    bsub = bench.add_subparsers(dest="bench", required=True)
    ov = bsub.add_parser("overhead", help="island inner-step throughput vs a bare jitted optax loop")
    _add_common(ov)
    ov.add_argument("--repeats", type=int, default=5)
    ov.add_argument("--steps", type=int, default=50)
    conv = bsub.add_parser("convergence", help="L1 / L4 / sync on one config: the DiLoCo acceptance runs")
    _add_common(conv)
    conv.add_argument("--islands", type=int, default=4)
    codec = bsub.add_parser("codec", help="pseudo-gradient codecs: ratio, GB/s, error")
    codec.add_argument("--size-mb", type=float, default=64.0)
    codec.add_argument("--repeats", type=int, default=5)
    tr = bsub.add_parser("transport", help="gRPC goodput on loopback, unshaped and shaped")
    tr.add_argument("--payload-mb", type=float, default=256.0)
    tr.add_argument("--shaped-mbps", type=float, default=50.0)
    tr.add_argument("--shaped-mb", type=float, default=20.0)
    return parser


def _default_run_dir(name: str) -> Path:
    return Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"


def _simulate(args: argparse.Namespace) -> int:
    from diloco.config import load_config
    from diloco.simulate import run_simulation

    cfg = load_config(args.config, args.overrides)
    run_dir = args.run_dir or _default_run_dir(cfg.run.name)
    summary = run_simulation(cfg, run_dir, show_progress=not args.no_progress)
    print(json.dumps({"run_dir": str(run_dir), **summary}, indent=2))
    return 0


def _bench(args: argparse.Namespace) -> int:
    if args.bench == "overhead":
        from diloco.bench_overhead import run_overhead_bench
        from diloco.config import load_config

        result = run_overhead_bench(load_config(args.config, args.overrides), args.steps, args.repeats)
    elif args.bench == "convergence":
        from diloco.bench_convergence import run_convergence_bench
        from diloco.config import load_config

        cfg = load_config(args.config, args.overrides)
        run_dir = args.run_dir or _default_run_dir(f"{cfg.run.name}-convergence")
        result = run_convergence_bench(cfg, run_dir, args.islands)
    elif args.bench == "codec":
        from diloco.bench_codec import run_codec_bench

        result = run_codec_bench(args.size_mb, args.repeats)
    else:
        from diloco.bench_transport import run_transport_bench

        result = run_transport_bench(args.payload_mb, args.shaped_mbps, args.shaped_mb)
    print(json.dumps(result, indent=2))
    return 0


OVERRIDE = re.compile(r"^[A-Za-z_][\w.]*=")

COMMANDS = {"simulate": _simulate, "bench": _bench}


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    # Overrides (`outer.lr=0.5`) may stand anywhere among the options, so they are collected from what
    # argparse does not know rather than declared as a trailing positional.
    args, extra = parser.parse_known_args(argv)
    bad = [a for a in extra if not OVERRIDE.match(a)]
    if bad or (extra and not getattr(args, "accepts_overrides", False)):
        parser.error(f"unrecognized arguments: {' '.join(bad or extra)} (overrides look like section.key=value)")
    args.overrides = extra
    try:
        return COMMANDS[args.command](args)
    except USER_ERRORS as exc:
        print(f"diloco: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("diloco: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
