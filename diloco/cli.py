"""The `diloco` command line: launch, coordinator, island, status, simulate, bench.

Every command takes `--run-dir DIR` (where one applies) and trailing `key=value` config overrides. A user
mistake (config, data, model path, run directory, a refused island ...) is a `transport.errors.UserError`: it ends
with one line on stderr and exit code 2, never a traceback. Each command imports what it needs when it runs, so
`diloco --help` and `diloco status` start without importing JAX.
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

from transport.errors import UserError


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

    from diloco.bench import add_bench_parser  # argparse only: no benchmark module (nor JAX) is imported

    add_bench_parser(sub)
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
    from diloco.bench import run_bench

    print(json.dumps(run_bench(args), indent=2))
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
    except UserError as exc:
        print(f"diloco: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("diloco: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
