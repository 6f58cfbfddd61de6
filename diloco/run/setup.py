"""What every driver builds from a config before it trains: the model, data streams, evaluation, islands.

`simulate` (all islands in one process), the coordinator (no island at all: it only evaluates), the island worker
(exactly one island) and the benchmarks start from the same `build_setup`, so a model, a data split or an
evaluation set is defined once. An island process builds only its own data stream: `build_setup(cfg, islands=[name])`.
An island of a post-training workload (`[workload]`) gets its examples' stream and the workload's loss instead of
windows of the corpus and the model's own loss (diloco/run/posttrain.py); the evaluation adds its held-out figures.
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import jax
import numpy as np

from diloco.config import ConfigError, RunConfig
from diloco.run.chunk_ledger import CORPUS
from diloco.run.chunk_sources import paths_source
from diloco.run.posttrain import PostTraining
from islands.chunks import ChunkLayout, ChunkStream, corpus_sequences, source_digest
from islands.data import BatchStream, DataError, eval_batches, load_sources, open_source
from islands.inner import make_eval_fn, make_inner_optimizer
from islands.island import Batches, Island
from islands.memory import Footprint, OutOfMemoryError, device_room, eval_advice, verdict
from islands.mesh import build_mesh, replicated
from islands.models.base import Model, param_count
from islands.models.lora import Lora, adapt
from islands.models.registry import build_model
from islands.text import corpus_tokenizer
from islands.workloads.evaluate import WorkloadEval, primary_loss
from outer_optimizer.fragments import FragmentError, Fragments
from pytrees.naming import PyTree, flatten_named


@dataclass(frozen=True)
class Setup:
    """The model, the requested islands' data streams, the evaluation batches and θ_0."""

    model: Model
    streams: dict[str, Batches]
    """Island name -> its batch stream, for the islands asked for (none for a coordinator)."""
    eval_stack: np.ndarray | None
    """int32 [chunks, sequences, seq_len + 1]: the fixed validation batches, train.eval_batches of train.batch_size
    sequences, in chunks of train.microbatch sequences when it is set (see `eval_chunks`); None when no island of
    the run trains on the corpus (workload.kind = "lm")."""
    init_params: PyTree
    """θ_0, the same in every process for one seed."""
    fragments: Fragments
    """Which leaves sync together (stream.fragments; one fragment of every leaf without streaming)."""
    layouts: dict[str, ChunkLayout] | None = None
    """data.sampling = "chunks": the sequences and chunks of each configured source, by its key (the corpus, or
    data.paths[i] each: diloco/run/chunk_sources.py; islands/chunks.py); None for windows."""
    models: dict[str, Model] | None = None
    """Island name -> the model it trains where that is not `model`: a post-training island's (the workload's loss)."""
    heldout: WorkloadEval | None = None
    """The held-out evaluation of the run's post-training workloads (None: every island trains on the corpus)."""
    lora: Lora | None = None
    """workload.lora: the frozen base the adapters (θ here) merge into; None: θ is the model's parameters."""

    @property
    def n_params(self) -> int:
        return param_count(self.init_params)

    @property
    def frozen_digest(self) -> bytes:
        """Under workload.lora, the digest of the frozen base this process read (an island's Join carries it and the
        coordinator compares it with its own); else empty."""
        return self.lora.digest if self.lora is not None else b""

    def model_of(self, island: str) -> Model:
        """The model island `island` trains: its workload's loss over the run's parameters."""
        return (self.models or {}).get(island, self.model)


