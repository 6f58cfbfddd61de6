"""The `diloco` command line: launch, coordinator, island, status, simulate, bench, plot, sample, export, data
prepare, data task, deploy k8s.

Every command takes `--run-dir DIR` (where one applies) and trailing `key=value` config overrides. A user
mistake (config, data, model path, run directory, a refused island ...) is a `floor.errors.UserError`: it ends
with one line on stderr and exit code 2, never a traceback; a bounded wait that ran out (`floor.errors.WaitedTooLong`:
a coordinator away for longer than an island's patience) the same way, with exit code 69, which a supervisor
restarts. Each command imports what it needs when it runs, so
`diloco --help` and `diloco status` start without importing JAX.

Secure by default (diloco/deploy/tls.py): the coordinator listens on loopback unless told otherwise, and beyond loopback
only with island secrets and TLS (or `--insecure`); `--tls-*` flags override the config's `network.tls_*` keys
for this process; everything a command creates (run dirs, checkpoints, logs, keys) is private to the user
(umask 077, inherited by every child process).
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import logging
import os
import re
import signal
import sys
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from diloco import faults
from diloco.ops.logs import configure as configure_logging
from floor.errors import UserError

if TYPE_CHECKING:
    from diloco.config import RunConfig
    from diloco.run.rundir import RunDirLock
    from diloco.worker.island_group import Group


log = logging.getLogger("diloco")


def _add_common(p: argparse.ArgumentParser, with_config: bool = True) -> None:
    if with_config:
        p.add_argument("config", help="TOML run config (e.g. configs/tiny.toml)")
    p.add_argument("--run-dir", type=Path, default=None, help="run directory (default: runs/NAME-TIMESTAMP)")
    p.epilog = "Trailing section.key=value arguments override the config, e.g. outer.lr=0.5 train.mode=sync."
    p.set_defaults(accepts_overrides=True)


def _add_tls(p: argparse.ArgumentParser, server: bool) -> None:
    """--tls-* flags; they override network.tls_* of the config for this process (default None: keep the config)."""
    if server:
        p.add_argument("--tls-cert", default=None, help="PEM server certificate (with --tls-key: serve TLS)")
        p.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
        p.add_argument("--tls-ca", default=None, help="PEM CA of the islands' client certificates (mutual TLS)")
    else:
        p.add_argument("--tls-ca", default=None, help="PEM CA that signed the coordinator's certificate (TLS on)")
        p.add_argument("--tls-cert", default=None, help="PEM client certificate, for a mutual-TLS coordinator")
        p.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
        p.add_argument("--tls-server-name", default=None, help="name to verify in the coordinator's certificate")
    p.add_argument(
        "--insecure",
        action="store_true",
        help="allow what is refused beyond loopback: no secrets, or secrets without TLS",
    )


def _add_logging(p: argparse.ArgumentParser) -> None:
    """--log-format / --log-level on every command (diloco/ops/logs.py; default: DILOCO_LOG_* or text, info)."""
    from diloco.ops.logs import FORMATS, LEVELS

    p.add_argument("--log-format", choices=FORMATS, default=None, help="operational lines as text or one-line JSON")
    p.add_argument("--log-level", choices=LEVELS, default=None, help="the least severe line to print (info)")


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
    coord.add_argument(
        "--listen",
        default="127.0.0.1:50051",
        help="HOST:PORT (port 0: any free port); beyond loopback needs secrets and TLS",
    )
    coord.add_argument("--quiet", action="store_true", help="no status lines")
    coord.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        metavar="N",
        help="serve Prometheus /metrics on port N of the --listen host (default: network.metrics_port; 0: off)",
    )
    _add_tls(coord, server=True)

    isl = sub.add_parser("island", help="one island (region), supervised: restarted when it crashes")
    _add_common(isl)
    isl.add_argument("--name", required=True, help="this island's name (one of islands.names)")
    isl.add_argument(
        "--coordinator",
        default=None,
        help="HOST:PORT of the coordinator (needed by every island process but a multi-process island's "
        "processes 1..N-1, which can take the island over when process 0 is lost for good only with it)",
    )
    isl.add_argument(
        "--secret", default=None, help="env:VAR or file:PATH (a literal works but shows in ps); default: from config"
    )
    isl.add_argument("--no-supervise", action="store_true", help="run the worker in this process, no restarts")
    isl.add_argument("--max-restarts", type=int, default=5)
    isl.add_argument(
        "--retire-on-stop",
        action="store_true",
        help="a clean stop (SIGTERM, Ctrl+C) retires this island for good instead of only leaving: its credentials "
        "are refused from then on (the island's own `diloco retire`)",
    )
    isl.add_argument(
        "--num-processes",
        type=int,
        default=None,
        metavar="N",
        help="processes of this island, one JAX program over all their devices (default: "
        "islands.processes); without --process-id all N run here, supervised as a group",
    )
    isl.add_argument(
        "--process-id",
        type=int,
        default=None,
        metavar="I",
        help="this process's index in a multi-process island (0 leads the island, and talks to the coordinator, "
        "whenever it is there)",
    )
    isl.add_argument(
        "--island-coordinator",
        default=None,
        metavar="HOST:PORT",
        help="where this process serves jax.distributed to the island's processes when it leads the island "
        "(with N > 1; on one host the same for all, across hosts this process's own host)",
    )
    isl.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        metavar="N",
        help="serve Prometheus /metrics on port N of network.metrics_host (default: network.metrics_port "
        "+ 1 + this island's index; 0: off)",
    )
    _add_tls(isl, server=False)

    st = sub.add_parser("status", help="health, membership, round, losses, bytes, rejected messages of a coordinator")
    st.add_argument("address", help="HOST:PORT of the coordinator")
    st.add_argument("--json", action="store_true", help="print the raw status JSON")
    st.add_argument("--watch", action="store_true", help="a live view, redrawn every 2 s until Ctrl+C")
    st.add_argument("--name", default=None, help="an island's name: credentials, needed when the run has secrets")
    st.add_argument("--secret", default=None, help="that island's secret: env:VAR, file:PATH (or a literal)")
    _add_tls(st, server=False)

    adm = sub.add_parser("admit", help="admit a new island into a live run (the operator's credential)")
    _add_common(adm)
    adm.add_argument("name", help="the new island's name ([A-Za-z0-9_-], not yet on the roster)")
    adm.add_argument("--coordinator", required=True, help="HOST:PORT of the live coordinator")
    adm.add_argument(
        "--out", type=Path, required=True, metavar="DIR", help="where the island's credentials are written (0600)"
    )
    adm.add_argument("--operator-secret", default=None, help="env:VAR or file:PATH (default: network.operator_secret)")
    adm.add_argument(
        "--ca-dir",
        type=Path,
        default=None,
        help="a `diloco certs --keep-ca-key` directory: also issue the island's client certificate (mutual TLS)",
    )
    _add_tls(adm, server=False)

    ret = sub.add_parser("retire", help="retire an island of a live run for good (operator, or the island itself)")
    _add_common(ret)
    ret.add_argument("name", help="the island to retire")
    ret.add_argument("--coordinator", required=True, help="HOST:PORT of the live coordinator")
    ret.add_argument("--reason", default="", help="a short note for the run's events")
    ret.add_argument("--operator-secret", default=None, help="env:VAR or file:PATH (default: network.operator_secret)")
    ret.add_argument("--secret", default=None, help="the island's own secret instead: an island retires itself")
    _add_tls(ret, server=False)

    ce = sub.add_parser("certs", help="TLS certificates and island secrets for a federation across machines")
    ce.add_argument("config", help="TOML run config: its islands.names get a certificate and a secret each")
    ce.add_argument("--out", type=Path, required=True, help="directory to write them to (created 0700)")
    ce.add_argument(
        "--host",
        action="append",
        default=[],
        metavar="NAME_OR_IP",
        help="a name or address islands dial the coordinator by (repeat; localhost is in)",
    )
    ce.add_argument("--days", type=int, default=365, help="validity of the certificates")
    ce.add_argument(
        "--keep-ca-key",
        action="store_true",
        help="keep the CA's key (ca.key, 0600) so `diloco admit --ca-dir` can certify islands admitted later",
    )

    from diloco.ops.plot import X_AXES  # no matplotlib, no JAX: imported when a plot is drawn or a run dir read

    pl = sub.add_parser("plot", help="PNG of the global model's eval loss of run dirs (needs the plot extra)")
    pl.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR", help="run directories to overlay")
    pl.add_argument(
        "--out",
        type=Path,
        default=None,
        metavar="FILE.png",
        help="PNG to write (default: FIGURE.png, or FIGURE_vs_X.png with --x; FIGURE is eval_loss unless --figure)",
    )
    pl.add_argument(
        "--x", choices=X_AXES, default=None, help="one panel against this x axis (default: a 2x2 grid of all four)"
    )
    pl.add_argument(
        "--figure",
        default="eval_loss",
        metavar="NAME",
        help="what to draw: eval_loss (default) or a post-training held-out figure (sft_exact_match, rl_reward, ...)",
    )
    pl.add_argument(
        "--label",
        action="append",
        default=[],
        metavar="NAME",
        help="a run's legend label, once per RUN_DIR in order (default: the run dir's name)",
    )
    pl.add_argument("--title", default=None, help="the figure's title")

    sa = sub.add_parser("sample", help="continue prompts with the newest committed model of a run directory")
    sa.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="a run directory (simulate's, launch's, ...)")
    sa.add_argument(
        "--prompt", action="append", required=True, default=None, metavar="TEXT", help="a prompt (repeat: one batch)"
    )
    sa.add_argument(
        "--max-new-tokens", type=int, default=None, metavar="N", help="tokens per continuation (default: up to 128)"
    )
    sa.add_argument("--temperature", type=float, default=1.0, metavar="T", help="0: greedy (default 1)")
    sa.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling's mass in (0, 1] (1: off)")
    sa.add_argument("--seed", type=int, default=0, help="seed of the draws")
    sa.add_argument(
        "--stop",
        default=None,
        metavar="TEXT",
        help="end a continuation at this text, one token (default: a newline for a post-training run, none for lm)",
    )
    sa.add_argument("--json", action="store_true", help="print JSON: each prompt, continuation and token ids")

    ex = sub.add_parser("export", help="the newest committed model of a run as safetensors + config.json")
    ex.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="a run directory (simulate's, launch's, ...)")
    ex.add_argument("--out", type=Path, required=True, metavar="DIR", help="the directory to write (created)")
    ex.add_argument("--force", action="store_true", help="write into a DIR that is not empty (replace an export)")
    ex.add_argument(
        "--format",
        choices=("diloco", "hf", "peft"),
        default="diloco",
        help="diloco: the project's tensor names (default); hf: a Hugging Face directory transformers loads; peft: "
        "a LoRA run's adapters alone, as PEFT saves them (diloco and hf merge them into the base)",
    )
    ex.add_argument("--dtype", default=None, metavar="DTYPE", help="--format hf: float32 (default) or bfloat16")
    ex.add_argument(
        "--max-shard-size", default=None, metavar="SIZE", help="--format hf: shards of at most SIZE (default 5GB)"
    )

    data = sub.add_parser(
        "data", help="training data: `data prepare` tokenizes text, `data task` writes a built-in task's data"
    )
    data_sub = data.add_subparsers(dest="data_command", required=True)
    prep = data_sub.add_parser(
        "prepare",
        help='text -> DIR/tokens.bin, tokenizer.json, meta.json for data.kind = "tokens" (needs the tokenize extra)',
    )
    prep.add_argument("inputs", nargs="+", metavar="INPUT", help="text: files, directories, glob patterns or stdlib:")
    prep.add_argument("--out", type=Path, required=True, metavar="DIR", help="the directory to write (created)")
    how = prep.add_mutually_exclusive_group(required=True)
    how.add_argument("--train-vocab", type=int, metavar="N", help="train a byte-level BPE tokenizer of N ids (>= 256)")
    how.add_argument("--tokenizer", type=Path, metavar="FILE", help="use this Hugging Face tokenizer.json")
    prep.add_argument(
        "--text-field",
        default="text",
        metavar="NAME",
        help="the text field of *.jsonl(.gz) and *.parquet INPUTs (text)",
    )
    prep.add_argument("--no-progress", action="store_true", help="no progress bar")
    from islands.posttrain.task import DEFAULT_DIGITS, TASKS  # NumPy only, no JAX

    task = data_sub.add_parser(
        "task", help="a built-in task's SFT, DPO and RL data (train and held-out JSONL) and pretraining text"
    )
    task.add_argument("name", choices=sorted(TASKS), help="the task")
    task.add_argument("--out", type=Path, required=True, metavar="DIR", help="the directory to write (created)")
    task.add_argument("--n", type=int, default=2000, help="train examples of each kind (2000)")
    task.add_argument("--heldout", type=int, default=500, metavar="N", help="held-out examples of each kind (500)")
    task.add_argument("--pretrain", type=int, default=20000, metavar="N", help="lines of pretrain.txt (20000)")
    task.add_argument("--seed", type=int, default=0, help="which problems, in which order (0)")
    task.add_argument(
        "--digits", type=int, default=DEFAULT_DIGITS, help=f"digits of each operand: the difficulty ({DEFAULT_DIGITS})"
    )
    task.add_argument(
        "--chat", action="store_true", help="conversations (messages), for a run tokenizer with a chat template"
    )

    pln = sub.add_parser("plan", help="per-device memory of an island's step at size, from the config alone (JSON)")
    pln.add_argument("config", help="TOML run config (e.g. configs/llama-3.1-8b.toml)")
    pln.add_argument("--device-gb", type=float, default=80.0, help="each device's memory, GB (80)")
    pln.add_argument("--sample", default=None, metavar="ROWSxLENGTH", help="a generation's KV cache to plan for")
    pln.epilog = (
        "Trailing section.key=value arguments override the config, e.g. islands.devices=64 islands.tensor=8 "
        "model.remat=true: the island's mesh is islands.devices / islands.tensor x islands.tensor."
    )
    pln.set_defaults(accepts_overrides=True)

    from diloco.bench.cli import add_bench_parser  # argparse only: no benchmark module (nor JAX) is imported
    from diloco.deploy.k8s import add_deploy_parser  # argparse only: nothing rendered, no YAML imported

    add_bench_parser(sub)
    deploy, k8s = add_deploy_parser(sub)
    # `data` and `deploy` take none themselves: argparse would let their subcommand's defaults overwrite them.
    for command in [*(c for c in sub.choices.values() if c not in (data, deploy)), prep, task, k8s]:
        _add_logging(command)
    return parser


def _default_run_dir(name: str) -> Path:
    return Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"


def _simulate(args: argparse.Namespace) -> int:
    from diloco.config import ConfigError, load_config
    from diloco.simulator.simulate import run_simulation

    cfg = load_config(args.config, args.overrides)
    if cfg.islands.processes > 1:
        raise ConfigError(
            f"islands.processes = {cfg.islands.processes}: simulate runs every island in this one "
            "process; multi-process islands run under `diloco launch` or `diloco island`"
        )
    run_dir = args.run_dir or _default_run_dir(cfg.run.name)
    summary = run_simulation(cfg, run_dir, show_progress=not args.no_progress)
    print(json.dumps({"run_dir": str(run_dir), **summary}, indent=2))
    return 0


def _data(args: argparse.Namespace) -> int:
    if args.data_command == "task":
        from diloco.ops.task_data import write_task

        meta = write_task(args.name, args.out, args.n, args.heldout, args.pretrain, args.seed, args.digits, args.chat)
        print(json.dumps({"out": str(args.out), **meta}, indent=2))
        return 0
    from diloco.ops.data_prepare import prepare, summary

    meta = prepare(
        args.inputs,
        args.out,
        args.train_vocab,
        args.tokenizer,
        progress=not args.no_progress,
        text_field=args.text_field,
    )
    print(json.dumps(summary(args.out, meta), indent=2))
    return 0


def _by(text: str, flag: str) -> tuple[int, int]:
    """ "8x2" -> (8, 2), else one line naming the flag."""
    from diloco.config import ConfigError

    parts = text.lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ConfigError(f"{flag} must be two positive integers as AxB, e.g. 8x2 (got {text!r})")
    return int(parts[0]), int(parts[1])


def _plan(args: argparse.Namespace) -> int:
    from diloco.config import load_config
    from islands.memory import GB
    from islands.step_memory import advice, check, step_memory, summary

    cfg = load_config(args.config, args.overrides)
    data, tensor = cfg.islands.devices // cfg.islands.tensor, cfg.islands.tensor
    rows, length = _by(args.sample, "--sample") if args.sample else (0, 0)
    lora = cfg.workload.lora if cfg.workload.lora.enabled else None
    shard = cfg.islands.shard_params
    plan = step_memory(
        cfg.model, cfg.train.batch_size, cfg.train.microbatch, data, tensor, shard, lora, cfg.codec.spec("uplink"),
        rows, length, cfg.islands.processes,
    )  # fmt: skip
    print(json.dumps({"config": args.config, "mesh": f"{data}x{tensor}", **summary(plan, int(args.device_gb * GB))}))
    check(plan, args.device_gb, advice(plan, data, tensor, shard, cfg.train.microbatch, lora))
    return 0


def _bench(args: argparse.Namespace) -> int:
    from diloco.bench.cli import run_bench

    print(json.dumps(run_bench(args), indent=2))
    return 0


def _sample(args: argparse.Namespace) -> int:
    from diloco.ops.sample import as_text, sample

    result = sample(args.run_dir, args.prompt, args.max_new_tokens, args.temperature, args.top_p, args.seed, args.stop)
    print(json.dumps(result, indent=2) if args.json else as_text(result))
    return 0


def _export(args: argparse.Namespace) -> int:
    from diloco.ops.export import MAX_SHARD_SIZE, ExportError, export, export_hf, export_peft

    if args.format != "hf" and (args.dtype or args.max_shard_size):
        raise ExportError("--dtype and --max-shard-size apply to --format hf (the project's own is float32, one file)")
    if args.format == "hf":
        shard = args.max_shard_size or MAX_SHARD_SIZE
        written = export_hf(args.run_dir, args.out, args.force, args.dtype or "float32", shard)
    elif args.format == "peft":
        written = export_peft(args.run_dir, args.out, args.force)
    else:
        written = export(args.run_dir, args.out, args.force)
    print(json.dumps({"out": str(args.out), **written}, indent=2))
    return 0


def _plot(args: argparse.Namespace) -> int:
    from diloco.ops.plot import plot

    for path in plot(args.run_dirs, args.out, args.x, args.label, args.title, args.figure):
        print(f"wrote {path}")
    return 0


OVERRIDE = re.compile(r"^[A-Za-z_][\w.]*=")


def _launch(args: argparse.Namespace) -> int:
    from diloco.harness.launch import launch

    cfg = _load(args)
    run_dir = args.run_dir or _default_run_dir(cfg.run.name)
    summary = launch(args.config, args.overrides, run_dir, progress=not args.no_progress)
    print(json.dumps({"run_dir": str(run_dir), **summary}, indent=2))
    return 0


TLS_KEYS = ("tls_cert", "tls_key", "tls_ca", "tls_server_name")


def _load(args: argparse.Namespace) -> RunConfig:
    """The command's config: file + overrides + --tls-* flags, with a warning for literal secrets on the line."""
    from diloco.config import literal_secrets, load_config, with_network

    cfg = load_config(args.config, args.overrides)
    flags = {k: getattr(args, k) for k in TLS_KEYS if getattr(args, k, None) is not None}
    if flags:
        cfg = with_network(cfg, **flags)
    _warn_literal(literal_secrets(cfg))
    return cfg


