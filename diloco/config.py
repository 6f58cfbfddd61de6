"""Run configuration: frozen nested dataclasses loaded from TOML, with dotted `key=value` overrides.

Each section is a frozen dataclass with a docstring under every field and a `__post_init__` that validates its
own values and names the offending key. The sections that belong to a package live there (`ModelConfig` in
islands.models.config, `DataConfig` in islands.data, `InnerConfig` in islands.config, `OuterConfig` in
outer_optimizer.config) so that the dependency direction of docs/architecture.md ("Package boundaries") holds;
this module only assembles them and does the generic work: reading TOML, applying overrides, type checking,
suggesting the closest key for a typo, writing the resolved config back. No section imports JAX, so neither does
loading a config (tests/test_layering.py).
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import math
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from diloco.coordinator.membership import QuorumConfig
from diloco.run.roster_script import RosterConfig, script_refusal
from floor.codec import CodecError, CodecSpec
from floor.errors import UserError
from floor.fields import LOCAL
from islands import prepared
from islands.backend import BACKENDS
from islands.config import InnerConfig
from islands.data import DataConfig
from islands.models.config import ModelConfig
from islands.models.hf.checkpoint import kept_checkpoint
from islands.models.hf.families import merged_model
from islands.workloads.config import WorkloadConfig, workload_conflict
from outer_optimizer.config import OuterConfig
from outer_optimizer.fragments import LAYOUTS, check_schedule
from transport.auth import REDACTED_SECRET, is_island_name, is_secret_reference, redact_secret, reserved_name_refusal
from transport.config import TransportConfig


class ConfigError(UserError, ValueError):
    """A user mistake in a config file or override; the message is one line naming the key."""


@dataclass(frozen=True)
class RunSection:
    name: str = "diloco"
    """A human name for the run (shown in progress lines and summary.json)."""
    seed: int = 0
    """Seed of everything random: parameter init, data order, jitter. Same seed, same run."""
    tensorboard: bool = field(default=False, metadata=LOCAL)
    """Also write TensorBoard curves to RUN_DIR/tensorboard/ (diloco/ops/tensorboard.py), from the same events as
    metrics.jsonl; needs the `tensorboard` extra (pip install 'diloco[tensorboard]'). Per process, like
    network.metrics_port: not part of the run's identity, so give it again when resuming."""

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("run.name must not be empty")


TRAIN_MODES = ("diloco", "sync", "async")
"""The values of train.mode."""


@dataclass(frozen=True)
class TrainConfig:
    mode: str = "diloco"
    """"diloco" (islands + outer optimizer), "sync" (the data-parallel baseline: one model, one AdamW, on the
    union of the islands' batches every step) or "async" (the coordinator applies each island's
    pseudo-gradient as soon as it arrives, weighted by its staleness, and no island waits for another; in `simulate`
    on a virtual clock, diloco/simulator/async_sim.py; in the processes, docs/architecture.md "Asynchronous rounds")."""
    rounds: int = 10
    """Outer rounds. Each island does `inner_steps` steps per round, so rounds * inner_steps steps in all.
    With mode = "async" a round is one outer update, one island's `inner_steps` steps: rounds * inner_steps steps of
    all islands together (islands.count × the rounds of plain DiLoCo train the same tokens)."""
    inner_steps: int = 50
    """H: inner AdamW steps per island between two synchronisations."""
    batch_size: int = 16
    """Sequences per inner step per island (the island's batch, fixed whatever its device count)."""
    microbatch: int = 0
    """Sequences per device per forward/backward pass; 0 means the whole batch in one pass. When the batch
    does not fit, gradients are accumulated over batch_size / (microbatch * devices) passes."""
    eval_batches: int = 8
    """Validation batches (of batch_size sequences) to evaluate the global model on after each round."""
    checkpoint_every: int = 1
    """Save a checkpoint every this many rounds (0 disables checkpoints)."""
    log_every: int = 10
    """Write an `inner` metrics event every this many inner steps."""
    round_seconds: float = 0.0
    """Time-budgeted rounds: each island trains as many inner steps as fit this many seconds of its own training
    (at least 1, at most inner_steps) before it syncs, so a slow island sends fewer tokens rather than holding up the
    round; the mean is token-weighted. 0: exactly inner_steps per round."""
    vectorize: bool = False
    """`diloco simulate` only: run each run of inner steps of all the islands as one program (islands/vectorized.py:
    their params and inner states stacked along an island axis, n steps of every island in one dispatch) instead of
    one island after another. Faster where dispatching a step costs as much as computing it (small models, many
    islands); the results agree with the sequential path to float rounding, not bit for bit, so a run keeps the
    setting it started with (it is part of the run's identity). Needs train.mode = "diloco", islands.devices = 1, no
    train.round_seconds and no islands.slowdown (all refused with it); the coordinator and island processes, one
    island each, refuse it. false: the islands step in turn, the reference path."""

    def __post_init__(self) -> None:
        if self.mode not in TRAIN_MODES:
            raise ValueError(f"train.mode must be 'diloco', 'sync' or 'async' (got {self.mode!r})")
        for key in ("rounds", "inner_steps", "batch_size", "log_every"):
            if getattr(self, key) < 1:
                raise ValueError(f"train.{key} must be >= 1 (got {getattr(self, key)})")
        for key in ("microbatch", "eval_batches", "checkpoint_every"):
            if getattr(self, key) < 0:
                raise ValueError(f"train.{key} must be >= 0 (got {getattr(self, key)})")
        if not 0.0 <= self.round_seconds < float("inf"):
            raise ValueError(f"train.round_seconds must be a finite number >= 0 (got {self.round_seconds})")
        if self.microbatch and self.batch_size % self.microbatch:
            raise ValueError(
                f"train.batch_size ({self.batch_size}) must be a multiple of train.microbatch ({self.microbatch})"
            )