def build_setup(cfg: RunConfig, islands: Sequence[str] | None = None, theta: bool = True) -> Setup:
    """Build the model, θ_0, the validation batches and the data streams of `islands` (default: every island).

    `theta=False`: θ_0 as its shapes alone (`jax.eval_shape`), for an island process, whose θ comes by its first full
    pull or from its checkpoint (diloco/worker/island_worker.py), and which places the shapes as zeros in its layout
    (`islands.inner.place_tree`): θ_0's values are never made whole on one device or host there. A LoRA base and a
    post-training workload's reference read θ_0's values, so they get them whatever `theta` says."""
    names = cfg.islands.island_names
    wanted = names if islands is None else tuple(islands)
    workload = cfg.workload
    corpus = [n for n in wanted if workload.of(n).kind == "lm"]  # the islands that read the corpus
    streams: dict[str, Batches] = {}
    layouts = chunk_layouts(cfg)
    if layouts is not None and not cfg.data.paths:  # every island reads the shared split whole: no shard is cut
        only: set[int] | None = set()
    elif islands is None and len(corpus) == len(names):
        only = None
    else:
        only = {names.index(n) for n in corpus if n in names}
    tokenizer = corpus_tokenizer(cfg.data, cfg.model.vocab_size)
    shards, val = load_sources(
        cfg.data, len(names), cfg.model.vocab_size, cfg.run.seed, cfg.model.seq_len, only, tokenizer
    )
    whole = None
    for name in corpus:
        if layouts is not None and name in names and cfg.data.paths:  # chunks of its own source
            i = names.index(name)
            streams[name] = ChunkStream(shards[i], layouts[paths_source(i)], cfg.train.batch_size, cfg.model.seq_len)
        elif layouts is not None and not (name not in names and cfg.data.own_path):
            # Chunks of the shared training split, which every island reads whole (a memmap view of one file).
            if whole is None:
                (whole,), _ = load_sources(
                    cfg.data, 1, cfg.model.vocab_size, cfg.run.seed, cfg.model.seq_len, tokenizer=tokenizer
                )
            streams[name] = ChunkStream(whole, layouts[CORPUS], cfg.train.batch_size, cfg.model.seq_len)
        elif name in names:
            i = names.index(name)
            streams[name] = BatchStream(shards[i], cfg.train.batch_size, cfg.model.seq_len, cfg.run.seed, stream_id=i)
        else:
            streams[name] = admitted_stream(cfg, name)
    model = build_model(cfg.model)
    stack = None
    if "lm" in workload.kinds(names):  # some configured island trains on the corpus: its eval loss is measured
        batches = eval_batches(val, max(cfg.train.eval_batches, 1), cfg.train.batch_size, cfg.model.seq_len)
        stack = eval_chunks(batches, cfg.train.microbatch)
    values = theta or workload.lora.enabled or workload.post_training(names)
    params = (model.init if values else functools.partial(jax.eval_shape, model.init))(jax.random.key(cfg.run.seed))
    initial = params  # θ_0 of the model's own parameters (a workload.reference path is read into its structure)
    lora = None
    if workload.lora.enabled:  # the islands train adapters over a frozen base: θ is the adapters
        from diloco.run.warm_start import lora_base

        spec = workload.lora
        lora = Lora.over(lora_base(cfg, params), spec.rank, spec.alpha, spec.targets, spec.base_dtype, spec.dropout)
        model, params = adapt(model, lora), lora.init(jax.random.key(cfg.run.seed))
    sizes = {name: int(np.size(leaf)) for name, leaf in flatten_named(params, to_numpy=False).items()}
    try:
        fragments = Fragments.split(sizes, cfg.stream.fragments, cfg.stream.layout)
    except FragmentError as exc:
        raise ConfigError(str(exc)) from None
    if not workload.post_training(names):
        return Setup(model, streams, stack, params, fragments, layouts, lora=lora)
    post = PostTraining(cfg, initial, lora)
    models = {}
    for name in wanted:
        kind = workload.of(name).kind
        if kind != "lm":
            stream_id = names.index(name) if name in names else ADMITTED_STREAMS + zlib.crc32(name.encode())
            streams[name] = post.stream(name, names, stream_id)
            models[name] = post.model(kind, model)
    streams = {name: streams[name] for name in wanted}  # in the order asked for
    return Setup(model, streams, stack, params, fragments, layouts, models, post.evaluation(names), lora)


