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
    "scaling": "DiLoCo / data-parallel at several model sizes, each method at its best: the gap against size",
    "codec": "pseudo-gradient codecs: ratio, GB/s, error",
    "transport": "gRPC goodput on loopback, unshaped and shaped; receiver peak memory",
    "recovery": "time for a SIGKILLed island to rejoin vs params/bandwidth + 10 s",
    "failover": "how long the survivors stall when an island's worker or host is SIGKILLed or frozen (bound 5 s)",
    "faults": "final eval loss with an island killed at R/3, back at 2R/3, vs fault-free",
    "byzantine": "final eval loss with one Byzantine island of 4, per aggregation rule and attack, vs fault-free",
    "fuzz": "hostile messages of every RPC against a real coordinator: statuses, RSS, liveness, a round after",
    "fuzz-decoders": "coverage-guided fuzzing (atheris) of the codecs, header, chunk and push-meta parsers",
    "load": "one coordinator process under many light gRPC islands: round time, RSS, CPU, bytes",
    "soak": "seeded SIGKILLs of islands and the coordinator over many rounds: digests, loss vs fault-free",
    "streaming": "Streaming DiLoCo (P fragments, overlap τ) vs plain DiLoCo at the same H: loss, bytes per sync",
    "sync": "a real federation's sync time per island (end of step H to the next step) and the close's parts",
    "colocation": "islands sharing a host: inner-step time against their fair share of the cores (threads, pinning)",
    "utilization": "compute utilization over WAN links: plain DiLoCo vs its cost model vs Streaming with overlap",
    "heterogeneous": "one island 2x slower: plain vs time-budgeted vs async DiLoCo on one virtual time axis",
    "elastic": "islands admitted, killed and back, retired, lost, then the run lengthened: digests, exactly-once, loss",
    "churn": "islands admitted, joined and retired against one coordinator: RSS, roster.json and Status, bounded",
    "churn-soak": "cycles of admit, retire, kills, resume with another roster: exactly-once, digests, exits, RSS, disk",
    "roster-sweep": "simulate under roster scripts (a join, a retirement, a kill, all three): final eval loss each",
    "simulator": "simulate's islands stepped in turn vs as one program (train.vectorize): wall time, speedup, max |Δ|",
    "generate": "KV-cache generation vs the training step of one model: tokens/s, first-token time, per-token decode",
    "posttrain": "SFT, DPO and RL: DiLoCo vs one island vs data-parallel on the same samples, whole held-out split",
    "models": "the Llama family's block vs the GPT-2 block at equal parameters: step time and their ratio",
    "big": "a big model under launch (SmolLM2-135M-shaped): each process's peak memory vs its plan, tokens/s, bytes",
    "plan": "the memory plan at size against XLA's per-device figure for a small Llama; --table: 1B, 8B, 70B",
    "accelerator": "MFU, tokens/s and plain / streaming utilization on the device JAX finds, 1 island and several",
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
    _add_fuzz(parsers["fuzz"])
    fd = parsers["fuzz-decoders"]
    fd.add_argument("--targets", default="codec,sparse,header,chunk,push_meta", help="comma-separated fuzz targets")
    fd.add_argument("--runs", type=int, default=2_000_000, help="libFuzzer executions per target (at most)")
    fd.add_argument("--seconds", type=int, default=120, help="time per target (at most)")

    ov = parsers["overhead"]
    _with_config(ov, run_dir=False)
    ov.add_argument("--repeats", type=int, default=5, help="ABBA pairs of timed runs")
    ov.add_argument("--steps", type=int, default=50, help="inner steps per timed run")

    conv = parsers["convergence"]
    _with_config(conv)
    conv.add_argument("--islands", type=int, default=4, help="M, the islands of the DiLoCo and sync runs")
    conv.add_argument(
        "--grid",
        action="append",
        default=[],
        metavar="METHOD:KEY=V1,V2",
        help="a method's hyperparameter grid (METHOD: L1, LM, Ls or all; repeat): each method is "
        "compared at its best point",
    )
    conv.add_argument("--vectorize", action="store_true", help="the DiLoCo runs step their islands as one program")
    conv.add_argument(
        "--warm-start",
        type=int,
        default=0,
        metavar="STEPS",
        help="pretrain one island STEPS steps (the inner optimizer alone), then run each method from it",
    )
    conv.add_argument(
        "--warm-protocol",
        choices=("restart", "continue"),
        default="restart",
        help="restart: each method takes the pretraining's θ, with a fresh inner optimizer and schedule; continue: "
        "its inner state and schedule too (one schedule over the whole budget, the papers' warm start)",
    )

    sc = parsers["scaling"]
    _with_config(sc)
    sc.add_argument("--islands", type=int, default=4, help="M, the islands of the DiLoCo and sync runs")
    sc.add_argument(
        "--size",
        action="append",
        default=[],
        metavar="NAME:KEY=V[,KEY=V]",
        help="a model size: overrides of the config (repeat, smallest first)",
    )
    sc.add_argument(
        "--grid",
        action="append",
        default=[],
        metavar="[NAME@]METHOD:KEY=V1,V2",
        help="a method's grid (METHOD: LM, Ls or all), for every size or, prefixed NAME@, for one",
    )
    sc.add_argument("--vectorize", action="store_true", help="the DiLoCo runs step their islands as one program")
    sc.add_argument("--plot", type=Path, default=None, metavar="PNG", help="draw LM / Ls against parameters here")

    codec = parsers["codec"]
    codec.add_argument("--size-mb", type=float, default=64.0, help="MiB of float32 pseudo-gradient")
    codec.add_argument("--repeats", type=int, default=5, help="timed calls per codec (median)")
    codec.add_argument("--chunk", type=int, default=4096, help="sparse codec: values per chunk")
    codec.add_argument("--density", type=float, default=1 / 64, help="sparse codec: fraction of each chunk kept")
    codec.add_argument("--sparse-bits", type=int, default=2, help="sparse codec: bits per kept value (2..8)")
    codec.add_argument(
        "--pieces", type=int, default=8, help="row blocks of the pieces-against-whole comparison (<2: none)"
    )

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
    fo = parsers["failover"]
    _with_config(fo)
    fo.add_argument("--victim", default=None, help="island to kill (default: the last name)")
    fo.add_argument("--kill-after", type=int, default=2, help="committed rounds before the victim is killed")
    fo.add_argument("--factor", type=float, default=3.0, help="how much slower the victim steps (it pushes last)")
    fo.add_argument(
        "--how",
        default="worker",
        help="worker: SIGKILL its worker (the supervisor lives); host: SIGKILL "
        "supervisor and worker; freeze: SIGSTOP both (nothing answers)",
    )
    _add_byzantine(parsers["byzantine"])
    st = parsers["streaming"]
    _with_config(st)
    st.add_argument("--fragments", type=int, default=4, help="P, the fragments of the streaming run")
    st.add_argument("--overlap", type=int, default=1, help="τ, inner steps before a sent fragment is merged")
    st.add_argument("--alpha", type=float, default=0.0, help="α of the merge (0: take the global fragment)")
    co = parsers["colocation"]
    _with_config(co, run_dir=False)
    co.add_argument("--islands", type=int, default=3, help="island processes training at once")
    co.add_argument("--steps", type=int, default=20, help="timed inner steps per process (median)")
    _with_config(parsers["sync"])
    parsers["sync"].add_argument("--rounds", type=int, default=8, help="rounds of the run (the first is left out)")
    ut = parsers["utilization"]
    _with_config(ut)
    ut.add_argument("--rounds", type=int, default=6, help="rounds of each run (each island's first push is left out)")
    ut.add_argument("--fragments", type=int, default=5, help="P, the fragments of the streaming run")
    ut.add_argument("--overlap", type=int, default=2, help="τ, inner steps before a sent fragment is merged")
    ut.add_argument(
        "--kernel-link",
        type=float,
        default=None,
        metavar="MBIT",
        help="run both federations in one network namespace whose loopback tc tbf shapes to MBIT Mbit/s, "
        "shared by all islands both ways; the user-space shaper off (root, ip and tc)",
    )
    ut.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME:KEY=V[,KEY=V]",
        help="overrides run side by side, each as a plain and a streaming federation on the same links (repeat; "
        "e.g. fp32:codec.uplink=fp32,codec.downlink=fp32)",
    )
    _add_load(parsers["load"])
    _with_config(parsers["elastic"])
    churn = parsers["churn"]
    _with_config(churn)
    churn.add_argument("--cycles", type=int, default=1000, help="admit, join, retire cycles (default 1000)")
    churn.add_argument("--warm-up", type=int, default=100, help="cycles before the figures compared (default 100)")
    _add_soak(parsers["soak"])
    _add_churn_soak(parsers["churn-soak"])
    _add_heterogeneous(parsers["heterogeneous"])
    _with_config(parsers["roster-sweep"])
    sim = parsers["simulator"]
    _with_config(sim)
    sim.add_argument("--islands", type=int, default=4, help="M, the islands of both runs")
    sim.add_argument("--rounds", type=int, default=None, help="rounds of both runs (default: the config's)")
    gen = parsers["generate"]
    _with_config(gen, run_dir=False)
    gen.add_argument("--batch", type=int, default=None, help="prompts per generation (default: train.batch_size)")
    gen.add_argument("--new-tokens", type=int, default=None, help="N, tokens per prompt (default: what P leaves)")
    gen.add_argument("--prompt-len", type=int, default=None, help="P, tokens per prompt (default: model.seq_len / 2)")
    gen.add_argument("--repeats", type=int, default=5, help="timed runs of each (median)")
    _add_posttrain(parsers["posttrain"])
    _add_models(parsers["models"])
    big = parsers["big"]
    _with_config(big)
    big.add_argument("--rounds", type=int, default=None, help="rounds of the run (default: the config's)")
    big.add_argument("--smoke", action="store_true", help="the config's family at a few hundred thousand parameters")
    parsers["plan"].add_argument("--table", action="store_true", help="add the plan at size of the Llama 3 shapes")
    _add_accelerator(parsers["accelerator"])


