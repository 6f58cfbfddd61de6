"""Warm start (`[init]`): θ_0, and optionally each island's inner optimizer state, from another run's checkpoint.

`init.from` names a run directory of this project (simulate's or launch's), a checkpoint directory of one
(RUN/checkpoints/coordinator, an island's checkpoints/) or one step of it (.../coordinator/12). Its arrays are read
into the structure of a freshly built state of this run (as `checkpoint.restore_state` does), so every tensor keeps
this run's shape, dtype and layout. A different model is refused first, in one line, naming the first differing
`[model]` key (from the source's config.toml) or tensor (from the checkpoint's own metadata), where orbax would fail
with a traceback.

Or `init.from` names a Hugging Face model directory (config.json, model.safetensors or its shards: islands/models/hf/).
Then the run's `[model]` is what config.json describes (the config loader fills it in: `with_checkpoint_model`), the
checkpoint is checked whole before the run directory is made (every shard's header, tensor names, shapes and dtypes:
`check_fresh`), θ_0 is its tensors as float32 master weights, and its config.json and tokenizer files are kept in
RUN/hf/ (`RUN_FILES`) for the run's text and for `diloco export --format hf`. It has no inner optimizer state. A run
from a run that started from a checkpoint keeps that run's RUN/hf/ in turn (`kept_checkpoint`), with its [model] and
tokenizer: each stage of a chain (SFT, then RL) exports as the checkpoint it started from.

Only a run that starts afresh reads it: a run directory that resumes restores its own checkpoints (`GlobalRun.start`,
`local_islands.start_islands`, `IslandWorker.restore`), so the source may change or vanish once the run has begun.
Who loads what:

    the global θ     whoever owns it: simulate's GlobalRun or the coordinator (`initial_params`); the sync baseline's
                     one model. Islands of a federation get it from the coordinator by their first full pull.
    inner state      each island itself, from the source's checkpoint of the island with its name, or of the island
                     init.inner_state_island names (`initial_inner_state`, `init.inner_state`); without one it starts
                     fresh and says so (a named island the source lacks is refused).

The inner state carries its step count, and the learning-rate schedule is a function of that count: the source's
step S is this run's first. Both runs on one inner.schedule_steps = T make one schedule of T steps (the papers'
warm start: training continued, not restarted); without it the schedule spans this run's own steps from S, which is
said in one line.
"""

from __future__ import annotations

import logging
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import jax
import numpy as np
import orbax.checkpoint as ocp

from diloco.config import ConfigError, RunConfig, diff_keys, from_dict, to_dict
from diloco.run.rundir import RunDir
from islands.island import Island
from islands.models.config import ModelConfig
from islands.models.hf.checkpoint import (
    CONFIG,
    RUN_FILES,
    TOKENIZER_FILES,
    copy_files,
    is_checkpoint,
    kept_checkpoint,
    run_directory,
)
from islands.models.hf.families import Import, open_import
from islands.models.registry import build_model
from islands.workloads.config import WorkloadConfig
from pytrees.digest import tree_digest
from pytrees.naming import PyTree, flatten_named, unflatten_named

log = logging.getLogger("diloco.run.warm_start")


GLOBAL_OWNERS = ("coordinator", "sync")
"""Where a run directory keeps the global θ (under checkpoints/), in order of preference: the coordinator's
(simulate's diloco and async modes, launch, the coordinator) and the sync baseline's one model."""

Section = TypeVar("Section")
"""A config section's dataclass (ModelConfig, DataConfig, ...)."""

Specs = dict[str, tuple[tuple[int, ...], str]]
"""Tensor name (`flatten_named`'s) -> (shape, dtype name)."""


class WarmStartError(ConfigError):
    """init.from names no usable checkpoint, or one of another model: one line naming the path, key or tensor."""


@dataclass(frozen=True)
class Source:
    """The checkpoint step that init.from names."""

    step_dir: Path
    """An orbax step (OWNER_DIR/STEP, its arrays in `state/`)."""
    run_dir: Path | None
    """The run directory it belongs to (the nearest of its three parents with a config.toml); None when none has."""

    @property
    def round(self) -> int:
        """The step: the rounds (or, async, updates) the source had committed when it saved it."""
        return int(self.step_dir.name)


def complete_steps(owner_dir: Path) -> list[int]:
    """The steps orbax finished in one owner's checkpoint directory, oldest first. A save in progress or a replaced
    step is no number (orbax's temporary names, diloco/run/checkpoint.py's `_TRASH`), so it is never picked."""
    if not owner_dir.is_dir():
        return []
    return sorted(int(d.name) for d in owner_dir.iterdir() if d.name.isdigit() and (d / "state").is_dir())