def chunk_layouts(cfg: RunConfig) -> dict[str, ChunkLayout] | None:
    """Each configured source as chunks under data.sampling = "chunks" (None for windows), by its key: the corpus, or
    under data.paths each island's source. Counted from the training splits' sizes alone, so the coordinator reads
    no training token."""
    data = cfg.data
    if data.sampling != "chunks":
        return None
    tokenizer = corpus_tokenizer(data, cfg.model.vocab_size)

    def layout(spec: str, where: str, key: str) -> ChunkLayout:
        source = open_source(data, spec, where, cfg.model.vocab_size, cfg.run.seed, key, True, tokenizer)
        return source_layout(cfg, source.n_train, where)

    if data.paths:
        keys = [paths_source(i) for i in range(len(data.paths))]  # the config key is the source's key
        return {key: layout(p, f"{key} {p!r}", key) for key, p in zip(keys, data.paths, strict=True)}
    where = (
        f"data.synthetic_tokens ({data.synthetic_tokens})" if data.kind == "synthetic" else f"data.path {data.path!r}"
    )
    return {CORPUS: layout(data.path, where, "data.path")}


def source_layout(cfg: RunConfig, train_tokens: int, where: str) -> ChunkLayout:
    """A source of `train_tokens` training tokens as chunks; a source too short for one sequence is one line naming
    it (`where`)."""
    sequences = corpus_sequences(train_tokens, cfg.model.seq_len)
    if sequences < 1:
        raise DataError(
            f"{where}: data.sampling = 'chunks' reads whole sequences of model.seq_len + 1 = {cfg.model.seq_len + 1} "
            f"tokens, and its training split holds {train_tokens}"
        )
    return ChunkLayout(sequences, cfg.data.chunk_sequences, cfg.run.seed)


def admitted_stream(cfg: RunConfig, name: str) -> Batches:
    """The batches of an island admitted into a live run (not in islands.names, so it has no shard of its own):
    windows drawn over its own source (data.own_path) or else over the whole shared training split, with a stream
    of its own named by its name; under data.sampling = "chunks", the chunks of its own source, which its leases name
    by content (`source_digest`). With data.paths (one source per configured island) and no source of its own, an
    admitted island has nothing to train on: refused in one line."""
    data = cfg.data
    tokenizer = corpus_tokenizer(data, cfg.model.vocab_size)
    if data.own_path:
        own = open_source(data, data.own_path, f"data.own_path {data.own_path!r}", cfg.model.vocab_size, cfg.run.seed,
                          "data.own_path", tokenizer=tokenizer)  # fmt: skip
        train = own.train
        if data.sampling == "chunks":
            layout = source_layout(cfg, len(train), f"data.own_path {data.own_path!r}")
            digest = source_digest(train, layout, cfg.model.seq_len)
            return ChunkStream(train, layout, cfg.train.batch_size, cfg.model.seq_len, source=digest)
    elif data.paths:
        raise ConfigError(
            f"island {name!r} is not in islands.names and data.paths gives one source per configured island: "
            "give the admitted island its own source (data.own_path=PATH on its command line)"
        )
    else:
        (train,), _ = load_sources(data, 1, cfg.model.vocab_size, cfg.run.seed, cfg.model.seq_len, tokenizer=tokenizer)
    stream_id = ADMITTED_STREAMS + zlib.crc32(name.encode())
    return BatchStream(train, cfg.train.batch_size, cfg.model.seq_len, cfg.run.seed, stream_id=stream_id)


ADMITTED_STREAMS = 1 << 32
"""Admitted islands' stream ids start here, beyond any configured island's index."""


def eval_chunks(batches: list[np.ndarray], microbatch: int) -> np.ndarray:
    """The evaluation batches stacked, in chunks of `microbatch` sequences when it is set: evaluation then needs no
    more memory than a training pass (a batch that fits only in micro-batches must not be evaluated whole). The loss
    is a mean over equally sized chunks, so it is the batches' mean loss whatever the chunking."""
    stack = np.stack(batches)
    return stack.reshape(-1, microbatch, stack.shape[-1]) if microbatch else stack