def _add_models(p: argparse.ArgumentParser) -> None:
    p.add_argument("--d-model", type=int, default=256, help="D, the width of every stack")
    p.add_argument("--heads", type=int, default=8, help="attention (query) heads")
    p.add_argument("--kv-heads", type=int, default=2, help="key/value heads of the grouped-query row")
    p.add_argument("--layers", type=int, default=4, help="blocks per stack")
    p.add_argument("--batch", type=int, default=8, help="B, sequences per step")
    p.add_argument("--seq-len", type=int, default=256, help="T, tokens per sequence")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="the compute dtype")
    p.add_argument("--steps", type=int, default=5, help="steps per timed run")
    p.add_argument("--repeats", type=int, default=5, help="timed runs of each stack (median)")


class _IslandCounts(argparse.Action):
    """`--islands 1 2`: the island counts. A key=value after them is an override, which may stand anywhere among the
    options (diloco/cli.py): argparse hands it to this option, which keeps it in `overrides_after` for the runner."""

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any, option: str | None = None
    ) -> None:
        counts, later = [], []
        for value in values:
            if value.lstrip("-").isdigit():
                counts.append(int(value))
            elif "=" in value:
                later.append(value)
            else:
                parser.error(f"argument {option}: {value!r} is neither an island count nor a key=value override")
        if not counts:
            parser.error(f"argument {option}: expected at least one island count")
        setattr(namespace, self.dest, counts)
        namespace.overrides_after = [*getattr(namespace, "overrides_after", []), *later]