def newest_step(owner_dirs: list[Path]) -> Path | None:
    """The newest step of the first of `owner_dirs` that holds one."""
    for owner in owner_dirs:
        steps = complete_steps(owner)
        if steps:
            return owner / str(steps[-1])
    return None


def island_owners(run_dir: Path, name: str) -> list[Path]:
    """Where a run directory may keep island `name`'s checkpoints: simulate's RUN/checkpoints/NAME, launch's
    RUN/islands/NAME/checkpoints (the island process's own run directory)."""
    return [run_dir / "checkpoints" / name, run_dir / "islands" / name / "checkpoints"]


def find_source(path: Path, where: str = "init.from") -> Source:
    """The checkpoint step `path` names: itself (a step), the newest step of a checkpoint directory, or the newest
    global checkpoint of a run directory (`GLOBAL_OWNERS`). `where` names the path in a refusal: init.from, or the
    argument of a command that reads a run's θ (`diloco sample`, `diloco export`)."""
    if not path.exists():
        raise WarmStartError(f"{where}: '{path}' does not exist")
    if path.name.isdigit() and (path / "state").is_dir():
        step_dir: Path | None = path
    else:
        step_dir = newest_step([*(path / "checkpoints" / owner for owner in GLOBAL_OWNERS), path])
    if step_dir is None:
        raise WarmStartError(
            f"{where}: '{path}' holds no checkpoint (expected a run directory with checkpoints/coordinator/, or a "
            "checkpoint directory; a run with train.checkpoint_every = 0 saves none)"
        )
    return Source(step_dir, run_directory(step_dir))


def model_difference(theirs: dict[str, Any], ours: dict[str, Any]) -> str | None:
    """The first `[model]` key whose value differs between two `to_dict` views of ModelConfig, with both values."""
    differing = diff_keys(theirs, ours)
    if not differing:
        return None
    key = differing[0]
    return f"model.{key} is {theirs.get(key)!r} there, {ours.get(key)!r} here"


def tensor_difference(theirs: Specs, ours: Specs) -> str | None:
    """The first tensor (in name order) that is missing on one side or differs in shape or dtype, or None."""
    for name in sorted(theirs.keys() | ours.keys()):
        if name not in theirs:
            return f"tensor '{name}' is missing there"
        if name not in ours:
            return f"tensor '{name}' is there but not here"
        if theirs[name] != ours[name]:
            (s1, d1), (s2, d2) = theirs[name], ours[name]
            return f"tensor '{name}' is {d1}{list(s1)} there, {d2}{list(s2)} here"
    return None


def specs(tree: PyTree) -> Specs:
    """Name -> (shape, dtype) of a pytree of arrays or of orbax's array metadata."""
    return {name: (tuple(a.shape), str(np.dtype(a.dtype))) for name, a in flatten_named(tree, to_numpy=False).items()}


def stored_section(run_dir: Path, cls: type[Section], name: str, where: str = "init.from") -> Section:
    """Section `name` of a run directory's config.toml as `cls`, through the loader, so that a key a newer diloco
    added takes its default (and does not count as a change); a file that does not load is one line."""
    path = run_dir / "config.toml"
    try:
        return from_dict(cls, tomllib.loads(path.read_text()).get(name, {}), f"{name}.")
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError, ValueError) as exc:
        raise WarmStartError(f"{where}: '{path}' does not load ({exc})") from None


def check_model(cfg: RunConfig, source: Source, where: str = "init.from") -> None:
    """Refuse a source whose run trained another model, naming the first differing key (checkpoints found outside a
    run directory have no config to compare: their tensors are still checked when read)."""
    if source.run_dir is None:
        return
    theirs = to_dict(stored_section(source.run_dir, ModelConfig, "model", where))
    why = model_difference(theirs, to_dict(cfg.model))
    if why is not None:
        raise WarmStartError(
            f"{where}: '{source.run_dir}' trained another model ({why}); {where} needs the same [model]"
        )


def locate(cfg: RunConfig) -> Source:
    """init.from's checkpoint step, its run's model checked against this run's (no array is read)."""
    source = find_source(Path(cfg.init.from_).expanduser())
    check_model(cfg, source)
    if source.run_dir is not None and stored_section(source.run_dir, WorkloadConfig, "workload").lora.enabled:
        raise WarmStartError(
            f"init.from: '{source.run_dir}' trained LoRA adapters, which are its θ without their base: start from "
            "its merged weights (diloco export --format hf) instead"
        )
    return source