def _warn_literal(keys: Sequence[str]) -> None:
    """A literal secret on the command line works (tests, a quick try) but other local users can read a process's
    arguments (ps, /proc/PID/cmdline): say so once."""
    if keys:
        log.warning(
            "%s is a literal secret on the command line, readable by other local users (ps); prefer "
            "env:VAR or file:PATH",
            ", ".join(keys),
        )


def _coordinator(args: argparse.Namespace) -> int:
    from diloco.coordinator.serve import serve

    cfg = _load(args)
    run_dir = args.run_dir or _default_run_dir(f"{cfg.run.name}-coordinator")
    serve(cfg, run_dir, args.listen, not args.quiet, insecure=args.insecure, metrics_port_flag=args.metrics_port)
    return 0


def _island(args: argparse.Namespace) -> int:
    from diloco.deploy.tls import check_client_exposure, network_client_tls
    from diloco.worker.island_formation import FormationFiles
    from diloco.worker.island_worker import IslandError, say_gone
    from diloco.worker.supervisor import Member, follow_supervisor, supervise
    from transport.auth import is_secret_reference, resolve_secret

    cfg = _load(args)
    names = cfg.islands.island_names
    if args.name not in names and not args.secret:
        raise IslandError(
            f"island '{args.name}' is not in the config's islands.names ({', '.join(names)}); an island admitted into "
            "a live run (diloco admit) gives the --secret that admit wrote"
        )
    from diloco.ops.metrics import metrics_port

    if args.name in names:
        metrics_port(
            cfg, args.name, args.metrics_port
        )  # a bad port is one line here, not a worker failing at each restart
    from islands.backend import check_backend

    check_backend(cfg.islands.backend)  # likewise a missing pathways extra or proxy environment
    run_dir = args.run_dir or _default_run_dir(f"{cfg.run.name}-{args.name}")
    from diloco.worker.island_group import check_group, lock_name, members, pid_name, run_process

    group = check_group(cfg, args.process_id, args.num_processes, args.island_coordinator)
    if args.no_supervise:
        follow_supervisor()  # a worker under a supervisor does not outlive it (diloco/worker/supervisor.py)
    if group.multiple and args.no_supervise and args.process_id is None:
        raise IslandError("--no-supervise runs one process of the island: give it --process-id I")
    if args.coordinator is None and (group.process_id == 0 or not group.multiple):
        raise IslandError("--coordinator HOST:PORT is needed (the island's process 0 talks to the coordinator)")
    # Settled before supervising: a secret that does not resolve, a bad TLS file or a secret about to travel in
    # clear is one line from the command the user typed, not a worker that fails again at every restart. A process
    # I > 0 given --coordinator can lead the island when process 0 is lost for good (diloco/worker/island_formation.py).
    secret, tls = None, None
    if args.coordinator is not None:
        ref = args.secret or (cfg.network.secrets[names.index(args.name)] if cfg.network.secrets else None)
        if args.secret and not is_secret_reference(args.secret):
            _warn_literal(["--secret"])
        secret = resolve_secret(ref) if ref else None
        tls = network_client_tls(cfg.network)
        check_client_exposure(
            args.coordinator, sends_secret=secret is not None, encrypted=tls is not None, insecure=args.insecure
        )
    gone = partial(say_gone, cfg, args.name, args.coordinator, secret, tls) if args.coordinator is not None else None
    if not args.no_supervise:
        argv = [a for a in (sys.argv[1:] if args.argv is None else args.argv) if a != "--no-supervise"]
        worker_argv = [*argv, "--no-supervise", "--run-dir", str(run_dir)]
        if group.multiple and args.process_id is None:  # every process of the island, here: one group
            return supervise(
                members(worker_argv, group, cfg.islands.devices), run_dir, args.max_restarts, on_death=gone
            )
        if group.multiple:  # one process of the island, on its host: it speaks for the island when it led it
            me, files = group.process_id, FormationFiles(run_dir, group.num_processes)
            led_gone = None if gone is None else (lambda why: gone(why) if files.led_by(me) else None)
            member = Member(worker_argv, pid_file=pid_name(me))
            return supervise([member], run_dir, args.max_restarts, on_death=led_gone, lock_name=lock_name(me))
        return supervise(worker_argv, run_dir, args.max_restarts, on_death=gone)
    if group.multiple:
        lead = None if args.coordinator is None else partial(_lead_island, args, cfg, run_dir, secret, group)
        return run_process(cfg, args.name, run_dir, group, lead)
    return _lead_island(args, cfg, run_dir, secret, group)