def _add_accelerator(p: argparse.ArgumentParser) -> None:
    _with_config(p)
    p.add_argument(
        "--islands", nargs="+", action=_IslandCounts, default=[1, 2], metavar="N", help="island counts (default 1 2)"
    )
    p.add_argument("--rounds", type=int, default=None, help="rounds of each run, the first 2 left out (default 5)")
    p.add_argument("--fragments", type=int, default=5, help="P, the fragments of the streaming runs")
    p.add_argument("--overlap", type=int, default=2, help="τ, inner steps before a sent fragment is merged")
    p.add_argument("--smoke", action="store_true", help="the config's family at a few hundred thousand parameters")
    p.add_argument(
        "--peak-tflops", type=float, default=None, help="one device's peak TFLOP/s (default: by its kind; none on CPU)"
    )


def _add_posttrain(p: argparse.ArgumentParser) -> None:
    _with_config(p)
    p.add_argument("--pretrained", type=Path, required=True, metavar="RUN_DIR", help="the run SFT starts from")
    p.add_argument("--dpo", default=None, metavar="OVERRIDES", help="the DPO stage's overrides (default: README's)")
    p.add_argument("--rl", default=None, metavar="OVERRIDES", help="the RL stage's overrides (default: README's)")
    p.add_argument("--heldout", type=int, default=None, help="held-out problems to score (default: the whole split)")
    p.add_argument("--columns", default=None, help="comma-separated columns to run (default: diloco,one,sync)")
    p.add_argument(
        "--lora",
        default=None,
        metavar="OVERRIDES",
        help='compare LoRA ("workload.lora.rank=8 ...") with full fine-tuning, SFT and GRPO, instead of the columns',
    )


