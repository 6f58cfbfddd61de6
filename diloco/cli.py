"""The `diloco` command line: simulate, bench (launch, coordinator, island, status follow the federation issue).

Every command takes `--run-dir DIR` (where one applies) and trailing `key=value` config overrides. A user
mistake (config, data, model path, run directory) ends with one line on stderr and exit code 2, never a
traceback.
"""

from __future__ import annotations

import argparse
import json
import os
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

    launch = sub.add_parser("launch", help="coordinator + one process per island on this machine, WAN shaped")
    _add_common(launch)
    launch.add_argument("--no-progress", action="store_true", help="no live display")

    coord = sub.add_parser("coordinator", help="the global coordinator (gRPC server)")
    _add_common(coord)
    coord.add_argument("--listen", default="0.0.0.0:50051", help="HOST:PORT to listen on (port 0: any free port)")
    coord.add_argument("--quiet", action="store_true", help="no status lines")

    isl = sub.add_parser("island", help="one island (region), supervised: restarted when it crashes")
    _add_common(isl)
    isl.add_argument("--name", required=True, help="this island's name (one of islands.names)")
    isl.add_argument("--coordinator", required=True, help="HOST:PORT of the coordinator")
    isl.add_argument("--secret", default=None, help="secret: literal, env:VAR or file:PATH (default: from config)")
    isl.add_argument("--no-supervise", action="store_true", help="run the worker in this process, no restarts")
    isl.add_argument("--max-restarts", type=int, default=5)

    st = sub.add_parser("status", help="membership, round, losses, bytes, rejected messages of a coordinator")
    st.add_argument("address", help="HOST:PORT of the coordinator")
    st.add_argument("--json", action="store_true", help="print the raw status JSON")

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
    from diloco.bench_federation import add_parsers

    add_parsers(bsub)  # recovery, faults
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
    elif args.bench in ("recovery", "faults"):
        from diloco.bench_federation import run_from_args

        result = run_from_args(args)
    elif args.bench == "codec":
        from diloco.bench_codec import run_codec_bench

        result = run_codec_bench(args.size_mb, args.repeats)
    else:
        from diloco.bench_transport import run_transport_bench

        result = run_transport_bench(args.payload_mb, args.shaped_mbps, args.shaped_mb)
    print(json.dumps(result, indent=2))
    return 0


OVERRIDE = re.compile(r"^[A-Za-z_][\w.]*=")


def _launch(args: argparse.Namespace) -> int:
    from diloco.config import load_config
    from diloco.launch import launch

    cfg = load_config(args.config, args.overrides)
    run_dir = args.run_dir or _default_run_dir(cfg.run.name)
    summary = launch(args.config, args.overrides, run_dir, progress=not args.no_progress)
    print(json.dumps({"run_dir": str(run_dir), **summary}, indent=2))
    return 0


def _coordinator(args: argparse.Namespace) -> int:
    from diloco.config import load_config
    from diloco.serve import serve

    cfg = load_config(args.config, args.overrides)
    serve(cfg, args.run_dir or _default_run_dir(f"{cfg.run.name}-coordinator"), args.listen, not args.quiet)
    return 0


def _island(args: argparse.Namespace) -> int:
    from diloco.config import load_config
    from diloco.island_worker import IslandError, run_island_process
    from diloco.supervisor import supervise
    from transport.auth import resolve_secret

    cfg = load_config(args.config, args.overrides)
    names = cfg.islands.island_names
    if args.name not in names:
        raise IslandError(f"island '{args.name}' is not in the config's islands.names ({', '.join(names)})")
    run_dir = args.run_dir or _default_run_dir(f"{cfg.run.name}-{args.name}")
    if not args.no_supervise:
        argv = [a for a in (sys.argv[1:] if args.argv is None else args.argv) if a != "--no-supervise"]
        return supervise([*argv, "--no-supervise", "--run-dir", str(run_dir)], run_dir, args.max_restarts)
    ref = args.secret or (cfg.network.secrets[names.index(args.name)] if cfg.network.secrets else None)
    secret = resolve_secret(ref) if ref else None
    result = run_island_process(cfg, args.name, args.coordinator, run_dir, secret)
    print(json.dumps(result), flush=True)
    return 0


def _status(args: argparse.Namespace) -> int:
    from diloco.status import show_status

    return show_status(args.address, args.json)


COMMANDS = {
    "simulate": _simulate,
    "launch": _launch,
    "coordinator": _coordinator,
    "island": _island,
    "status": _status,
    "bench": _bench,
}


def main(argv: Sequence[str] | None = None) -> int:
    # gRPC's C core logs its own errors to stderr; diloco reports them as one line instead (override to debug).
    os.environ.setdefault("GRPC_VERBOSITY", "NONE")
    parser = build_parser()
    # Overrides (`outer.lr=0.5`) may stand anywhere among the options, so they are collected from what
    # argparse does not know rather than declared as a trailing positional.
    args, extra = parser.parse_known_args(argv)
    bad = [a for a in extra if not OVERRIDE.match(a)]
    if bad or (extra and not getattr(args, "accepts_overrides", False)):
        parser.error(f"unrecognized arguments: {' '.join(bad or extra)} (overrides look like section.key=value)")
    args.overrides = extra
    args.argv = list(argv) if argv is not None else None
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