def _lead_island(
    args: argparse.Namespace,
    cfg: RunConfig,
    run_dir: Path,
    secret: str | None,
    group: Group,
    lock: RunDirLock | None = None,
) -> int:
    """Run the island's worker (a multi-process island's leader holds run.lock: `lock`); print its result."""
    from diloco.worker.island_worker import run_island_process
    from diloco.worker.supervisor import REGROUP

    result = run_island_process(
        cfg, args.name, args.coordinator, run_dir, secret, args.metrics_port, group, args.retire_on_stop, lock
    )
    print(json.dumps(result), flush=True)
    return REGROUP if result.get("reform") else 0


def _certs(args: argparse.Namespace) -> int:
    from diloco.config import load_config
    from diloco.deploy.tls import OPERATOR_CLIENT, TlsSetupError, make_federation_kit

    if args.days < 1:
        raise TlsSetupError(f"--days must be >= 1 (got {args.days})")
    if args.out.exists() and any(args.out.iterdir()):
        raise TlsSetupError(f"--out {args.out} is not empty: certificates and secrets are never overwritten")
    names = load_config(args.config, []).islands.island_names
    kit = make_federation_kit(args.out, names, args.host, args.days, keep_ca_key=args.keep_ca_key)
    islands = {
        name: {
            "cert": str(kit.client(name)[0]),
            "key": str(kit.client(name)[1]),
            "secret": f"file:{args.out / 'secrets' / name}",
        }
        for name in names
    }
    out = {
        "ca": str(kit.ca),
        "server_cert": str(kit.server_cert),
        "server_key": str(kit.server_key),
        "islands": islands,
    }
    if args.keep_ca_key:
        cert, key = kit.client(OPERATOR_CLIENT)
        out |= {"ca_key": str(args.out / "ca.key"), "operator": {"cert": str(cert), "key": str(key)}}
    print(json.dumps(out, indent=2))
    return 0