def _add_fuzz(p: argparse.ArgumentParser) -> None:
    p.add_argument("--messages", type=int, default=5000, help="hostile messages, half with secrets, half without")
    p.add_argument("--seed", type=int, default=0, help="seed of the messages")
    p.add_argument("--run-dir", type=Path, default=None, help="where the runs go (default: runs/bench-fuzz-TIME)")


def _add_byzantine(p: argparse.ArgumentParser) -> None:
    _with_config(p, run_dir=False)
    attacks, rules = "scale,signflip,random,maxfinite", "mean,norm_clip,trimmed_mean,median"
    p.add_argument("--attacks", default=attacks, help=f"what the Byzantine island pushes (default {attacks})")
    p.add_argument("--rules", default=rules, help=f"outer.aggregate values to compare (default {rules})")
    p.add_argument("--islands", type=int, default=4, help="islands in all, the last of islands.names Byzantine")


def _with_own_config(p: argparse.ArgumentParser) -> None:
    """A benchmark that writes its own config: `--run-dir`, and trailing key=value arguments that override it."""
    p.add_argument("--run-dir", type=Path, default=None, help="where the runs go (default: runs/bench-NAME-TIME)")
    p.epilog = "Trailing section.key=value arguments override the benchmark's own config."
    p.set_defaults(accepts_overrides=True)


def _add_load(p: argparse.ArgumentParser) -> None:
    _with_own_config(p)
    p.add_argument("--islands", type=int, default=64, help="light islands (client threads) of the coordinator")
    p.add_argument("--rounds", type=int, default=20, help="rounds every island pushes to")
    p.add_argument(
        "--admit",
        type=int,
        default=0,
        help="islands admitted while the run goes on (over the first half of the rounds)",
    )


def _add_soak(p: argparse.ArgumentParser) -> None:
    _with_own_config(p)
    p.add_argument("--rounds", type=int, default=50, help="rounds of each run")
    p.add_argument("--island-kills", type=int, default=10, help="island SIGKILLs, each restarted")
    p.add_argument("--coordinator-kills", type=int, default=2, help="coordinator SIGKILLs, each restarted")
    p.add_argument("--seed", type=int, default=0, help="seed of the kill plan (times, victims, restart delays)")
    p.add_argument("--no-fault-free", action="store_true", help="skip the fault-free run and the loss comparison")