TOML_KEY = "toml_key"
"""Field metadata: the field's key in TOML files and overrides, when that key cannot be its Python name (`init.from`:
`from` is a keyword). `from_dict` reads it and `to_dict` writes it, so config.toml and digests use the TOML key."""


@dataclass(frozen=True)
class InitConfig:
    """Warm start (diloco/run/warm_start.py): round 0 begins from another run's checkpoint instead of a random θ_0."""

    from_: str = field(default="", metadata={TOML_KEY: "from"})
    """A run directory of this project (its newest coordinator checkpoint, or the sync baseline's), a checkpoint
    directory of one (RUN/checkpoints/coordinator, an island's checkpoints/) or one step of it (.../coordinator/12):
    θ_0 is its parameters, and the initial `eval` is of them. The model must be the same ([model] and every tensor's
    shape). Read only when a run starts afresh: a run directory that resumes restores its own checkpoints. "": the
    random θ_0 of run.seed."""
    inner_state: bool = False
    """Each island also starts with the inner optimizer state that the source saved for the island of the same name
    (or for init.inner_state_island): moments and step counts as saved, so the learning-rate schedule goes on from
    the source's count (give both runs the same inner.schedule_steps to continue the source's schedule, the papers'
    warm start); an island the source has no checkpoint of starts with a fresh one, and says so in one line. The
    source must have trained with the same inner.kind. false: fresh inner states."""
    inner_state_island: str = ""
    """The source's island whose inner state every island starts with ("sync": the sync baseline's one model, the
    pretraining of `diloco bench convergence --warm-start`); a source without it is refused in one line. "": each
    island takes the state of the island of its own name."""

    def __post_init__(self) -> None:
        if self.inner_state and not self.from_:
            raise ValueError("init.inner_state = true needs init.from (the run whose inner optimizer states to load)")
        if self.inner_state_island and not self.inner_state:
            raise ValueError("init.inner_state_island names the inner state to load: it needs init.inner_state = true")


@dataclass(frozen=True)
class StreamConfig:
    """Streaming DiLoCo (arXiv 2501.18512; outer_optimizer/fragments.py): fragments that sync in turn, overlapped."""

    fragments: int = 1
    """P: fragments of the parameters, each synced every H steps at its own offset (1: plain DiLoCo)."""
    layout: str = "strided"
    """Which layers form a fragment: "strided" (layer k -> fragment k mod P, the paper's) or "contiguous"."""
    overlap_steps: int = 0
    """τ: inner steps an island trains on after sending a fragment before it merges the committed global copy
    (0: merged at once, exactly the non-overlapped algorithm)."""
    merge_alpha: float = 0.0
    """α of the merge θ_p <- α·θ_p,local + (1 - α)·θ_p,global (0: take the global fragment, as the paper's main
    runs do)."""

    def __post_init__(self) -> None:
        if self.fragments < 1:
            raise ValueError(f"stream.fragments must be >= 1 (got {self.fragments})")
        if self.layout not in LAYOUTS:
            raise ValueError(f"stream.layout must be one of {', '.join(LAYOUTS)} (got {self.layout!r})")
        if not 0.0 <= self.merge_alpha <= 1.0:
            raise ValueError(f"stream.merge_alpha must be in [0, 1] (got {self.merge_alpha})")

    @property
    def streaming(self) -> bool:
        """Whether anything differs from plain DiLoCo's round."""
        return self.fragments > 1 or self.overlap_steps > 0