def make_island(
    cfg: RunConfig,
    name: str,
    model: Model,
    stream: Batches,
    n_devices: int | None = None,
    total_steps: int | None = None,
    check_memory: bool = True,
) -> Island:
    """Island `name` as the config describes it (inner AdamW over the whole run's steps, mesh, uplink codec).

    `total_steps`: the inner steps this island will take, which its learning-rate schedule spans (default
    `cfg.total_inner_steps`, every island's count in rounds; the asynchronous mode gives each island its own).

    Its train step is compiled here and checked against the memory free now (`Island.check_memory`): a step too big
    is one line (OutOfMemoryError) before any state is placed or evaluation runs, in every driver. `check_memory =
    False` where the island's own step never runs: train.vectorize's program (islands/vectorized.py) is compiled and
    checked instead, and compiling this one too would cost every island a compilation for nothing."""
    island = Island(
        name,
        model,
        make_inner_optimizer(cfg.inner, cfg.total_inner_steps if total_steps is None else total_steps),
        stream,
        uplink=cfg.codec.spec("uplink"),
        n_devices=cfg.islands.devices if n_devices is None else n_devices,
        microbatch=cfg.train.microbatch,
        shard_params=cfg.islands.shard_params,
        tensor=cfg.islands.tensor,
        inner=cfg.inner,
        slowdown=cfg.islands.slowdowns().get(name, 1.0),
        device_step_s=cfg.islands.device_step_s,
        remat=None if cfg.model.kind == "custom" else cfg.model.remat,
        feedback_decay=cfg.outer.feedback_decay,
        seed=cfg.run.seed,
    )
    if check_memory:
        island.check_memory()
    return island


class Evaluator:
    """Loss of a parameter set on the fixed validation batches, replicated on the first device; with post-training
    workloads, their held-out figures too (`measure`), the run's eval loss then being workload.kind's
    (`islands.workloads.evaluate.primary_loss`).

    The first call compiles the evaluation ahead of time and checks that it fits in the memory free (islands/memory.py):
    too big is one line (OutOfMemoryError), not a RESOURCE_EXHAUSTED traceback. Later calls hit jit's cache."""

    def __init__(
        self, model: Model, eval_stack: np.ndarray | None, heldout: WorkloadEval | None = None, primary: str = "lm"
    ) -> None:
        """`eval_stack`: the corpus's validation batches (None: no island trains on the corpus); `heldout`: the
        post-training figures; `primary`: workload.kind, whose loss is the eval loss."""
        mesh = build_mesh(1)
        self._fn = make_eval_fn(model.loss, mesh)
        self._sharding = replicated(mesh)
        self._batches = None if eval_stack is None else jax.device_put(eval_stack, self._sharding)
        self._checked = eval_stack is None
        self.heldout, self.primary = heldout, primary

    @classmethod
    def of(cls, cfg: RunConfig, setup: Setup) -> Evaluator:
        """The evaluation of the run `setup` was built for."""
        return cls(setup.model, setup.eval_stack, setup.heldout, cfg.workload.kind)

    def _check_memory(self, params: PyTree) -> None:
        compiled = self._fn.lower(params, self._batches).compile()
        n, rows, tokens = self._batches.shape
        message = verdict(
            "evaluating the global model",
            Footprint.of(compiled),
            device_room(list(self._sharding.mesh.devices.flat)),
            f"{n} chunk{'s' if n > 1 else ''} of {rows} x {tokens} tokens, one at a time",
            eval_advice(rows),
        )
        if message is not None:
            raise OutOfMemoryError(message)
        self._checked = True

    def footprint(self, params: PyTree) -> Footprint | None:
        """XLA's figure for evaluating parameters shaped like `params`, from their shapes alone (nothing placed); None
        without validation batches (the post-training figures' programs are not in the cost model)."""
        if self._batches is None:
            return None
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=self._sharding), params)
        return Footprint.of(self._fn.lower(abstract, self._batches).compile())

    def __call__(self, params: PyTree) -> float:
        """The eval loss alone."""
        return self.measure(params)[0]

    def measure(self, params: PyTree) -> tuple[float, dict[str, float]]:
        """(the eval loss, the post-training figures: {} without post-training). The eval loss is the corpus's
        cross-entropy under workload.kind = "lm" (then every figure is an addition), else workload.kind's figure
        (then the corpus's, where some island trains on it, is the figure `lm_loss`)."""
        placed = jax.device_put(params, self._sharding)
        lm = None
        if self._batches is not None:
            if not self._checked:
                self._check_memory(placed)
            lm = float(self._fn(placed, self._batches))
        figures = {} if self.heldout is None else self.heldout(placed)
        if self.primary == "lm":
            assert lm is not None
            return lm, figures
        return primary_loss(self.primary, figures), figures | ({"lm_loss": lm} if lm is not None else {})