def _add_churn_soak(p: argparse.ArgumentParser) -> None:
    _with_own_config(p)
    length = p.add_mutually_exclusive_group()
    length.add_argument("--cycles", type=int, default=None, help="cycles to run (default: the warm-up + 2)")
    length.add_argument("--minutes", type=float, default=None, help="run cycles until this many minutes have passed")
    p.add_argument("--warm-up", type=int, default=None, help="cycles before RSS and disk are compared (default 3)")
    p.add_argument("--seed", type=int, default=0, help="seed of the run and of its corpus")


HETEROGENEOUS_CONFIG = "configs/convergence.toml"
"""`bench heterogeneous`'s config when none is given: the convergence benchmark's model."""


def _add_heterogeneous(p: argparse.ArgumentParser) -> None:
    _with_config(p)
    config = next(a for a in p._actions if a.dest == "config")
    config.nargs, config.default = "?", HETEROGENEOUS_CONFIG
    config.help = f"TOML run config (default {HETEROGENEOUS_CONFIG})"
    p.add_argument("--rounds", type=int, default=8, help="rounds of the plain run (the others run as long)")
    p.add_argument("--islands", type=int, default=3, help="islands, the last of them slowed down")
    p.add_argument("--factor", type=float, default=2.0, help="how many times slower the last island is")
    p.add_argument("--target", type=float, default=1.02, help="target eval loss as a multiple of plain's final one")


def _run_dir(args: argparse.Namespace) -> Path:
    return args.run_dir or Path("runs") / f"bench-{args.bench}-{time.strftime('%Y%m%d-%H%M%S')}"


def _overhead(args: argparse.Namespace) -> Result:
    from diloco.bench.overhead import run_overhead_bench
    from diloco.config import load_config

    return run_overhead_bench(load_config(args.config, args.overrides), args.steps, args.repeats)


def _convergence(args: argparse.Namespace) -> Result:
    from diloco.bench.convergence import run_convergence_bench
    from diloco.config import load_config

    cfg = load_config(args.config, args.overrides)
    return run_convergence_bench(
        cfg, _run_dir(args), args.islands, args.grid, args.warm_start, args.vectorize, args.warm_protocol
    )


def _scaling(args: argparse.Namespace) -> Result:
    from diloco.bench.scaling import run_scaling_bench
    from diloco.config import load_config

    cfg = load_config(args.config, args.overrides)
    return run_scaling_bench(cfg, _run_dir(args), args.size, args.islands, args.grid, args.vectorize, args.plot)


def _codec(args: argparse.Namespace) -> Result:
    from diloco.bench.codec import run_codec_bench
    from diloco.bench.errors import BenchError
    from floor.codec import CodecError, CodecSpec

    try:
        sparse = CodecSpec("sparse", args.chunk, density=args.density, sparse_bits=args.sparse_bits)
    except CodecError as exc:
        raise BenchError(f"bench codec: {exc}") from None
    return run_codec_bench(args.size_mb, args.repeats, sparse=sparse, pieces=args.pieces)


def _transport(args: argparse.Namespace) -> Result:
    from diloco.bench.transport import run_transport_bench

    return run_transport_bench(args.payload_mb, args.shaped_mbps, args.shaped_mb)


def _recovery(args: argparse.Namespace) -> Result:
    from diloco.bench.federation import run_recovery_bench

    return run_recovery_bench(args.config, args.overrides, _run_dir(args), args.victim, args.kill_after)


def _failover(args: argparse.Namespace) -> Result:
    from diloco.bench.federation import run_failover_bench

    return run_failover_bench(
        args.config, args.overrides, _run_dir(args), args.victim, args.kill_after, args.factor, args.how
    )


def _faults(args: argparse.Namespace) -> Result:
    from diloco.bench.federation import run_fault_bench

    return run_fault_bench(args.config, args.overrides, _run_dir(args), args.victim)


def _load(args: argparse.Namespace) -> Result:
    from diloco.bench.load import run_load_bench

    return run_load_bench(args.islands, args.rounds, _run_dir(args), args.overrides, admit=args.admit)


