"""`diloco bench accelerator`: a model's training throughput on the device JAX finds, as MFU, tokens per second and
the utilization of plain and streaming rounds, with one island and with several.

For each island count N of `--islands` (default 1 and 2) and each kind of round (plain: P = 1, τ = 0; streaming:
`--fragments` P, `--overlap` τ, utilization's defaults), a real federation of the config runs `--rounds` rounds as
`launch` runs it (`finished_run`: the coordinator and N island processes over real gRPC on this host). Its islands
are the config's first N names (islands.count = quorum.min_islands = N).

Where the processes run. Before any federation, a probe process (`probe`) with the islands' environment asks JAX for
its backend and devices (JAX_PLATFORMS as this process has it, else JAX's own choice: the accelerator when there is
one), builds island 0 as an island process does and compiles its train step from the state's shapes. Every island
then runs with JAX_PLATFORMS set to that backend, so that one whose accelerator fails to start stops with an error
rather than training on the CPU; the coordinator runs on the CPU (JAX_PLATFORMS=cpu), as a Kubernetes deployment puts
it (diloco/deploy/k8s.py): its outer step is small next to H inner steps. The N islands share the host's devices:
each meshes the first `min(islands.devices, visible)` of them, and on a GPU each may take `MEMORY_SHARE / N` of its
memory (XLA_PYTHON_CLIENT_MEM_FRACTION) so that N fit. A TPU's chips belong to one process at a time: N > 1 on a TPU
is refused.

Reported per case, from the coordinator's `push` events of the rounds after utilization's WARMUP_ROUNDS (process
start, join and first compiles):

  tokens_per_s       each island's median over its pushes of tokens / compute_s (`big.tokens_per_second`), and
                     their sum: what the shared devices trained per second
  utilization        Σ compute_s / Σ wall_s (`utilization.measured_utilization`): the share of a round spent in
                     inner steps
  achieved_tflops    model flops per token x tokens_per_s (`flops.train_flops_per_token`: PaLM's count, N = all
                     parameters)
  mfu                achieved / (peak x the island's mesh devices); its total is the islands' sum, since they share
                     those devices. The peak is `--peak-tflops`, else the table's by JAX's device kind
                     (`flops.PEAK_TFLOPS`, dense bfloat16); null where neither says (a CPU), never a guess

and once for all: the probe's backend, device kind and counts, the model's parameter count and flops per token, and
XLA's count of the compiled step's flops per token (`flops.xla_flops` x mesh devices / the tokens of one pass: XLA
counts the accumulation loop's body once, so its step is one pass of the batch and the optimizer's update; it counts
what the step executes, recomputation included). `--smoke` runs the config's family at a few hundred thousand
parameters (`SMOKE`) for `SMOKE_ROUNDS` rounds, small enough for every case to run on a CPU host: the bench-marked
test. Every process of the bench shares one compilation cache (`XLA_CACHE`).

Run: ``diloco bench accelerator CONFIG [--islands 1 2] [--rounds R] [--fragments P] [--overlap T] [--smoke]
[--peak-tflops X] [--run-dir DIR] [key=value ...]``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from diloco.bench import big
from diloco.bench.errors import BenchError
from diloco.bench.federation import finished_run
from diloco.bench.flops import MODEL_FLOPS, PEAK_TFLOPS, train_flops_per_token, xla_flops
from diloco.bench.utilization import WARMUP_ROUNDS, measured_utilization, mode_overrides
from diloco.config import RunConfig, load_config
from diloco.harness.procs import child_env, compilation_cache_env
from floor.errors import UserError

SMOKE = [*big.SMOKE, "model.n_layers=4", "train.inner_steps=10"]
"""`--smoke`: `bench big`'s tiny model with enough blocks for utilization's default P (5 fragments: 4 blocks and the
other tensors), and H a multiple of P above its τ (2)."""

SMOKE_ROUNDS = WARMUP_ROUNDS + 1
"""`--smoke`'s rounds: the warm-up ones and one measured."""

ROUNDS = WARMUP_ROUNDS + 3
"""Rounds of each federation by default: the warm-up ones, then three measured."""

