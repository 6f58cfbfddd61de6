"""The islands of a one-process run (`diloco simulate`): started with the global run, resumed and saved beside it.

`simulate` checkpoints the global state (GlobalRun) and every island's state at the same counts of committed rounds
(or, in the asynchronous mode, updates), each owner in its own directory, and resumes from the newest count that
all of them finished saving (docs/architecture.md, "Checkpoints and state"). The lockstep and the asynchronous
drivers share this bookkeeping.
"""

from __future__ import annotations

from collections.abc import Sequence

from diloco.config import RunConfig
from diloco.ops.progress import Progress
from diloco.run.checkpoint import CheckpointStore, latest_common_step, restore_state, save_state
from diloco.run.global_run import GlobalRun
from diloco.run.rundir import RunDir
from diloco.run.warm_start import initial_inner_state
from islands.island import Island


def island_stores(cfg: RunConfig, rd: RunDir, names: Sequence[str]) -> list[CheckpointStore]:
    """One checkpoint store per island, in `names` order (none when train.checkpoint_every is 0)."""
    return [CheckpointStore(rd.checkpoints / name) for name in names] if cfg.train.checkpoint_every else []


def start_islands(cfg: RunConfig, rd: RunDir, world: GlobalRun, islands: Sequence[Island]) -> list[CheckpointStore]:
    """Start the run, then every island at its θ_0: from the newest checkpoint that the global state and every island
    saved (each restored into its freshly started state), or afresh (their joins logged; with init.from, θ_0 is the
    warm start's and, with init.inner_state, so are the inner states). Returns the islands' stores, in `islands`
    order."""
    stores = island_stores(cfg, rd, [island.name for island in islands])
    step = latest_common_step([world.store, *stores]) if world.store is not None else None
    world.start(step)
    for island in islands:
        params = world.loop.params
        island.start(params, initial_inner_state(cfg, island, params, rd) if step is None else None)
    if step is not None:
        for island, store in zip(islands, stores, strict=True):
            assert island.state is not None
            island.restore(restore_state(store, step, island.state)[0])
    else:
        world.totals.islands_joined = len(islands)
        for island in islands:
            rd.log("island_joined", round=0, island=island.name)
    return stores


def save_islands(stores: Sequence[CheckpointStore], islands: Sequence[Island], step: int) -> None:
    """Checkpoint every island's state as `step` (the count the global state was just saved at), one at a time.

    A save holds a copy of the state it writes until the write is done (the next step donates the state's buffers).
    Every island of the process saving at once, and training on while the writes go on, would hold a copy of every
    island's state beside the states themselves; one save after another holds one island's at most, and none while
    the islands train (islands/memory.py, the cost model)."""
    for island, store in zip(islands, stores, strict=True):
        save_state(store, step, island.state, {})
        store.wait()


def finish(world: GlobalRun, stores: Sequence[CheckpointStore], progress: Progress) -> None:
    """End a one-process run however it ended: the progress line, every island's store, the global run."""
    progress.close()
    for store in stores:
        store.close()
    world.close()