def _operator_client_tls(cfg: RunConfig, address: str, args: argparse.Namespace, sends_secret: bool) -> Any:
    from diloco.deploy.tls import check_client_exposure, network_client_tls

    tls = network_client_tls(cfg.network)
    check_client_exposure(address, sends_secret=sends_secret, encrypted=tls is not None, insecure=args.insecure)
    return tls


def _admit(args: argparse.Namespace) -> int:
    from diloco.ops.roster_ops import admit_island

    cfg = _load(args)
    operator = args.operator_secret or cfg.network.operator_secret
    _warn_if_literal(args.operator_secret, "--operator-secret")
    tls = _operator_client_tls(cfg, args.coordinator, args, sends_secret=True)
    kit = admit_island(args.coordinator, cfg.run.name, args.name, operator, args.out, tls, args.ca_dir)
    print(json.dumps(kit, indent=2), flush=True)
    return 0


def _retire(args: argparse.Namespace) -> int:
    from diloco.ops.roster_ops import retire_island

    cfg = _load(args)
    _warn_if_literal(args.operator_secret, "--operator-secret")
    _warn_if_literal(args.secret, "--secret")
    operator = args.operator_secret or ("" if args.secret else cfg.network.operator_secret)
    tls = _operator_client_tls(cfg, args.coordinator, args, sends_secret=True)
    done = retire_island(args.coordinator, cfg.run.name, args.name, args.reason, tls, operator, args.secret or "")
    print(json.dumps(done), flush=True)
    return 0