MEMORY_SHARE = 0.9
"""The part of one GPU's memory the islands sharing it may take together; the rest is each process's CUDA context
and the libraries' workspaces, which XLA's pool does not hold."""

COORDINATOR_ENV = {"JAX_PLATFORMS": "cpu"}
"""The coordinator's extra environment: the host's CPU, whatever accelerator the islands have."""

USER_ERROR = "diloco: error: "
"""What the probe child puts before a user's mistake on stderr, as the CLI does."""

XLA_CACHE = "xla-cache"
"""The compilation cache every process of the bench shares, in its run directory unless the environment names one
(JAX_COMPILATION_CACHE_DIR): the probe and every island compile the same train step, and each case's coordinator the
same programs; a process that loads one starts sooner (the figures leave the first rounds out either way)."""

PROBE_S = 1200.0
"""The bound on the probe (JAX's start, θ_0, one compilation of the train step): a bound for a hang, not a measure."""

PROBE_CODE = "import sys; from diloco.bench.accelerator import probe_main; sys.exit(probe_main(sys.argv[1:]))"


def roster(cfg: RunConfig, n: int) -> list[str]:
    """Overrides that make the config's federation N islands, all of them needed to close a round: its first N names
    (island-0 ... when it names fewer)."""
    names = cfg.islands.names[:n] if len(cfg.islands.names) >= n else ()
    return [f"islands.count={n}", f"islands.names=[{','.join(names)}]", f"quorum.min_islands={n}"]


def island_env(platform: str, n: int) -> dict[str, str]:
    """An island's extra environment when N islands share this host's devices: JAX on `platform` (the probe's
    backend) and, on a GPU, 1/N of `MEMORY_SHARE` of its memory (ignored elsewhere)."""
    return {"JAX_PLATFORMS": platform, "XLA_PYTHON_CLIENT_MEM_FRACTION": f"{MEMORY_SHARE / n:.3f}"}


def rates(
    tokens_per_s: dict[str, float], flops_per_token: int, peak_tflops: float | None, devices: int
) -> dict[str, Any]:
    """Each island's tokens/s, achieved TFLOP/s and MFU, and their totals, for islands that share the same `devices`
    devices of `peak_tflops` each (None: no MFU); pure, so table-tested."""
    achieved = {name: rate * flops_per_token / 1e12 for name, rate in tokens_per_s.items()}
    peak = None if peak_tflops is None else peak_tflops * devices
    return {
        "tokens_per_s": {"per_island": tokens_per_s, "total": round(sum(tokens_per_s.values()), 1)},
        "achieved_tflops": {
            "per_island": {name: round(v, 6) for name, v in achieved.items()},
            "total": round(sum(achieved.values()), 6),
        },
        "mfu": None
        if peak is None
        else {
            "per_island": {name: round(v / peak, 6) for name, v in achieved.items()},
            "total": round(sum(achieved.values()) / peak, 6),
        },
    }


def device_peak(kind: str, given: float | None) -> tuple[float | None, str | None]:
    """One device's peak TFLOP/s and where it comes from: `given` (--peak-tflops), else the table's for `kind`, else
    none (None, None)."""
    if given is not None:
        return given, "--peak-tflops"
    if kind in PEAK_TFLOPS:
        return PEAK_TFLOPS[kind], f"flops.PEAK_TFLOPS[{kind!r}], dense bfloat16"
    return None, None


def probe(config: str | Path, overrides: list[str]) -> dict[str, Any]:
    """What an island process of the config finds and compiles, in this process (`PROBE_CODE` runs it in a child
    with the islands' environment): JAX's backend, the device kind, the devices visible and those of the island's
    mesh, the parameter count, the accumulation passes and XLA's flops per device of one train step."""
    import jax

    from diloco.run.setup import build_setup, make_island
    from islands.backend import initialize_backend

    cfg = load_config(config, overrides)
    initialize_backend(cfg.islands.backend)  # as an island process does, before anything asks JAX for a device
    name = cfg.islands.island_names[0]
    setup = build_setup(cfg, islands=[name])
    visible = jax.local_devices()
    mesh = min(cfg.islands.devices, len(visible))  # a one-process island's mesh (diloco/worker/island_worker.py)
    island = make_island(cfg, name, setup.model_of(name), setup.streams[name], mesh, check_memory=False)
    compiled = island.check_memory()  # the step compiled for the state's shapes; refused if it cannot fit
    return {
        "backend": jax.default_backend(),
        "kind": visible[0].device_kind,
        "visible": len(visible),
        "mesh": mesh,
        "param_count": setup.n_params,
        "passes": island.passes,
        "step_flops_per_device": None if compiled is None else xla_flops(compiled),
        "jax": jax.__version__,
    }