@dataclass(frozen=True)
class IslandsConfig:
    count: int = 2
    """Number of islands (regions)."""
    names: tuple[str, ...] = ()
    """Island names, one per island; empty means island-0, island-1, ..."""
    devices: int = 1
    """Local devices each island uses (its mesh size). On CPU, more come from
    XLA_FLAGS=--xla_force_host_platform_device_count=N."""
    shard_params: bool = False
    """Shard parameters and optimizer state across the island's devices (for models larger than one device): along
    the data axis of its mesh, FSDP style (islands/mesh.py)."""
    tensor: int = 1
    """The tensor-parallel width of each island's mesh: its devices form a mesh of data (devices / tensor) x tensor,
    and the tensor axis splits attention heads, the feed-forward's hidden width, the vocabulary and expert stacks
    (islands/mesh.py, by the model's logical axes; a built-in model.kind). Must divide islands.devices, so a tensor
    group is one process's devices."""
    slowdown: tuple[str, ...] = ()
    """"NAME=FACTOR" entries: island NAME takes FACTOR (>= 1) times as long per inner step (it sleeps the difference),
    a stand-in for slower hardware in tests and benchmarks."""
    device_step_s: float = 0.0
    """Every inner step of every island lasts at least this many seconds: the island sleeps what its step left, so
    its host is idle then, as a host is while its accelerator runs the step (0: off). A stand-in for islands whose
    steps are bound by their devices, for benchmarks on one shared host: islands.slowdown stretches each step by a
    factor of its measured time, so the cores' contention is stretched with it; this keeps the steps' length fixed
    (docs/architecture.md, "Cost model")."""
    backend: str = field(default="local", metadata=LOCAL)
    """How an island process reaches its devices (islands/backend.py): "local" (what JAX finds on this host: CPU
    devices, GPUs, TPU chips) or "pathways" (the process is the single controller of a Pathways-managed TPU slice,
    through pathwaysutils: the `pathways` extra, and JAX_PLATFORMS=proxy + JAX_BACKEND_TARGET in its environment;
    docs/pathways.md). Per process, like the TLS files: islands of one run may reach their devices differently."""
    processes: int = field(default=1, metadata=LOCAL)
    """Processes per island (a multi-host island, diloco/worker/island_group.py): N processes joined by jax.distributed
    into one JAX program, each with islands.devices local devices, so the island's mesh spans N x islands.devices
    devices. Process 0 talks to the coordinator, the others replay its calls. `diloco island` takes it as the
    default of --num-processes. Per island (per process, not in the config digest): islands of one run may span
    different numbers of hosts."""
    regroup_wait_s: float = field(default=60.0, metadata=LOCAL)
    """How long the leader of a multi-process island (processes > 1) waits at each start for its other processes
    before it forms the island with those present; one that comes later joins at a round's end, when the island
    re-forms (diloco/worker/island_formation.py). Also how long the island's other processes wait for a lost leader
    (process 0) to come back before the lowest of them takes the island over. Keep it longer than a process takes to
    start (or a pod to be rescheduled): a process that is merely slow is otherwise left out and costs the island a
    re-forming, at each start. Shorter lets an island that lost a host for good go on sooner. Per process."""
    max: int = 64
    """The most islands the run's roster may hold at once: the configured ones plus those an operator admits while
    it runs (`diloco admit`, diloco/coordinator/enrollment.py), less the retired. Bounds what admissions can make
    the coordinator hold."""
    admissions_per_minute: int = 10
    """At most this many admissions in any 60 s: more are refused (RESOURCE_EXHAUSTED) until the minute passes."""
    retire_after_s: float = 0.0
    """An island gone (lost or left) this long is retired: its credentials are refused from then on and its data
    goes back to the pool. 0: never (an island gone for good is retired by `diloco retire NAME`)."""

    def __post_init__(self) -> None:
        if self.count < 1:
            raise ValueError(f"islands.count must be >= 1 (got {self.count})")
        if self.names and len(self.names) != self.count:
            raise ValueError(f"islands.names has {len(self.names)} names but islands.count is {self.count}")
        if len(set(self.names)) != len(self.names):
            raise ValueError(f"islands.names must be unique (got {list(self.names)})")
        if any(not is_island_name(n) for n in self.names):
            raise ValueError(
                f"islands.names must be [A-Za-z0-9_-] names of 1 to 64 characters (got {list(self.names)})"
            )
        for name in self.names:
            if reserved := reserved_name_refusal(name):
                raise ValueError(f"islands.names: {reserved}")
        if self.devices < 1:
            raise ValueError(f"islands.devices must be >= 1 (got {self.devices})")
        if self.tensor < 1 or self.devices % self.tensor:
            raise ValueError(f"islands.tensor ({self.tensor}) must be >= 1 and divide islands.devices ({self.devices})")
        if self.processes < 1:
            raise ValueError(f"islands.processes must be >= 1 (got {self.processes})")
        if not 0.0 <= self.regroup_wait_s <= 3600.0:
            raise ValueError(f"islands.regroup_wait_s must be between 0 and 3600 seconds (got {self.regroup_wait_s})")
        if not 0.0 <= self.device_step_s <= 60.0:
            raise ValueError(f"islands.device_step_s must be between 0 and 60 seconds (got {self.device_step_s})")
        if self.backend not in BACKENDS:
            raise ValueError(f"islands.backend must be one of {', '.join(BACKENDS)} (got {self.backend!r})")
        if self.backend == "pathways" and self.processes != 1:
            raise ValueError(
                "islands.backend = 'pathways' drives a whole slice from one process: islands.processes must be 1"
            )
        if self.max < self.count:
            raise ValueError(f"islands.max ({self.max}) must be >= islands.count ({self.count})")
        if self.admissions_per_minute < 1:
            raise ValueError(f"islands.admissions_per_minute must be >= 1 (got {self.admissions_per_minute})")
        if not 0 <= self.retire_after_s < math.inf:
            raise ValueError(f"islands.retire_after_s must be >= 0 seconds (got {self.retire_after_s})")
        self.slowdowns()  # refuse a malformed entry when the config loads, not when an island starts

    def slowdowns(self) -> dict[str, float]:
        """islands.slowdown as island name -> factor."""
        out: dict[str, float] = {}
        for entry in self.slowdown:
            name, sep, factor = entry.partition("=")
            try:
                value = float(factor)
            except ValueError:
                value = math.nan
            if not sep or name not in self.island_names or not 1.0 <= value < math.inf:
                raise ValueError(
                    f"islands.slowdown entry {entry!r} must be NAME=FACTOR with NAME one of islands.names "
                    f"({', '.join(self.island_names)}) and FACTOR a number >= 1"
                )
            out[name] = value
        return out

    @property
    def island_names(self) -> tuple[str, ...]:
        return self.names or tuple(f"island-{i}" for i in range(self.count))