def _warn_if_literal(ref: str | None, flag: str) -> None:
    from transport.auth import is_secret_reference

    if ref and not is_secret_reference(ref):
        _warn_literal([flag])


def _deploy(args: argparse.Namespace) -> int:
    from diloco.deploy.k8s import run_deploy

    return run_deploy(args)


def _status(args: argparse.Namespace) -> int:
    from diloco.deploy.tls import check_client_exposure, client_tls
    from diloco.ops.status import StatusError, show_status
    from transport.auth import is_secret_reference, resolve_secret

    if bool(args.name) != bool(args.secret):
        raise StatusError("--name and --secret go together: they are one island's credentials")
    if args.secret and not is_secret_reference(args.secret):
        _warn_literal(["--secret"])
    secret = resolve_secret(args.secret) if args.secret else None
    tls = client_tls(*(getattr(args, k) or "" for k in ("tls_ca", "tls_cert", "tls_key", "tls_server_name")))
    check_client_exposure(
        args.address, sends_secret=secret is not None, encrypted=tls is not None, insecure=args.insecure
    )
    return show_status(args.address, args.json, island=args.name, secret=secret, tls=tls, watch=args.watch)


COMMANDS = {
    "simulate": _simulate,
    "launch": _launch,
    "coordinator": _coordinator,
    "island": _island,
    "status": _status,
    "certs": _certs,
    "admit": _admit,
    "retire": _retire,
    "bench": _bench,
    "plan": _plan,
    "plot": _plot,
    "sample": _sample,
    "export": _export,
    "deploy": _deploy,
    "data": _data,
}


