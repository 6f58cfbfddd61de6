"""Will the whole run fit? The cost model of one process (islands/memory.py, `ProcessPlan`), measured from the config
and XLA's compiled programs and checked once before any island's state exists.

An island's own check (`Island.check_memory`) sizes one step against the memory free when it runs, so in `simulate`
the first island passes with the others' states not yet placed and the process is killed later, without a word,
once every island, the pushes of a sync and the commit are held at once. This check counts all of it up front:
running out is one line naming the settings to shrink (OutOfMemoryError, exit code 2), before the first step.

It applies where every part shares one memory, the host's: on CPU. On an accelerator each island's step is checked
against its devices as before (the islands' states are in the devices' memory, the coordinator's on the host).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import jax
import numpy as np

from diloco.config import RunConfig
from diloco.run.checkpoint import WRITE_WINDOW
from diloco.run.setup import Evaluator, Setup, make_island
from floor.codec import CodecSpec
from islands.island import Island
from islands.memory import (
    RUNTIME,
    OutOfMemoryError,
    ProcessPlan,
    Room,
    format_bytes,
    host_room,
    process_advice,
)
from outer_optimizer.optimizers import build_optimizer
from pytrees.encode import encode
from pytrees.feedback import is_lossless

COORDINATOR = "coordinator"
"""The coordinator's process in `launch_plans` (the name its log and its pause points have)."""

RATIO_SAMPLE = 1 << 16
"""Values encoded to measure a codec's bytes per float32 byte (its scales and headers included)."""


def codec_ratio(spec: CodecSpec) -> float:
    """Encoded bytes per byte of float32 input, measured on a sample of the codec's own output."""
    sample = np.random.default_rng(0).standard_normal(RATIO_SAMPLE).astype(np.float32)
    return encode("sample", sample, spec).nbytes / sample.nbytes


def shape_nbytes(tree: object) -> int:
    """The bytes of a tree of shapes (`jax.eval_shape`'s) or arrays."""
    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def plan(
    cfg: RunConfig,
    setup: Setup,
    islands: Sequence[Island],
    evaluate: Evaluator | None,
    pushers: int | None = None,
) -> ProcessPlan:
    """The cost model of a process that holds `islands` and (with `evaluate`) the global model, measured from shapes:
    nothing is placed or allocated. `pushers`: the islands whose pushes the global model's commit takes, where they
    are not the process's own (a federation's coordinator holds no island: `islands` is empty)."""
    params = setup.init_params
    sizes = [int(np.size(leaf)) * 4 for leaf in jax.tree.leaves(params)]
    first = islands[0] if islands else None
    cpu = first is not None and all(d.platform == "cpu" for d in first.mesh.devices.flat)
    uplink, downlink = cfg.codec.spec("uplink"), cfg.downlink_specs()[-1]  # the densest a commit is sent at
    return ProcessPlan(
        islands=len(islands),
        params=sum(sizes),
        largest_leaf=max(sizes, default=0),
        inner_state=0 if first is None else shape_nbytes(jax.eval_shape(first.tx.init, params)),
        step=None if first is None else first.step_footprint(),
        step_sharers=first.mesh.size if first is not None and cpu else 1,
        evaluation=None if evaluate is None else evaluate.footprint(params),
        coordinator=evaluate is not None,
        outer_state=shape_nbytes(jax.eval_shape(build_optimizer(cfg.outer).init, params)),
        uplink_ratio=codec_ratio(uplink),
        downlink_ratio=codec_ratio(downlink),
        uplink_lossy=not is_lossless(uplink),
        downlink_lossy=not is_lossless(downlink),
        order_statistic=cfg.outer.aggregate in ("trimmed_mean", "median"),
        stepped_together=cfg.train.vectorize,
        reference=sum(sizes) if any(cfg.workload.of(island.name).kind == "rl" for island in islands) else 0,
        pushers=pushers,
    )


def launched(process: ProcessPlan, global_copy: bool = False) -> ProcessPlan:
    """`process` as a process of its own: its runtime, its checkpoints written through orbax's window
    (diloco/run/checkpoint.py), and for an island its own copy of the global θ (`global_copy`)."""
    window = max(WRITE_WINDOW, process.largest_leaf)
    return replace(process, runtime=RUNTIME, write_window=window, global_copy=global_copy)


def launch_plans(cfg: RunConfig, setup: Setup) -> dict[str, ProcessPlan]:
    """The cost model of each process `diloco launch` starts, by name, each with its own runtime (`launched`): each
    island's (its island alone and its copy of the global θ) and the coordinator's (the global model, and at a sync
    every island's push). Islands are built to be measured, not placed: nothing is allocated."""
    names = cfg.islands.island_names
    islands = [make_island(cfg, n, setup.model_of(n), setup.streams[n], check_memory=False) for n in names]
    plans = {island.name: launched(plan(cfg, setup, [island], None), global_copy=True) for island in islands}
    plans[COORDINATOR] = launched(plan(cfg, setup, [], Evaluator.of(cfg, setup), pushers=len(islands)))
    return plans


def launch_need(plans: dict[str, ProcessPlan]) -> int:
    """The bytes the processes of a launch (`launch_plans`) hold together at their worst moment. The islands' first
    steps run together, while the coordinator holds its state; the coordinator's sync runs once the islands have
    trained, while they hold theirs: the larger of the two."""
    coordinator = plans[COORDINATOR]
    islands = [p for name, p in plans.items() if name != COORDINATOR]
    return max(
        sum(p.peak for p in islands) + coordinator.held,
        sum(p.held for p in islands) + coordinator.peak,
    )


def launch_refusal(plans: dict[str, ProcessPlan], room: Room | None) -> str | None:
    """The one-line refusal when the processes of a launch (`launch_plans`) do not fit `room` on one host together
    (`launch_need`), else None (also when the room is unknown)."""
    need = launch_need(plans)
    if room is None or need <= room.free:
        return None
    each = ", ".join(f"{name} {format_bytes(p.peak)}" for name, p in plans.items())
    return (
        f"the {len(plans)} processes of this launch need about {format_bytes(need)} together (peaks: {each}), "
        f"{room.text}; shrink the model (model.n_layers, model.d_model, model.vocab_size) or run the islands on "
        "hosts of their own"
    )


def refusal(process: ProcessPlan, room: Room | None, island: Island) -> str | None:
    """The one-line refusal when the process's peak does not fit `room`, else None (also when the room is unknown).
    `island`: one of its islands, whose settings the advice names."""
    if room is None or process.peak <= room.free:
        return None
    knobs = island.step_advice()
    return (
        f"this run needs about {format_bytes(process.peak)} in one process ({process.describe()}), {room.text}; "
        f"{process_advice(process.islands, knobs)}"
    )


def check_process(
    cfg: RunConfig, setup: Setup, islands: Sequence[Island], evaluate: Evaluator | None, room: Room | None = None
) -> ProcessPlan:
    """Raise OutOfMemoryError when the process's peak (`plan`) does not fit what the host has free now (`room`:
    measured here unless given). Where the islands' devices are not the host's (an accelerator), nothing is checked
    here (module docstring). Returns the plan."""
    process = plan(cfg, setup, islands, evaluate)
    if room is None and all(d.platform == "cpu" for d in islands[0].mesh.devices.flat):
        room = host_room()
    message = refusal(process, room, islands[0])
    if message is not None:
        raise OutOfMemoryError(message)
    return process