@dataclass(frozen=True)
class CodecConfig:
    uplink: str = "fp32"
    """Codec of the islands' pseudo-gradients: "fp32" (lossless), "bf16", "int8" or "int4" (blockwise absmax), or
    "sparse" (chunked top-k with low-bit values, SparseLoCo's), with error feedback on the island."""
    downlink: str = "fp32"
    """Codec of the coordinator's outer updates (error feedback on the coordinator); θ commits what is sent. With
    "sparse" the update is sparsified again, what it drops kept in the coordinator's residual."""
    block_size: int = 256
    """Values per quantization block for int8/int4 (one float32 scale each)."""
    zstd_level: int = 0
    """zstd level after quantization (0 = off)."""
    chunk: int = 4096
    """sparse: values per chunk, each chunk keeping its own top-k (4096: SparseLoCo's 64 x 64 chunks; at most
    65536, even)."""
    density: float = 1 / 64
    """sparse: the fraction of each chunk kept, in (0, 1]; 1/64 keeps 64 of 4096 (SparseLoCo's 1-3 % range)."""
    sparse_bits: int = 2
    """sparse: bits per kept value, 2..8: a sign and sparse_bits - 1 bits of magnitude between the chunk's smallest
    and largest kept magnitudes."""
    downlink_density: float = 0.0
    """A sparse downlink's density; 0 = follow the run. SparseLoCo's downlink is the union of the islands' sparse
    updates: with `outer.kind = "sparseloco"` (no momentum) and a sparse uplink, an update of n islands has at most
    n x `density` nonzeros a chunk, and with 0 here each commit is sent at that density (at most 1), n the islands
    whose pseudo-gradients it holds, so it follows the live roster as islands are admitted, retired or missing; the
    coordinator's residual keeps only the kept values' rounding (with `downlink_bits = 8`, little). With any other
    outer rule 0 means `density`. A value set here is used for every commit."""
    downlink_bits: int = 0
    """A sparse downlink's bits per kept value, 2..8; 0 = `sparse_bits`."""

    def __post_init__(self) -> None:
        if (self.downlink_density or self.downlink_bits) and self.downlink != "sparse":
            raise ValueError(
                f"codec.downlink_density and codec.downlink_bits apply to codec.downlink = 'sparse' only "
                f"(codec.downlink is {self.downlink!r})"
            )
        for key in ("uplink", "downlink"):
            try:
                self.spec(key)
            except CodecError as exc:
                message = str(exc).replace("codec.kind", f"codec.{key}").replace("codec.block_size", "codec.chunk")
                if key == "downlink" and self.downlink_density:
                    message = message.replace("codec.density", "codec.downlink_density")
                if key == "downlink" and self.downlink_bits:
                    message = message.replace("codec.sparse_bits", "codec.downlink_bits")
                raise ValueError(message) from None

    def spec(self, direction: str) -> CodecSpec:
        kind = getattr(self, direction)
        if kind == "sparse":
            down = direction == "downlink"
            return CodecSpec(
                kind=kind,
                block_size=self.chunk,
                zstd_level=self.zstd_level,
                density=(down and self.downlink_density) or self.density,
                sparse_bits=(down and self.downlink_bits) or self.sparse_bits,
            )
        return CodecSpec(kind=kind, block_size=self.block_size, zstd_level=self.zstd_level)


SECRET_REFS = {"secret_refs": True}
"""Field metadata: secret references; `to_dict` keeps env:/file: references and redacts literals."""


@dataclass(frozen=True)
class NetworkConfig:
    links: str = ""
    """WAN link profile file (e.g. configs/links/wan3.toml) shaping every island's link; "" = unshaped."""
    secrets: tuple[str, ...] = field(default=(), metadata=SECRET_REFS)
    """One secret per island (in islands.names order), written "env:VAR" or "file:PATH": the reference is what
    config dumps, the run directory and the config sent at join carry, never the secret. A literal secret is
    refused in a config file (config files are shared with every island and often committed) and accepted only
    as a command-line override, with a warning. Empty: `launch` makes random ones; a standalone coordinator then
    authenticates nobody, so it refuses to listen beyond loopback without --insecure. With secrets, Status
    needs an island's credentials too."""
    tls_cert: str = field(default="", metadata=LOCAL)
    """PEM certificate (chain) this process presents: the coordinator's server certificate, or an island's client
    certificate for a mutual-TLS coordinator. Per process (`--tls-cert` overrides it); "" = none."""
    tls_key: str = field(default="", metadata=LOCAL)
    """The unencrypted PEM private key of tls_cert (keep it mode 0600). Per process (`--tls-key`)."""
    tls_ca: str = field(default="", metadata=LOCAL)
    """PEM CA certificate(s). On an island or `diloco status`: what verifies the coordinator's certificate (setting
    it turns TLS on). On the coordinator: what verifies the islands' client certificates; setting it makes
    every client present one (mutual TLS). Per process (`--tls-ca`)."""
    tls_server_name: str = field(default="", metadata=LOCAL)
    """Client only: the name to verify in the coordinator's certificate when it differs from the host dialled
    (e.g. dialling an IP whose certificate names a DNS name); setting it turns TLS on. Per process."""
    pull_wait_s: float = 10.0
    """How long a pull for a round that is still open waits for the commit before asking the island to retry."""
    connect_timeout_s: float = 30.0
    """An island gives up with a clear error when the coordinator does not answer its first join for this long."""
    coordinator_wait_s: float = 600.0
    """Once joined, how long an island keeps retrying (with backoff, state kept) while the coordinator is away."""
    metrics_port: int = field(default=0, metadata=LOCAL)
    """Prometheus /metrics (diloco/ops/metrics.py): the coordinator serves on this port and island i (its index in
    islands.names) on metrics_port + 1 + i, so one config gives every process of a host its own; `--metrics-port`
    gives one process its port instead. 0: no metrics endpoint. Per process (not part of the run's identity)."""
    operator_secret: str = field(default="", metadata=LOCAL)
    """The operator's credential, written "env:VAR" or "file:PATH": with it, `diloco admit` and `diloco retire`
    change the roster of a live run; without it the coordinator refuses every admission and retirement but an
    island's own (diloco/coordinator/enrollment.py). Per process: only the coordinator and the operator's
    commands read it; it is never written to the run dir or sent to an island."""
    metrics_host: str = field(default="127.0.0.1", metadata=LOCAL)
    """Where an island's /metrics listens (the coordinator's listens on the host of its --listen). Per process."""

    def __post_init__(self) -> None:
        for key in ("pull_wait_s", "connect_timeout_s", "coordinator_wait_s"):
            if not getattr(self, key) > 0:
                raise ValueError(f"network.{key} must be > 0 (got {getattr(self, key)})")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("network.tls_cert and network.tls_key must be set together")
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"network.metrics_port must be a port number, 0 (off) to 65535 (got {self.metrics_port})")
        if self.operator_secret and not is_secret_reference(self.operator_secret):
            raise ValueError(
                "network.operator_secret must be env:VAR or file:PATH (a reference: the secret itself is never "
                "written in a config or on a command line)"
            )