def probe_main(argv: list[str]) -> int:
    """The probe child's entry (CONFIG KEY=VALUE ...): `probe`'s JSON on stdout, or a user's mistake (a model that
    does not split into the streaming runs' fragments, a step that does not fit) as one line on stderr, exit 2."""
    try:
        print(json.dumps(probe(argv[0], argv[1:])))
    except UserError as exc:
        print(f"{USER_ERROR}{exc}", file=sys.stderr)
        return 2
    return 0


def probe_islands(cfg: RunConfig, config: str | Path, overrides: list[str], jax_cache: Path) -> dict[str, Any]:
    """`probe` in a child process with an island's environment (`child_env`, JAX_PLATFORMS as this process has it,
    else JAX's choice; no GPU memory taken beforehand) and the federations' compilation cache; its failure is one
    BenchError line."""
    extra = {
        "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", ""),
        "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
        **compilation_cache_env(jax_cache),
    }
    argv = [sys.executable, "-c", PROBE_CODE, str(config), *overrides]
    try:
        child = subprocess.run(
            argv, env=child_env(cfg, extra), capture_output=True, text=True, check=False, timeout=PROBE_S
        )
    except subprocess.TimeoutExpired:
        raise BenchError(f"bench accelerator: the probe did not finish in {PROBE_S:.0f} s") from None
    if child.returncode:
        last = (child.stderr.strip().splitlines() or [f"exit code {child.returncode}"])[-1]
        why = last.removeprefix(USER_ERROR) if last.startswith(USER_ERROR) else f"the probe failed: {last}"
        raise BenchError(f"bench accelerator: {why}")
    return json.loads(child.stdout.strip().splitlines()[-1])


def _case(
    config: str | Path,
    overrides: list[str],
    run_dir: Path,
    rounds: int,
    env: dict[str, str],
    jax_cache: Path,
    flops_per_token: int,
    peak: float | None,
    mesh: int,
) -> dict[str, Any]:
    """One federation to its end and its figures (module docstring)."""
    with finished_run(
        config,
        overrides,
        run_dir,
        rounds,
        slack_s=big.START_S,
        coordinator_env=COORDINATOR_ENV,
        island_env=env,
        jax_cache=jax_cache,
    ) as (cfg, fed, summary):
        pushes = fed.events("push")
    later = [p for p in pushes if p["round"] >= WARMUP_ROUNDS]
    per_island = {n: big.tokens_per_second([p for p in later if p["island"] == n]) for n in cfg.islands.island_names}
    missing = [n for n, rate in per_island.items() if rate is None]
    if missing:
        raise BenchError(f"bench accelerator: no timed push of {', '.join(missing)} after the warm-up rounds")
    return {
        "islands": cfg.islands.count,
        "fragments": cfg.stream.fragments,
        "overlap_steps": cfg.stream.overlap_steps,
        **rates({n: float(r) for n, r in per_island.items() if r is not None}, flops_per_token, peak, mesh),
        "utilization": round(measured_utilization(pushes), 4),
        "mem_fraction": float(env["XLA_PYTHON_CLIENT_MEM_FRACTION"]),
        "param_count": summary["param_count"],
        "final_eval_loss": summary["final_eval_loss"],
        "wall_s": summary["wall_s"],
        "run_dir": str(run_dir),
    }