PRIVATE_UMASK = 0o077
"""Everything diloco creates is the user's alone (dirs 0700, files 0600): run dirs hold the model (checkpoints),
metrics, logs and launch's TLS keys. A umask, rather than a chmod per file, also covers what libraries write
(orbax checkpoints) and every child process (the umask is inherited across fork and exec)."""


def main(argv: Sequence[str] | None = None) -> int:
    previous_umask = os.umask(PRIVATE_UMASK)
    try:
        return _main(argv)
    finally:
        os.umask(previous_umask)  # only matters when main() is called in-process (tests)


def _main(argv: Sequence[str] | None) -> int:
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
        configure_logging(args.log_format, args.log_level)
        faults.armed()  # a malformed DILOCO_PAUSE_AT stops every command here, with one line
        return COMMANDS[args.command](args)
    except (UserError, faults.FaultSpecError) as exc:
        log.error("%s", exc)
        return exc.exit_code if isinstance(exc, UserError) else 2
    except KeyboardInterrupt:
        log.warning("interrupted")
        return 130


def run() -> NoReturn:
    """The process's entry point (the `diloco` script, `python -m diloco.cli`): `main`, then leave at once.

    Everything a command keeps is written by the time `main` returns (checkpoints waited for, summary and logs
    flushed). Exiting through the interpreter's teardown instead can abort a finished process: a native thread that
    gRPC or XLA still runs (a server's poller, a channel's) is unwound by the exiting interpreter and the C++
    runtime aborts ("FATAL: exception not rethrown", exit status 134), seen once on a coordinator that had just
    written its summary. A supervisor or a script would take that for a crash.

    SIGUSR1 writes every thread's stack to stderr and the process goes on (faulthandler: no interpreter lock needed,
    so a process stuck in a C call answers too): how a hung island or coordinator says where it waits
    (`kill -USR1 PID`; the test harness asks each live process so when a wait of its runs out)."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    code = main()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    logging.shutdown()
    os._exit(code)


if __name__ == "__main__":
    run()