@dataclass(frozen=True)
class RunConfig:
    run: RunSection = field(default_factory=RunSection)
    """Name and seed."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The model every island trains."""
    data: DataConfig = field(default_factory=DataConfig)
    """Where the tokens come from and how they are split across islands."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Rounds, H, batch and mode."""
    init: InitConfig = field(default_factory=InitConfig)
    """Warm start: θ_0 (and optionally the islands' inner states) from another run's checkpoint."""
    inner: InnerConfig = field(default_factory=InnerConfig)
    """The islands' inner AdamW."""
    outer: OuterConfig = field(default_factory=OuterConfig)
    """The coordinator's outer optimizer."""
    stream: StreamConfig = field(default_factory=StreamConfig)
    """Streaming DiLoCo: fragments, overlap, merge."""
    islands: IslandsConfig = field(default_factory=IslandsConfig)
    """How many islands and on how many devices."""
    codec: CodecConfig = field(default_factory=CodecConfig)
    """How pseudo-gradients and updates are compressed on the wire."""
    quorum: QuorumConfig = field(default_factory=QuorumConfig)
    """When the coordinator closes a round: leases, min_islands, adaptive deadline."""
    network: NetworkConfig = field(default_factory=NetworkConfig)
    """WAN link profile and island credentials."""
    transport: TransportConfig = field(default_factory=TransportConfig)
    """Chunking, message limits, deadlines and retries of the gRPC transport."""
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    """What the islands minimize: next-token loss (lm, the default), or post-training (sft, dpo, rl)."""
    roster: RosterConfig = field(default_factory=RosterConfig, metadata=LOCAL)
    """Joins, retirements and kills by round that `simulate` and `launch` carry out (diloco/run/roster_script.py): what
    the drivers do to the run, not part of its identity (the coordinator and the islands never read it)."""

    def __post_init__(self) -> None:
        if self.network.secrets and len(self.network.secrets) != self.islands.count:
            raise ValueError(
                f"network.secrets has {len(self.network.secrets)} entries but islands.count is {self.islands.count}"
            )
        if self.train.round_seconds and self.stream.streaming:
            raise ValueError(
                "train.round_seconds (time-budgeted rounds) needs whole rounds: stream.fragments = 1 and "
                "stream.overlap_steps = 0"
            )
        if self.train.mode == "async" and (self.train.round_seconds or self.stream.streaming):
            key = "train.round_seconds" if self.train.round_seconds else "stream.fragments / stream.overlap_steps"
            raise ValueError(
                f"train.mode = 'async' pushes whole runs of train.inner_steps steps (its virtual clock "
                f"counts steps): {key} cannot be set with it"
            )
        if self.data.sampling == "chunks" and self.train.mode == "sync":
            raise ValueError(
                "data.sampling = 'chunks' leases chunks round by round to islands that push what they read: DiLoCo "
                "rounds (streaming too) or asynchronous updates (train.mode = 'diloco' or 'async'); train.mode = "
                "'sync' cannot be set with it"
            )
        if self.data.kind == "text" and self.data.tokenizer and "lm" in self.workload.kinds(self.islands.island_names):
            raise ValueError(
                f"data.kind = 'text' feeds the corpus to the model as byte ids, and this run's model reads the ids of "
                f"its tokenizer {self.data.tokenizer!r}: give the corpus as data.kind = 'jsonl' or 'parquet' "
                "(tokenized by it) or prepare it with `diloco data prepare --tokenizer`"
            )
        if self.train.vectorize:
            why = cannot_vectorize(self)
            if why is not None:
                raise ValueError(f"train.vectorize = true steps every island in one program: {why}")
        why = check_schedule(self.train.inner_steps, self.stream.fragments, self.stream.overlap_steps)
        if why is not None:
            raise ValueError(why)
        if self.outer.kind == "sparseloco" and self.codec.uplink == "fp32":
            raise ValueError(
                "outer.kind = 'sparseloco' replaces outer momentum by the islands' error feedback, which a lossless "
                "codec.uplink = 'fp32' does not have: set codec.uplink (to 'sparse', as SparseLoCo does)"
            )
        if self.codec.uplink == "sparse" and self.outer.aggregate in ("trimmed_mean", "median"):
            raise ValueError(
                f"codec.uplink = 'sparse' sends each island's own few coordinates, which a coordinate-wise "
                f"outer.aggregate = {self.outer.aggregate!r} turns to zero wherever fewer than half the islands sent "
                "one: set outer.aggregate to 'mean' or 'norm_clip'"
            )
        if 0 < self.inner.schedule_steps < self.total_inner_steps:
            raise ValueError(
                f"inner.schedule_steps ({self.inner.schedule_steps}) is shorter than the run's "
                f"train.rounds x train.inner_steps ({self.total_inner_steps}): the schedule spans the whole run"
            )
        if self.workload.lora.enabled and self.init.inner_state:
            raise ValueError(
                "init.inner_state loads the source's inner optimizer states, which are over all of θ; workload.lora "
                "trains adapters only: leave init.inner_state unset"
            )
        if self.workload.lora.enabled and self.inner.kind == "muon":
            raise ValueError(
                "workload.lora trains low-rank adapters, which are not the hidden-layer matrices Muon takes: set "
                'inner.kind = "adamw"'
            )
        why = workload_conflict(
            self.workload,
            self.islands.island_names,
            self.model.kind,
            self.model.seq_len,
            self.train.batch_size,
            self.data.sampling,
            self.train.mode,
        )
        if why is not None:
            raise ValueError(why)
        if self.roster.events:
            if self.train.mode != "diloco" or self.stream.streaming or self.train.vectorize:
                raise ValueError(
                    "roster.events changes the roster between DiLoCo rounds: train.mode = 'diloco', without streaming "
                    "(stream.fragments / overlap_steps) or train.vectorize"
                )
            why = script_refusal(self.roster.events, self.islands.island_names, self.train.rounds, self.islands.max)
            if why is not None:
                raise ValueError(why)
        if isinstance(self.quorum.min_islands, int) and self.quorum.min_islands > self.islands.count:
            raise ValueError(
                f"quorum.min_islands ({self.quorum.min_islands}) exceeds islands.count ({self.islands.count})"
            )

    @property
    def total_inner_steps(self) -> int:
        return self.train.rounds * self.train.inner_steps

    @property
    def union_downlink(self) -> bool:
        """The downlink is SparseLoCo's union of the islands' sparse updates, sized by the islands of each commit
        (`OuterLoop.downlink_for`): outer.kind = "sparseloco" (no outer momentum, so an update of n islands holds at
        most n x k values a chunk), sparse both ways, and codec.downlink_density left unset."""
        c = self.codec
        return self.outer.kind == "sparseloco" and c.uplink == c.downlink == "sparse" and not c.downlink_density

    def downlink_specs(self) -> tuple[CodecSpec, ...]:
        """Every spec a commit of this run may be sent with, the densest last: the downlink's, or with the union
        downlink one per count of islands a commit can hold (1 to islands.max; fewer once the union covers whole
        chunks). What an island accepts a commit's sparse headers from (a wire field, checked as any other)."""
        base = self.codec.spec("downlink")
        if not self.union_downlink:
            return (base,)
        return tuple(dict.fromkeys(base.union(n, self.codec.density) for n in range(1, self.islands.max + 1)))