def checkpoint_dir(cfg: RunConfig) -> Path | None:
    """init.from's Hugging Face directory, or None when it names none (no init.from, or this project's checkpoint)."""
    path = Path(cfg.init.from_).expanduser()
    return path if cfg.init.from_ and is_checkpoint(path) else None


def open_checkpoint(cfg: RunConfig, directory: Path) -> Import:
    """init.from's Hugging Face checkpoint checked against this run's model (its abstract init: nothing allocated)."""
    like = jax.eval_shape(build_model(cfg.model).init, jax.random.key(0))
    shapes = {name: shape for name, (shape, _) in specs(like).items()}
    return open_import(directory, cfg.model, shapes, "init.from")


def check_fresh(cfg: RunConfig, run_dir: Path) -> None:
    """Refuse a wrong init.from (or init.inner_state_island) before a new run directory is made (its config.toml
    would hold the wrong path, and the corrected command could not reuse the directory); a directory that resumes
    never reads init.from again."""
    if not cfg.init.from_ or (run_dir / "config.toml").exists():
        return
    directory = checkpoint_dir(cfg)
    if directory is not None:
        if cfg.init.inner_state:
            raise WarmStartError(
                f"init.inner_state: '{directory}' is a Hugging Face checkpoint, which holds no optimizer state"
            )
        open_checkpoint(cfg, directory)
    else:
        source = locate(cfg)
        if cfg.init.inner_state_island:
            inner_state_step(source, cfg.init.inner_state_island, named=True)


def inner_state_step(source: Source, name: str, named: bool) -> Path | None:
    """The newest checkpoint step of the source's island `name` (`island_owners`); None when it has none, which is
    refused in one line when init.inner_state_island `named` it."""
    run_dir = source.run_dir
    step_dir = newest_step(island_owners(run_dir, name) if run_dir is not None else [])
    if step_dir is None and named:
        raise WarmStartError(
            f"init.inner_state_island: '{run_dir or source.step_dir}' holds no checkpoint of island {name!r} "
            "(a sync baseline's model is 'sync'; a simulate or launch run's islands are its islands.names)"
        )
    return step_dir


def spans_the_run(cfg: RunConfig) -> bool:
    """Whether the inner schedule's rates depend on its span: a cosine, or a wsd decay that runs to the end (a wsd
    schedule without a decay, or with its own decay_steps, is the same at a step whatever the span)."""
    inner = cfg.inner
    return inner.schedule == "cosine" or bool(inner.decay_start_step and not inner.decay_steps)


def step_count(opt_state: PyTree) -> int:
    """The step count an optimizer state holds: its schedule's position (the largest of its `count` leaves; every
    transformation of one inner optimizer counts the same steps)."""
    counts = [int(v) for name, v in flatten_named(opt_state).items() if name.rsplit("/", 1)[-1] == "count"]
    return max(counts, default=0)


def read_item(step_dir: Path, item: str, like: PyTree, what: str, where: str = "init.from") -> PyTree:
    """Field `item` of the state saved in `step_dir`, read into the structure, dtypes and shardings of `like` once
    the checkpoint's metadata shows the same tensors (orbax's own mismatch error is a traceback); `where` as
    `find_source`'s."""
    state = (step_dir / "state").absolute()  # orbax refuses a relative path (a relative init.from or RUN_DIR)
    handler = ocp.PyTreeCheckpointHandler()
    try:
        saved = handler.metadata(state).tree
    except (OSError, ValueError) as exc:
        raise WarmStartError(f"{where}: '{step_dir}' is not a readable checkpoint ({exc})") from None
    finally:
        handler.close()
    if not isinstance(saved, dict) or item not in saved:
        raise WarmStartError(f"{where}: the checkpoint '{step_dir}' holds no {item}")
    why = tensor_difference(specs(saved[item]), specs(like))
    if why is not None:
        raise WarmStartError(f"{where}: '{step_dir}' does not fit this run's {what}: {why}")
    target = {item: like}
    args = ocp.args.PyTreeRestore(
        item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target), partial_restore=True
    )
    with ocp.PyTreeCheckpointer() as checkpointer:
        return checkpointer.restore(state, args=args)[item]


def checkpoint_params(cfg: RunConfig, directory: Path, like: PyTree) -> PyTree:
    """The parameters of init.from's Hugging Face checkpoint in the structure and on the devices of `like`: each leaf
    placed as soon as it is read, its host copy dropped, so the host holds θ once at most (less where `like` is on an
    accelerator), never the checkpoint and θ together."""
    sharding = {name: getattr(leaf, "sharding", None) for name, leaf in flatten_named(like, to_numpy=False).items()}
    placed = {
        name: value if sharding[name] is None else jax.device_put(value, sharding[name])
        for name, value in open_checkpoint(cfg, directory).leaves()
    }
    return unflatten_named(placed, like)