def _elastic(args: argparse.Namespace) -> Result:
    from diloco.bench.elastic import run_elastic_bench

    return run_elastic_bench(args.config, args.overrides, _run_dir(args))


def _churn(args: argparse.Namespace) -> Result:
    from diloco.bench.churn import run_churn_bench

    return run_churn_bench(args.config, args.overrides, _run_dir(args), args.cycles, args.warm_up)


def _churn_soak(args: argparse.Namespace) -> Result:
    from diloco.bench.churn_soak import WARM_UP_CYCLES, ChurnPlan, run_churn_soak_bench

    warm_up = WARM_UP_CYCLES if args.warm_up is None else args.warm_up
    cycles = warm_up + 2 if args.cycles is None and args.minutes is None else args.cycles
    plan = ChurnPlan(cycles=cycles, minutes=args.minutes, warm_up=warm_up, seed=args.seed)
    return run_churn_soak_bench(plan, _run_dir(args), args.overrides)


def _soak(args: argparse.Namespace) -> Result:
    from diloco.bench.soak import SoakPlan, run_soak_bench

    plan = SoakPlan(args.rounds, args.island_kills, args.coordinator_kills, args.seed)
    return run_soak_bench(plan, _run_dir(args), args.overrides, fault_free=not args.no_fault_free)


def _fuzz(args: argparse.Namespace) -> Result:
    from diloco.bench.fuzz import run_fuzz_bench

    return run_fuzz_bench(args.messages, args.seed, _run_dir(args))


def _fuzz_decoders(args: argparse.Namespace) -> Result:
    from diloco.bench.fuzz_decoders import run_fuzz_decoders

    return run_fuzz_decoders([t for t in args.targets.split(",") if t], args.runs, args.seconds)


def _byzantine(args: argparse.Namespace) -> Result:
    from diloco.bench.byzantine import ATTACKS, run_byzantine_bench
    from diloco.bench.errors import parse_names
    from diloco.config import load_config
    from outer_optimizer.config import RULES

    attacks = parse_names(args.attacks, list(ATTACKS), "bench byzantine: --attacks")
    rules = parse_names(args.rules, RULES, "bench byzantine: --rules")
    return run_byzantine_bench(load_config(args.config, args.overrides), attacks, rules, args.islands)


def _streaming(args: argparse.Namespace) -> Result:
    from diloco.bench.streaming import run_streaming_bench
    from diloco.config import load_config

    cfg = load_config(args.config, args.overrides)
    return run_streaming_bench(cfg, _run_dir(args), args.fragments, args.overlap, args.alpha)


def _sync(args: argparse.Namespace) -> Result:
    from diloco.bench.sync import run_sync_bench

    return run_sync_bench(args.config, args.overrides, _run_dir(args), args.rounds)


def _utilization(args: argparse.Namespace) -> Result:
    from diloco.bench.utilization import run_utilization_bench

    return run_utilization_bench(
        args.config,
        args.overrides,
        _run_dir(args),
        args.rounds,
        args.fragments,
        args.overlap,
        args.kernel_link,
        args.variant,
    )


def _colocation(args: argparse.Namespace) -> Result:
    from diloco.bench.colocation import run_colocation_bench

    return run_colocation_bench(args.config, args.overrides, args.islands, args.steps)


def _heterogeneous(args: argparse.Namespace) -> Result:
    from diloco.bench.heterogeneous import run_heterogeneous_bench
    from diloco.config import load_config

    config, overrides = args.config, list(args.overrides)
    if "=" in config:  # CONFIG left out: what argparse took for it is the first override
        config, overrides = HETEROGENEOUS_CONFIG, [config, *overrides]
    cfg = load_config(config, overrides)
    return run_heterogeneous_bench(cfg, _run_dir(args), args.rounds, args.islands, args.factor, args.target)