def cannot_vectorize(cfg: RunConfig) -> str | None:
    """Why the islands of `cfg` cannot step as one program (train.vectorize), naming the key; None if they can."""
    if cfg.train.mode != "diloco":
        return f"train.mode must be 'diloco' (got {cfg.train.mode!r}: " + (
            "one model, nothing to vectorize)" if cfg.train.mode == "sync" else "the islands train at different times)"
        )
    if cfg.islands.devices > 1:
        return f"islands.devices must be 1 (got {cfg.islands.devices}: an island on several devices steps alone)"
    if cfg.train.round_seconds:
        return "train.round_seconds cannot be set (a time budget needs each island's own step time)"
    if cfg.islands.slowdown:
        return "islands.slowdown cannot be set (a slowed island needs its own step time)"
    if cfg.islands.device_step_s:
        return "islands.device_step_s cannot be set (a step's length is each island's own)"
    if cfg.workload.post_training(cfg.islands.island_names):
        return "every island must run workload.kind = \"lm\" (a post-training island's batches are its own kind's)"
    if cfg.workload.lora.enabled:
        return "workload.lora must be off (its frozen base is an argument of the islands' own step programs only)"
    return None


def require_federated(cfg: RunConfig, command: str) -> None:
    """The coordinator and island processes run rounds (plain or streaming) or asynchronous updates; the
    data-parallel baseline runs in `diloco simulate` only: refuse it in one line rather than run DiLoCo on it. So does
    train.vectorize (a process of theirs holds one island): refused rather than ignored, since a vectorized
    `simulate` does not end with a federation's digest bit for bit."""
    if cfg.train.mode == "sync":
        raise ConfigError(
            f"{command}: train.mode = 'sync' (the data-parallel baseline) runs in `diloco simulate` only; the "
            "coordinator and island processes run train.mode = 'diloco' or 'async'"
        )
    if cfg.train.vectorize:
        raise ConfigError(
            f"{command}: train.vectorize = true steps the islands of one process together and runs in `diloco "
            "simulate` only; the coordinator and island processes run one island each (set it to false)"
        )


# ---------------------------------------------------------------------------------------------------------------
# Generic loading: dict -> dataclass, with typo suggestions and type checks.


def _closest(key: str, options: typing.Iterable[str], prefix: str) -> str:
    match = difflib.get_close_matches(key, list(options), n=1, cutoff=0.5)
    return f" (did you mean '{prefix}{match[0]}'?)" if match else ""


