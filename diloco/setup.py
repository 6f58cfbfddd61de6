"""What every driver builds from a config before it trains: the model, data streams, evaluation, islands.

`simulate` (all islands in one process), the coordinator (no island at all: it only evaluates), the island worker
(exactly one island) and the benchmarks start from the same `build_setup`, so a model, a data split or an
evaluation set is defined once. An island process builds only its own data stream: `build_setup(cfg, islands=[name])`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import jax
import numpy as np

from diloco.config import ConfigError, RunConfig
from islands.data import BatchStream, eval_batches, load_sources
from islands.inner import make_eval_fn, make_inner_optimizer
from islands.island import Batches, Island
from islands.mesh import build_mesh, replicated
from islands.models import Model, build_model, param_count
from outer_optimizer.fragments import FragmentError, Fragments
from transport.codecs import PyTree, flatten_named


@dataclass(frozen=True)
class Setup:
    """The model, the requested islands' data streams, the evaluation batches and θ_0."""

    model: Model
    streams: dict[str, BatchStream]
    """Island name -> its batch stream, for the islands asked for (none for a coordinator)."""
    eval_stack: np.ndarray
    """int32 [eval_batches, batch_size, seq_len + 1]: the fixed validation batches."""
    init_params: PyTree
    """θ_0, the same in every process for one seed."""
    fragments: Fragments
    """Which leaves sync together (stream.fragments; one fragment of every leaf without streaming)."""

    @property
    def n_params(self) -> int:
        return param_count(self.init_params)


def build_setup(cfg: RunConfig, islands: Sequence[str] | None = None) -> Setup:
    """Build the model, θ_0, the validation batches and the data streams of `islands` (default: every island)."""
    names = cfg.islands.island_names
    wanted = names if islands is None else tuple(islands)
    streams: dict[str, BatchStream] = {}
    only = None if islands is None else {names.index(name) for name in wanted}
    shards, val = load_sources(cfg.data, len(names), cfg.model.vocab_size, cfg.run.seed, cfg.model.seq_len, only)
    for name in wanted:
        i = names.index(name)
        streams[name] = BatchStream(shards[i], cfg.train.batch_size, cfg.model.seq_len, cfg.run.seed, stream_id=i)
    model = build_model(cfg.model)
    stack = np.stack(eval_batches(val, max(cfg.train.eval_batches, 1), cfg.train.batch_size, cfg.model.seq_len))
    params = model.init(jax.random.key(cfg.run.seed))
    sizes = {name: int(np.size(leaf)) for name, leaf in flatten_named(params).items()}
    try:
        fragments = Fragments.split(sizes, cfg.stream.fragments, cfg.stream.layout)
    except FragmentError as exc:
        raise ConfigError(str(exc)) from None
    return Setup(model, streams, stack, params, fragments)


def make_island(
    cfg: RunConfig,
    name: str,
    model: Model,
    stream: Batches,
    n_devices: int | None = None,
    total_steps: int | None = None,
) -> Island:
    """Island `name` as the config describes it (inner AdamW over the whole run's steps, mesh, uplink codec).

    `total_steps`: the inner steps this island will take, which its learning-rate schedule spans (default
    `cfg.total_inner_steps`, every island's count in rounds; the asynchronous mode gives each island its own)."""
    return Island(
        name,
        model,
        make_inner_optimizer(cfg.inner, cfg.total_inner_steps if total_steps is None else total_steps),
        stream,
        uplink=cfg.codec.spec("uplink"),
        n_devices=cfg.islands.devices if n_devices is None else n_devices,
        microbatch=cfg.train.microbatch,
        shard_params=cfg.islands.shard_params,
        inner=cfg.inner,
        slowdown=cfg.islands.slowdowns().get(name, 1.0),
    )


class Evaluator:
    """Loss of a parameter set on the fixed validation batches, replicated on the first device."""

    def __init__(self, model: Model, eval_stack: np.ndarray) -> None:
        mesh = build_mesh(1)
        self._fn = make_eval_fn(model.loss, mesh)
        self._sharding = replicated(mesh)
        self._batches = jax.device_put(eval_stack, self._sharding)

    def __call__(self, params: PyTree) -> float:
        return float(self._fn(jax.device_put(params, self._sharding), self._batches))