def _simulator(args: argparse.Namespace) -> Result:
    from diloco.bench.simulator import run_simulator_bench
    from diloco.config import load_config

    cfg = load_config(args.config, args.overrides)
    return run_simulator_bench(cfg, _run_dir(args), args.islands, args.rounds)


def _roster_sweep(args: argparse.Namespace) -> Result:
    from diloco.bench.roster_sweep import run_roster_sweep
    from diloco.config import load_config

    return run_roster_sweep(load_config(args.config, args.overrides), _run_dir(args))


def _generate(args: argparse.Namespace) -> Result:
    from diloco.bench.generate import run_generate_bench
    from diloco.config import load_config

    cfg = load_config(args.config, args.overrides)
    return run_generate_bench(cfg, args.batch, args.new_tokens, args.prompt_len, args.repeats)


def _models(args: argparse.Namespace) -> Result:
    from diloco.bench.models import run_models_bench

    return run_models_bench(
        args.d_model,
        args.heads,
        args.kv_heads,
        args.layers,
        args.batch,
        args.seq_len,
        args.dtype,
        args.steps,
        args.repeats,
    )


def _big(args: argparse.Namespace) -> Result:
    from diloco.bench.big import run_big_bench

    return run_big_bench(args.config, args.overrides, _run_dir(args), args.rounds, args.smoke)


def _plan(args: argparse.Namespace) -> Result:
    from diloco.bench.plan import run_plan_bench

    return run_plan_bench(args.table)


def _accelerator(args: argparse.Namespace) -> Result:
    from diloco.bench.accelerator import run_accelerator_bench

    overrides = [*args.overrides, *getattr(args, "overrides_after", [])]
    return run_accelerator_bench(
        args.config,
        overrides,
        _run_dir(args),
        args.islands,
        args.rounds,
        args.fragments,
        args.overlap,
        args.smoke,
        args.peak_tflops,
    )


def _posttrain(args: argparse.Namespace) -> Result:
    from diloco.bench.errors import BenchError, parse_names
    from diloco.bench.posttrain import COLUMNS, DPO_DEFAULT, RL_DEFAULT, run_lora_bench, run_posttrain_bench

    if args.lora is not None:
        if args.columns is not None or args.dpo is not None:
            raise BenchError("bench posttrain: --lora compares SFT and GRPO in the DiLoCo column (no --columns, --dpo)")
        return run_lora_bench(
            args.config, args.overrides, _run_dir(args), args.pretrained, args.lora, args.rl or RL_DEFAULT, args.heldout
        )
    columns = (
        COLUMNS if args.columns is None else parse_names(args.columns, list(COLUMNS), "bench posttrain: --columns")
    )
    stages = (args.dpo or DPO_DEFAULT, args.rl or RL_DEFAULT)
    return run_posttrain_bench(
        args.config, args.overrides, _run_dir(args), args.pretrained, *stages, args.heldout, columns
    )


RUNNERS: dict[str, Callable[[argparse.Namespace], Result]] = {
    "overhead": _overhead,
    "convergence": _convergence,
    "scaling": _scaling,
    "codec": _codec,
    "transport": _transport,
    "recovery": _recovery,
    "failover": _failover,
    "faults": _faults,
    "byzantine": _byzantine,
    "fuzz": _fuzz,
    "fuzz-decoders": _fuzz_decoders,
    "load": _load,
    "soak": _soak,
    "churn": _churn,
    "churn-soak": _churn_soak,
    "streaming": _streaming,
    "sync": _sync,
    "colocation": _colocation,
    "utilization": _utilization,
    "heterogeneous": _heterogeneous,
    "elastic": _elastic,
    "roster-sweep": _roster_sweep,
    "simulator": _simulator,
    "generate": _generate,
    "posttrain": _posttrain,
    "models": _models,
    "big": _big,
    "plan": _plan,
    "accelerator": _accelerator,
}


def run_bench(args: argparse.Namespace) -> Result:
    """Run the benchmark `args.bench` names and return its JSON-able result; a failure raises BenchError."""
    return RUNNERS[args.bench](args)