def _check_type(value: Any, tp: Any, key: str) -> Any:
    """Coerce a TOML value to the field's type, or raise ConfigError naming the key."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if set(args) == {int, float}:  # a count or a fraction (quorum.min_islands): TOML's 2 and 0.5 say which
            return value if isinstance(value, float) else _check_type(value, int, key)
        return _check_type(value, args[0], key)
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{key} must be a list (got {type(value).__name__} {value!r})")
        (item_tp, _) = typing.get_args(tp)
        return tuple(_check_type(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value))
    if dataclasses.is_dataclass(tp):  # an entry of a list of tables ([[roster.events]])
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a table (got {value!r})")
        return from_dict(tp, value, f"{key}.")
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key} must be true or false (got {value!r})")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key} must be an integer (got {value!r})")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{key} must be a number (got {value!r})")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key} must be a string (got {value!r})")
        return value
    raise ConfigError(f"{key}: unsupported config type {tp}")


def _toml_key(f: dataclasses.Field) -> str:
    """A field's key in TOML and overrides: its name, or the `TOML_KEY` its metadata gives."""
    return f.metadata.get(TOML_KEY, f.name)


def from_dict(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    """Build dataclass `cls` from a nested dict; every error is one ConfigError line naming the key."""
    hints = typing.get_type_hints(cls)
    fields = {_toml_key(f): f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if key not in fields:
            raise ConfigError(f"unknown config key '{dotted}'{_closest(key, fields, prefix)}")
        name = fields[key].name
        tp = hints[name]
        if dataclasses.is_dataclass(tp):
            if not isinstance(value, dict):
                raise ConfigError(f"'{dotted}' must be a table/section (got {value!r})")
            kwargs[name] = from_dict(tp, value, f"{dotted}.")
        else:
            kwargs[name] = _check_type(value, tp, dotted)
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except ValueError as exc:  # a section's __post_init__ names its own key
        raise ConfigError(str(exc)) from None


def parse_override(text: str) -> tuple[list[str], Any]:
    """`outer.lr=0.5` -> (["outer", "lr"], 0.5). Values are TOML; a bare word is a string, and so is each bare word
    of a list (`islands.names=[a,b]`, as a shell leaves it without the quotes)."""
    if "=" not in text:
        raise ConfigError(f"override '{text}' must look like section.key=value")
    key, raw = text.split("=", 1)
    path = key.strip().split(".")
    if not all(path):
        raise ConfigError(f"override '{text}' has an empty key part")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = _bare_words(raw)
    return path, value


def _bare_words(raw: str) -> Any:
    """`[a, b]` -> ["a", "b"] when every item is a bare word (no quotes, brackets or '='); else `raw` as given."""
    inner = raw.strip()
    if not (inner.startswith("[") and inner.endswith("]")):
        return raw
    items = [item.strip() for item in inner[1:-1].split(",")] if inner[1:-1].strip() else []
    if all(item and not any(c in item for c in "\"'[]{}=") for item in items):
        return items
    return raw


def apply_overrides(data: dict[str, Any], overrides: typing.Sequence[str]) -> dict[str, Any]:
    """Return a copy of `data` with each dotted override set (validated later by from_dict)."""
    out = json.loads(json.dumps(data))
    for text in overrides:
        path, value = parse_override(text)
        node = out
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override '{text}': '{part}' is not a section")
            node = child
        node[path[-1]] = value
    return out


def load_config(path: str | Path | None, overrides: typing.Sequence[str] = ()) -> RunConfig:
    """Read a TOML config (or the defaults when path is None) and apply overrides."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file '{p}' does not exist")
        try:
            data = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file '{p}' is not valid TOML: {exc}") from None
        except UnicodeDecodeError:
            raise ConfigError(f"config file '{p}' is not UTF-8 text") from None
        _refuse_literal_secrets(data, p)
    return from_dict(RunConfig, with_checkpoint_model(apply_overrides(data, overrides)))


def with_checkpoint_model(data: dict[str, Any]) -> dict[str, Any]:
    """`data` with its [model] section completed from init.from's config.json where init.from is a Hugging Face
    directory, or a run that started from one (its RUN/hf/: `kept_checkpoint`; islands/models/hf/families.py:
    `merged_model`), and the checkpoint's tokenizer.json the run's tokenizer (data.tokenizer, islands/text.py
    `tokenizer_file`) unless the run names one or its data.kind = "tokens" carries its own; as it is otherwise."""
    init, model = data.get("init"), data.get("model", {})
    source = init.get("from") if isinstance(init, dict) else None
    if not isinstance(source, str) or not source or not isinstance(model, dict):
        return data
    directory = kept_checkpoint(Path(source).expanduser())
    if directory is None:
        return data
    completed = {**data, "model": merged_model(model, directory)}
    corpus = data.get("data")
    tokenizer = directory / "tokenizer.json"
    if isinstance(corpus, dict) and tokenizer.is_file():
        if corpus.get("kind") == "tokens":
            check_prepared_tokenizer(corpus, tokenizer)
        elif not corpus.get("tokenizer"):
            completed["data"] = {**corpus, "tokenizer": str(tokenizer)}
    return completed


def check_prepared_tokenizer(corpus: dict[str, Any], tokenizer: Path) -> None:
    """ConfigError naming the source when a prepared token directory of a data.kind = "tokens" corpus (data.path or
    a data.paths entry) was made by another tokenizer than `tokenizer`, the checkpoint's (islands/prepared.py
    `other_tokenizer`): the model would read another vocabulary's ids. A token file without meta.json records no
    tokenizer: its ids are checked against model.vocab_size when it is read."""
    paths = corpus.get("paths")
    specs = [("data.path", corpus.get("path")), *((f"data.paths[{i}]", p) for i, p in enumerate(paths or []))]
    for key, spec in specs:
        if not isinstance(spec, str) or not spec:
            continue
        _, meta_path = prepared.locate(spec)
        meta = prepared.read_meta(meta_path) if meta_path is not None else None
        why = prepared.other_tokenizer(meta, tokenizer) if isinstance(meta, dict) else None
        if why is not None:
            raise ConfigError(f"{key} '{spec}' was prepared by `diloco data prepare` ({meta_path}): {why}")


def _refuse_literal_secrets(data: dict[str, Any], path: Path) -> None:
    """A secret written in clear in a config file defeats the secret: the file is read by every island (each would
    hold every other island's secret), copied between machines and often committed. References only."""
    network = data.get("network")
    refs = network.get("secrets") if isinstance(network, dict) else None
    for i, ref in enumerate(refs if isinstance(refs, list) else []):
        if isinstance(ref, str) and not is_secret_reference(ref):
            what = "the placeholder of a redacted secret" if ref == REDACTED_SECRET else "a literal secret"
            raise ConfigError(
                f"network.secrets[{i}] in config file '{path}' is {what}; write env:VAR or file:PATH "
                "(a config file is shared with every island, so it must name where each secret lives, not hold it)"
            )


SECRET_FLAGS = ("--secret", "--operator-secret")
"""Command-line options whose value is a secret reference (or, discouraged, a literal secret)."""


def redact_argv(argv: typing.Sequence[str]) -> list[str]:
    """A command line safe to record (a lock file, a log): the value of `--secret` and of a `network.secrets=`
    override become references as written, literals replaced by `REDACTED_SECRET`."""
    out: list[str] = []
    for i, arg in enumerate(argv):
        flag, eq, value = arg.partition("=")
        if i and argv[i - 1] in SECRET_FLAGS:
            out.append(redact_secret(arg))
        elif eq and flag in SECRET_FLAGS:
            out.append(f"{flag}={redact_secret(value)}")
        elif eq and flag.strip() == "network.secrets":
            refs = parse_override(arg)[1]
            safe = [redact_secret(str(r)) for r in refs] if isinstance(refs, list) else REDACTED_SECRET
            out.append(f"network.secrets={json.dumps(safe)}")
        else:
            out.append(arg)
    return out


def with_network(cfg: RunConfig, **changes: Any) -> RunConfig:
    """`cfg` with some `[network]` keys replaced (the CLI's --tls-* flags), validated like a loaded config."""
    try:
        return dataclasses.replace(cfg, network=dataclasses.replace(cfg.network, **changes))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def literal_secrets(cfg: RunConfig) -> list[str]:
    """The dotted keys of literal secrets in a loaded config (only command-line overrides can put them there)."""
    return [f"network.secrets[{i}]" for i, ref in enumerate(cfg.network.secrets) if not is_secret_reference(ref)]


# ---------------------------------------------------------------------------------------------------------------
# Writing the resolved config back, and a digest that identifies a run.


def _shareable(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out: dict[str, Any] = {}
        for f in dataclasses.fields(value):
            if f.metadata.get("local"):
                continue
            item = _shareable(getattr(value, f.name))
            out[_toml_key(f)] = [redact_secret(ref) for ref in item] if f.metadata.get("secret_refs") else item
        return out
    if isinstance(value, list | tuple):
        return [_shareable(v) for v in value]
    if isinstance(value, dict):
        return {k: _shareable(v) for k, v in value.items()}
    return value


def to_dict(cfg: Any) -> dict[str, Any]:
    """A config as plain JSON data: the run's identity, safe to write or send anywhere.

    Everything that leaves the process goes through here (the run dir's config.toml, the config an island sends
    at join, the config digest), so this is where secrets are kept out: secret references stay as written
    (env:VAR, file:PATH), a literal secret becomes `REDACTED_SECRET`, and per-process keys (`LOCAL`: TLS files)
    are left out. The digest therefore covers references, not values: the coordinator and each island agree
    while each process holds only the secrets it needs.
    """
    return json.loads(json.dumps(_shareable(cfg)))


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} as TOML")


def dump_toml(data: dict[str, Any]) -> str:
    """Write a dict of sections (scalars and lists, and sub-sections such as workload.lora, each a table of its own:
    `[workload.lora]`) as TOML."""
    lines: list[str] = []
    for section, values in data.items():
        lines.append(f"[{section}]")
        lines.extend(f"{k} = {_toml_value(v)}" for k, v in values.items() if not isinstance(v, dict))
        lines.append("")
        tables = {f"{section}.{k}": v for k, v in values.items() if isinstance(v, dict)}
        if tables:
            lines.append(dump_toml(tables))
    return "\n".join(lines)


def config_digest(cfg: RunConfig) -> str:
    """Identifies a run's resolved config (what coordinator and islands must agree on): `to_dict`'s view, so secret
    references (never values) and no per-process key."""
    canonical = json.dumps(to_dict(cfg), sort_keys=True, separators=(",", ":"))
    return hashlib.blake2b(canonical.encode(), digest_size=16).hexdigest()


def diff_keys(a: dict[str, Any], b: dict[str, Any], prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two config dicts."""
    keys: list[str] = []
    for k in sorted(set(a) | set(b)):
        va, vb = a.get(k), b.get(k)
        if isinstance(va, dict) and isinstance(vb, dict):
            keys.extend(diff_keys(va, vb, f"{prefix}{k}."))
        elif va != vb:
            keys.append(f"{prefix}{k}")
    return keys