def reference_params(cfg: RunConfig, init_params: PyTree) -> tuple[PyTree, str]:
    """The frozen reference of dpo and rl (workload.reference) and where it came from: "start" is θ_0 (init.from's
    parameters, else `init_params`, the random θ_0 of run.seed), a path the newest committed θ there. Read again at
    every start, from the same place, so a resumed island holds the same reference."""
    ref = cfg.workload.reference
    if ref == "start":
        if not cfg.init.from_:
            return init_params, "start"
        params, event = warm_params(cfg, init_params)
        return params, event["source"]
    where = "workload.reference"
    source = find_source(Path(ref).expanduser(), where)
    check_model(cfg, source, where)
    return read_item(source.step_dir, "params", init_params, "parameters", where), str(source.step_dir)


def warm_params(cfg: RunConfig, like: PyTree) -> tuple[PyTree, dict[str, Any]]:
    """init.from's parameters in the structure of `like`, and the `warm_start` event's fields that say where they
    came from (source, and format "hf" or source_round)."""
    directory = checkpoint_dir(cfg)
    if directory is not None:
        return checkpoint_params(cfg, directory, like), {"source": str(directory), "format": "hf"}
    source = locate(cfg)
    return read_item(source.step_dir, "params", like, "parameters"), {
        "source": str(source.step_dir),
        "source_round": source.round,
    }


def lora_base(cfg: RunConfig, init_params: PyTree) -> PyTree:
    """The frozen base of a run with workload.lora: init.from's parameters, else `init_params` (the random θ_0 of
    run.seed). Read at every start, from the same place, so a resumed island merges over the same base."""
    return warm_params(cfg, init_params)[0] if cfg.init.from_ else init_params


def initial_params(cfg: RunConfig, init_params: PyTree, rd: RunDir) -> PyTree:
    """θ_0 of a run that starts afresh: init.from's parameters, logged as a `warm_start` event (source, source_round,
    digest), or `init_params` when init.from is unset. With workload.lora, θ_0 is the adapters `init_params` and
    init.from their base (`lora_base`): the event says so (lora = "base")."""
    if not cfg.init.from_:
        return init_params
    if cfg.workload.lora.enabled:  # init.from is the frozen base (`lora_base`); θ_0 is the fresh adapters
        params, event = init_params, {"source": cfg.init.from_, "lora": "base"}
    else:
        params, event = warm_params(cfg, init_params)
    kept = kept_checkpoint(Path(cfg.init.from_).expanduser())  # the checkpoint's, or the source run's RUN/hf/
    if kept is not None:
        event["files"] = copy_files(kept, rd.path / RUN_FILES, (CONFIG, *TOKENIZER_FILES))
    rd.log("warm_start", **event, digest=tree_digest(params))
    return params


def initial_inner_state(cfg: RunConfig, island: Island, params: PyTree, rd: RunDir) -> PyTree | None:
    """The inner optimizer state `island` starts a fresh run with: with init.inner_state, what the source saved for
    the island of the same name or of init.inner_state_island (its newest step in `island_owners`), read into the
    structure of a fresh one over `params`; None (a fresh state) otherwise, or when the source has no checkpoint of
    that island, which is said in one line on stderr and in a `warm_start` event (a named island is refused)."""
    if not cfg.init.inner_state:
        return None
    source = locate(cfg)
    name = cfg.init.inner_state_island or island.name
    step_dir = inner_state_step(source, name, named=bool(cfg.init.inner_state_island))
    if step_dir is None:
        why = f"'{source.run_dir or source.step_dir}' holds no checkpoint of island {island.name}"
        log.warning("init.inner_state: %s; it starts with a fresh inner optimizer state", why)
        rd.log("warm_start", island=island.name, inner_state=False, reason=why)
        return None
    what = f"inner optimizer state of island {island.name} (inner.kind = {cfg.inner.kind!r})"
    state = read_item(step_dir, "inner_opt_state", island.tx.init(params), what)
    count = step_count(state)
    if count and spans_the_run(cfg) and not cfg.inner.schedule_steps:
        log.warning(
            "init.inner_state: island %s goes on from the source's step %d on a schedule of this run's %d steps; "
            "give both runs the same inner.schedule_steps to continue the source's schedule instead",
            island.name,
            count,
            cfg.total_inner_steps,
        )
    rd.log(
        "warm_start",
        island=island.name,
        inner_state=True,
        source=str(step_dir),
        source_round=int(step_dir.name),
        step_count=count,
    )
    return state