def run_accelerator_bench(
    config: str | Path,
    overrides: list[str],
    run_dir: Path,
    islands: list[int],
    rounds: int | None = None,
    fragments: int = 5,
    overlap: int = 2,
    smoke: bool = False,
    peak_tflops: float | None = None,
) -> dict[str, Any]:
    """Every island count's plain and streaming federations of the config (module docstring)."""
    counts = list(dict.fromkeys(islands))
    if not counts or min(counts) < 1:
        raise BenchError(f"bench accelerator: --islands takes island counts >= 1 (got {islands})")
    rounds = (SMOKE_ROUNDS if smoke else ROUNDS) if rounds is None else rounds
    if rounds < WARMUP_ROUNDS + 1:
        raise BenchError(
            f"bench accelerator: --rounds must be >= {WARMUP_ROUNDS + 1} (the first {WARMUP_ROUNDS} rounds are left "
            f"out; got {rounds})"
        )
    if peak_tflops is not None and not peak_tflops > 0:
        raise BenchError(f"bench accelerator: --peak-tflops must be > 0 (got {peak_tflops})")
    overrides = [*(SMOKE if smoke else []), *overrides]
    cfg = load_config(config, overrides)
    modes = mode_overrides(fragments, overlap)
    cases = [(n, mode, [*overrides, *roster(cfg, n), *extra]) for n in counts for mode, extra in modes.items()]
    for _, _, case in cases:  # every case's config, a bad key or schedule refused before anything starts
        load_config(config, case)
    t0, load = time.monotonic(), [round(os.getloadavg()[0], 2)]
    # With the streaming runs' overrides: the same model and step, and a model that does not split into P fragments
    # is refused here, in one line, before any federation runs.
    cache = Path(os.environ.get("JAX_COMPILATION_CACHE_DIR") or run_dir / XLA_CACHE)
    found = probe_islands(cfg, config, [*overrides, *modes["streaming"]], cache)
    if found["backend"] == "tpu" and max(counts) > 1:
        raise BenchError(
            "bench accelerator: a TPU's chips belong to one process at a time, so islands cannot share them: "
            "--islands 1"
        )
    peak, source = device_peak(found["kind"], peak_tflops)
    model_flops = train_flops_per_token(cfg.model, found["param_count"])
    tokens_per_pass = cfg.train.batch_size // found["passes"] * cfg.model.seq_len
    step_flops = found["step_flops_per_device"]
    xla = round(step_flops * found["mesh"] / tokens_per_pass, 1) if step_flops else None
    results = []
    for n, mode, case in cases:
        env = island_env(found["backend"], n)
        where = run_dir / f"{n}-islands" / mode
        figures = _case(config, case, where, rounds, env, cache, model_flops, peak, found["mesh"])
        results.append({"mode": mode, **figures})
    load.append(round(os.getloadavg()[0], 2))
    return {
        "bench": "accelerator",
        "config": str(config),
        "smoke": smoke,
        "device": {
            "backend": found["backend"],
            "kind": found["kind"],
            "visible_per_island": found["visible"],
            "mesh_per_island": found["mesh"],
            "coordinator": COORDINATOR_ENV["JAX_PLATFORMS"],
            "jax": found["jax"],
        },
        "peak_tflops": peak,
        "peak_source": source,
        "model": {
            "param_count": found["param_count"],
            "n_layers": cfg.model.n_layers,
            "d_model": cfg.model.d_model,
            "attention_width": cfg.model.n_heads * cfg.model.head_size,
            "seq_len": cfg.model.seq_len,
            "compute_dtype": cfg.model.compute_dtype,
        },
        "flops_per_token": {
            "model": model_flops,
            "model_count": MODEL_FLOPS,
            "xla": xla,
            "xla_count": "XLA's cost analysis of one compiled train step x mesh devices / the tokens of one pass",
        },
        "tokens_per_step": cfg.train.batch_size * cfg.model.seq_len,
        "passes": found["passes"],
        "H": cfg.train.inner_steps,
        "rounds": rounds,
        "warmup_rounds": WARMUP_ROUNDS,
        "cases": results,
        "load_avg_1min": load,
        "wall_s": round(time.monotonic() - t0, 1),
        "run_dir": str(run_dir),
    }
