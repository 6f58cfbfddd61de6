"""The memory plan at size: what one island's training step holds on each device of its mesh, from the model's shape
alone (its init traced abstractly, nothing allocated or compiled), so that a 70B Llama on 64 accelerators can be sized
on a laptop.

`islands/memory.py` sizes a step from what XLA compiled for this host; this is the same question asked before there
is a host that could compile it. A Llama-family `ModelConfig` (islands/models/llama.py's layout), the island's batch,
its mesh of `data` x `tensor` devices, FSDP (`shard_params`), an optional LoRA and the uplink codec give a breakdown in
bytes per device (`StepMemory`):

    parameters      every leaf in float32 (the master weights); under LoRA the frozen base in its dtype plus the
                    adapters A [in, r] and B [r, out] (float32) of each targeted matrix in every block
    gradients       float32, one per trainable scalar, laid out as the parameters
    optimizer       AdamW's two float32 moments per trainable scalar (under LoRA the adapters' only)
    update          the optimizer's update, one float32 tree of the trainable parameters, before it is applied
    weight copies   what the backward pass keeps of the weights beyond the arguments: each matrix cast to the compute
                    dtype (`transformer.dense`: none in float32) and, with FSDP, gathered over the data axis; every
                    block's without remat, one block's with it (the one being recomputed)
    frozen casts    under LoRA, the float32 copies a step makes of the frozen base's leaves other than the adapted
                    matrices where the base is bfloat16 (islands/models/lora.py, `Lora.adapted`); the adapted
                    matrices are applied unmerged, in the base's dtype, so no W + (α / r)·A·B is made
    activations     what autodiff saves for the backward pass (below), model.remat on or off (both are reported)
    logits          the loss's float32 [b, T, V] four times at its backward: the logits, their log-softmax (saved),
                    its gradient and the logits' gradient (plus the compute-dtype logits under bfloat16)
    batch           int32 [passes, b, T + 1] tokens
    kv cache        generation (islands/sampling.py, `KVCache`): 2 x n_layers x rows x Hkv x length x Dh in the compute
                    dtype, rows over the data axis, key/value heads over the tensor axis; a phase of its own

Activations. Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", arXiv
2205.05198, section 4.1) count a GPT block's saved tensors as 34 s b h + 5 a s^2 b bytes in half precision; this
code's block saves what `jax.ad_checkpoint.print_saved_residuals` lists for `transformer.block` over llama.py's
functions, per token of a pass (b sequences of T tokens on a device), c the compute dtype's bytes:

    each RMSNorm    its input's square, the normalised x and the input in float32, its output in c: (12 + c) D
    attention       the rotated queries and keys, the values and the heads' output: c (2 Hq Dh + 2 Hkv Dh)
    scores          per query head and key position: the causal mask (1), the masked scores (4) and their exponent
                    (4) in float32, the softmax weights (c): (9 + c) Hq T; the T x T scores are materialised (no fused
                    attention kernel), so at long contexts they dominate
    SwiGLU          gate and up projections, three of silu's intermediates, their product: 6 c F
    LoRA            each adapted matrix's x·A: c r; with workload.lora.dropout, each one's dropped input and its
                    mask (its own, though wq, wk and wv read one x): (c + 1) per entry of the input (D, Hq Dh or F)

so a block saves A = 2 (12 + c) D + c (2 Hq Dh + 2 Hkv Dh) + 6 c F + (9 + c) Hq T bytes per token (plus LoRA's), and
L blocks L A b T, against Korthikanti's 34 h (their dropout masks and LayerNorm are not here; the float32 statistics
and SwiGLU's third matrix are). With remat (`jax.checkpoint`, nothing saveable: transformer.forward) a block keeps its
input, c D per token (Korthikanti's full recomputation, 2 s b h), and the backward pass holds one block's A at a time
while it recomputes it: L c D b T + A b T. XLA may fuse some of the saved elementwise values away, so the count
is an upper bound of what the backward holds (BENCHMARKS.md, "The memory plan at size", has it against XLA).

Each leaf lies on the mesh as the island lays it out (islands/mesh.py, `leaf_spec`, by its logical axes): the tensor
axis takes the attention heads (wq's columns, wo's rows; when n_heads % tensor == 0), the key/value heads (wk, wv;
when n_kv_heads % tensor == 0, else they are replicated), the MLP's hidden width (w_gate, w_up columns, w_down rows),
the vocabulary (embed rows, lm_head columns); norms are replicated. FSDP (`shard_params`) splits each leaf along its
largest dimension divisible by the data axis among those the tensor axis does not take. Activations split over the
data axis by their sequences; over the tensor axis, the terms in heads, F and V split where their weights do
(`tensor_share`), those in D are replicated (no sequence parallelism).

The uplink's buffers are the host's, not the device's (pytrees/feedback.py works on numpy arrays), so they are
reported per island apart from the device (`HostMemory`): the pushed tree's float32 pseudo-gradient Δ and its
encoding (floor/codec.py's layout), the error-feedback residual (a float32 copy of the pushed tree, where the codec
is lossy) and the island's copy of the global θ that Δ is taken from (diloco/worker/global_copy.py). Under LoRA the
pushed tree is the adapters. An island of several processes whose parameters are split across them
(`islands.processes` with `shard_params`; docs/architecture.md, "Pieces") holds Δ and the residual by process, each
its own 1 / processes; its leader holds the global copy whole and the push's every encoded piece, and each follower
its own share of the encoding and its regions of the push's reference (`follower_host`). Leaves replicated across
the processes (norms) and leaves whose codec blocks cross their shards are counted as split: they are a small share.

What the plan leaves out: XLA's code and the runtime's own (the allocator's slack, a few hundred MB on a GPU), the
communication buffers of the collectives, and an evaluation (smaller than a step: no gradients). At its peak a
device holds the state (parameters, optimizer) and the larger of a step and a generation.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from math import prod

import jax

from floor.codec import CodecSpec, index_bits, raw_payload_nbytes, sparse_payload_nbytes
from islands.memory import GB, OutOfMemoryError, format_bytes
from islands.mesh import DATA, TENSOR, accumulation_steps, leaf_spec
from islands.models.axes import Axes, axis_units, logical_axes
from islands.models.config import LORA_MODULES, ModelConfig, ModelError
from islands.models.lora import target_names
from islands.models.registry import build_model
from islands.workloads.config import LoraConfig
from pytrees.naming import path_name

DTYPE_BYTES = {"float32": 4, "bfloat16": 2}

LOGITS_COPIES = 4
"""Float32 [b, T, V] arrays live at the loss's backward (module docstring, "logits")."""


@dataclass(frozen=True)
class Leaf:
    """One parameter: its name, shape, logical axes (islands/models/axes.py), bytes per scalar and whether it is
    trained."""

    name: str
    shape: tuple[int, ...]
    axes: Axes | None
    itemsize: int = 4
    trained: bool = True

    @property
    def numel(self) -> int:
        return prod(self.shape)

    def per_device(self, data: int, tensor: int, shard_params: bool, units: Mapping[str, int]) -> int:
        """Scalars of this leaf on one device of a data x tensor mesh, laid out as the island lays it out
        (islands/mesh.py, `leaf_spec`)."""
        spec = tuple(leaf_spec(self.shape, self.axes, data, tensor, shard_params, dict(units)))
        width = {DATA: data, TENSOR: tensor, None: 1}
        return prod(n // width[axis] for n, axis in zip(self.shape, spec + (None,) * len(self.shape), strict=False))


def leaves(cfg: ModelConfig, lora: LoraConfig | None = None) -> list[Leaf]:
    """The model's parameters as its own init makes them (`jax.eval_shape`: shapes only, nothing allocated), each
    with its logical axes; under `lora` the base frozen in its dtype and, for each targeted matrix, the adapters A
    [in, r] (split where the matrix's input is) and B [r, out] (where its output is)."""
    base = 4 if lora is None else DTYPE_BYTES[lora.base_dtype]
    init = jax.eval_shape(build_model(cfg).init, jax.random.key(0))
    shapes = {path_name(p): tuple(x.shape) for p, x in jax.tree_util.tree_leaves_with_path(init)}
    adapted = set() if lora is None else set(target_names(shapes, lora.targets))
    out = []
    for name, shape in shapes.items():
        axes = logical_axes(name, len(shape))
        out.append(Leaf(name, tuple(shape), axes, base, lora is None))
        if lora is not None and name in adapted:
            (d_in, d_out), (a_in, a_out) = shape, axes or (None, None)
            out.append(Leaf(f"{name}/lora_a", (d_in, lora.rank), (a_in, None)))
            out.append(Leaf(f"{name}/lora_b", (lora.rank, d_out), (None, a_out)))
    return out


def parameter_count(cfg: ModelConfig) -> int:
    """The model's scalars (LoRA adapters aside), from its shape."""
    return sum(leaf.numel for leaf in leaves(cfg))


@dataclass(frozen=True)
class HostMemory:
    """Bytes an island keeps on its (lead) host for the uplink, beside its devices (module docstring)."""

    delta: int
    """The pseudo-gradient Δ, float32, of the pushed tree."""
    encoding: int
    """Δ's encoding for the wire."""
    residual: int
    """The error-feedback residual (0 for a lossless codec)."""
    global_copy: int
    """The island's copy of the global θ (of the pushed tree) that Δ is taken from."""

    @property
    def total(self) -> int:
        return self.delta + self.encoding + self.residual + self.global_copy


@dataclass(frozen=True)
class StepMemory:
    """One island's step on one device of its mesh, in bytes per part (module docstring); `host` the uplink's."""

    parameters: int
    gradients: int
    optimizer: int
    update: int
    weight_copies: int
    frozen_casts: int
    """Under LoRA: the float32 copies of the frozen leaves that are not adapted, for a bfloat16 base; 0 without."""
    activations: int
    """With the plan's remat setting: `activations_remat` or `activations_full`."""
    activations_full: int
    activations_remat: int
    logits: int
    batch: int
    kv_cache: int
    host: HostMemory
    """The island's host (its leader's, on an island of several processes)."""
    remat: bool
    trainable: int
    """Trained scalars of the whole model (all of them, or LoRA's adapters)."""
    total_params: int
    passes: int
    rows: int
    """Sequences per device per pass."""
    follower_host: HostMemory | None = None
    """A follower process's host on an island split across its processes; None for one process."""

    @property
    def state(self) -> int:
        """What the device holds from step to step: the parameters and the optimizer state."""
        return self.parameters + self.optimizer

    @property
    def step(self) -> int:
        """A train step's transient bytes beyond the state."""
        parts = (self.gradients, self.update, self.weight_copies, self.frozen_casts, self.activations, self.logits)
        return sum(parts) + self.batch

    @property
    def total(self) -> int:
        """The device's peak: its state and the larger of a step and a generation."""
        return self.state + max(self.step, self.kv_cache)

    def parts(self) -> dict[str, int]:
        """The parts that add up to `total`, by name (the generation's only where it is the larger phase)."""
        parts = {
            "parameters": self.parameters,
            "optimizer": self.optimizer,
        }
        if self.kv_cache > self.step:
            return parts | {"kv cache": self.kv_cache}
        return parts | {
            "gradients": self.gradients,
            "update": self.update,
            "weight copies": self.weight_copies,
            "frozen casts": self.frozen_casts,
            "activations": self.activations,
            "logits": self.logits,
            "batch": self.batch,
        }


def summary(plan: StepMemory, device_bytes: int) -> dict[str, object]:
    """The plan as `diloco plan` prints it: GB per device by part, the peak against the device, the host's share."""

    def gb(n: int) -> float:
        return round(n / GB, 3)

    return {
        "per_device_gb": gb(plan.total),
        "device_gb": gb(device_bytes),
        "fits": plan.total <= device_bytes,
        "parts_gb": {name: gb(n) for name, n in plan.parts().items()},
        "activations_gb": {"remat": gb(plan.activations_remat), "no_remat": gb(plan.activations_full)},
        "kv_cache_gb": gb(plan.kv_cache),
        "host_per_island_gb": {
            "delta": gb(plan.host.delta),
            "encoding": gb(plan.host.encoding),
            "residual": gb(plan.host.residual),
            "global_copy": gb(plan.host.global_copy),
        },
        **(
            {}
            if plan.follower_host is None
            else {"follower_host_gb": {k: gb(v) for k, v in asdict(plan.follower_host).items()}}
        ),
        "parameters": plan.total_params,
        "trained": plan.trainable,
        "passes": plan.passes,
        "sequences_per_device_per_pass": plan.rows,
    }


def rows_per_pass(batch_size: int, microbatch: int, data: int) -> tuple[int, int]:
    """(passes, sequences per device per pass): islands/mesh.py's `accumulation_steps` over the data axis."""
    passes = accumulation_steps(batch_size, microbatch, data)
    return passes, batch_size // passes // data


def tensor_share(axis: str, width: int, tensor: int, units: Mapping[str, int]) -> int:
    """What one device of the tensor axis holds of a width of logical `axis`: the whole width where the mesh's rules
    keep it whole (islands/mesh.py, `leaf_spec`), else its share."""
    return width // tensor if any(leaf_spec((width,), (axis,), 1, tensor, False, dict(units))) else width


def block_activations(
    cfg: ModelConfig, tensor: int, lora: LoraConfig | None = None, adapted: int = 0, inputs: int = 0
) -> int:
    """Bytes one block saves for the backward pass per token of a pass (A in the module docstring), per device;
    `adapted`: the block's matrices LoRA adapts (each saves x @ A); `inputs`: their inputs' widths on a device,
    summed (under workload.lora.dropout each saves its dropped input and its mask)."""
    c = DTYPE_BYTES[cfg.compute_dtype]
    units, dh = dict(axis_units(cfg)), cfg.head_size
    q = tensor_share("heads", cfg.n_heads * dh, tensor, units)
    kv = tensor_share("kv_heads", cfg.kv_heads * dh, tensor, units)
    norms = 2 * (12 + c) * cfg.d_model
    attention = c * (2 * q + 2 * kv)
    scores = (9 + c) * (q // dh) * cfg.seq_len
    mlp = 6 * c * tensor_share("mlp", cfg.d_ff, tensor, units)
    adapters = c * lora.rank * adapted if lora is not None else 0
    dropped = (c + 1) * inputs if lora is not None and lora.dropout > 0 else 0
    return norms + attention + scores + mlp + adapters + dropped


def codec_bytes(spec: CodecSpec, numel: int) -> int:
    """The encoding of `numel` float32 values (floor/codec.py's layout; sparse from its cost model), before zstd."""
    if spec.kind != "sparse":
        return raw_payload_nbytes(spec.kind, numel, spec.block_size)
    chunk = spec.block_size
    chunks = -(-numel // chunk)
    kept = max(1, int(spec.density * chunk + 0.5)) * chunks
    return sparse_payload_nbytes(chunks, kept, index_bits(chunk), spec.sparse_bits)


def step_memory(
    cfg: ModelConfig,
    batch_size: int,
    microbatch: int = 0,
    data: int = 1,
    tensor: int = 1,
    shard_params: bool = False,
    lora: LoraConfig | None = None,
    uplink: CodecSpec | None = None,
    sample_rows: int = 0,
    sample_length: int = 0,
    processes: int = 1,
) -> StepMemory:
    """The memory plan of one island's train step on each device of a data x tensor mesh (module docstring).

    batch_size: the island's sequences per step (train.batch_size), of cfg.seq_len tokens; microbatch: sequences per
    device per pass (train.microbatch; 0: the whole batch in one pass); cfg.remat and cfg.compute_dtype as the model
    runs them; uplink: the codec of the pushes (None: fp32); sample_rows x sample_length: a generation's KV cache (0:
    none); processes: the island's processes (islands.processes), which split the uplink's host buffers with FSDP."""
    if cfg.kind != "llama":
        raise ModelError(f"the memory plan at size knows the dense Llama family (model.kind = llama), not {cfg.kind}")
    if data < 1 or tensor < 1:
        raise ModelError(f"the mesh must be at least 1 x 1 devices (got {data} x {tensor})")
    passes, rows = rows_per_pass(batch_size, microbatch, data)
    c = DTYPE_BYTES[cfg.compute_dtype]
    params, units = leaves(cfg, lora), axis_units(cfg)
    on_device = {leaf.name: leaf.per_device(data, tensor, shard_params, units) for leaf in params}
    parameters = sum(on_device[leaf.name] * leaf.itemsize for leaf in params)
    trained = sum(on_device[leaf.name] for leaf in params if leaf.trained) * 4
    matrices = [leaf for leaf in params if leaf.name.startswith("blocks/") and leaf.name.split("/")[-1] in LORA_MODULES]
    adapters = [leaf for leaf in params if leaf.name.endswith("/lora_a")]
    # LoRA applies the adapters unmerged (islands/models/lora.py, `Lora.adapted`): the adapted matrices stay in the
    # base's dtype (`transformer.dense` casts them as it casts any weight); every other frozen leaf is cast to float32.
    frozen_casts = (
        0
        if lora is None
        else 4
        * sum(
            on_device[leaf.name]
            for leaf in params
            if not leaf.trained and leaf.itemsize != 4 and f"{leaf.name}/lora_a" not in on_device
        )
    )
    fsdp = shard_params and data > 1

    def copies(of: Sequence[Leaf]) -> int:
        """The weights the backward keeps beyond the arguments: gathered over the data axis (FSDP) in c, or cast
        to c where their dtype is not c."""
        if fsdp:
            return sum(leaf.per_device(1, tensor, False, units) * c for leaf in of)
        return sum(on_device[leaf.name] * c for leaf in of if leaf.itemsize != c)

    per_block = [leaf for leaf in matrices if leaf.name.startswith("blocks/0/")]
    tokens = rows * cfg.seq_len
    first = [leaf for leaf in adapters if leaf.name.startswith("blocks/0/")]
    # A [in, r] lies as its matrix's input does (`leaves`): its share of a device of the tensor axis, over r, is the
    # input's width there.
    inputs = sum(leaf.per_device(1, tensor, False, units) // leaf.shape[1] for leaf in first)
    a = block_activations(cfg, tensor, lora, len(first), inputs)
    outside = (12 + c) * cfg.d_model * tokens  # the final norm
    full = cfg.n_layers * a * tokens + outside
    remat = cfg.n_layers * c * cfg.d_model * tokens + a * tokens + outside
    v = tensor_share("vocab", cfg.vocab_size, tensor, units)
    logits = LOGITS_COPIES * 4 * v * tokens + (c * v * tokens if c != 4 else 0)
    head = [leaf for leaf in params if leaf.name in ("lm_head", "embed/tok")]
    head = [leaf for leaf in head if leaf.name == "lm_head"] or head  # the output projection
    weight_copies = copies(head) + copies(per_block) * (1 if cfg.remat else cfg.n_layers)
    hkv = tensor_share("kv_heads", cfg.kv_heads * cfg.head_size, tensor, units) // cfg.head_size
    cache_rows = -(-sample_rows // data)
    kv_cache = 2 * cfg.n_layers * cache_rows * hkv * sample_length * cfg.head_size * c
    pushed = sum(leaf.numel for leaf in params if leaf.trained)
    spec = uplink or CodecSpec(kind="fp32")
    lossy = spec.kind != "fp32"
    split = processes if shard_params and processes > 1 else 1
    encoding = codec_bytes(spec, pushed)
    host = HostMemory(
        delta=4 * pushed // split,
        encoding=encoding,
        residual=4 * pushed // split if lossy else 0,
        global_copy=4 * pushed,
    )
    follower = HostMemory(
        delta=host.delta, encoding=encoding // split, residual=host.residual, global_copy=4 * pushed // split
    )
    return StepMemory(
        parameters=parameters,
        gradients=trained,
        optimizer=2 * trained,
        update=trained,
        weight_copies=weight_copies,
        frozen_casts=frozen_casts,
        activations=remat if cfg.remat else full,
        activations_full=full,
        activations_remat=remat,
        logits=logits,
        batch=4 * passes * rows * (cfg.seq_len + 1),
        kv_cache=kv_cache,
        host=host,
        follower_host=follower if split > 1 else None,
        remat=cfg.remat,
        trainable=pushed,
        total_params=sum(leaf.numel for leaf in params if "lora_" not in leaf.name),
        passes=passes,
        rows=rows,
    )


def advice(
    plan: StepMemory, data: int, tensor: int, shard_params: bool, microbatch: int, lora: LoraConfig | None
) -> list[str]:
    """The settings that shrink the plan's largest parts, largest first."""
    knobs: list[str] = []
    ranked = sorted(plan.parts().items(), key=lambda kv: -kv[1])
    for part, _ in ranked[:3]:
        if part in ("parameters", "gradients", "optimizer", "update", "weight copies", "frozen casts"):
            if not shard_params and data > 1:
                knobs.append("set islands.shard_params (FSDP over the data axis)")
            knobs.append(f"raise islands.tensor ({tensor})")
            if lora is None and part != "parameters":
                knobs.append("train a LoRA (workload.lora: only the adapters get gradients and optimizer state)")
            if part == "weight copies" and not plan.remat:
                knobs.append("turn on model.remat")
        elif part in ("activations", "logits"):
            if not plan.remat and part == "activations":
                knobs.append("turn on model.remat")
            if plan.rows > 1:
                knobs.append(f"lower train.microbatch ({microbatch or plan.rows})")
            knobs.append(f"raise islands.tensor ({tensor})")
            knobs.append("shorten model.seq_len")
        elif part == "kv cache":
            knobs.append("sample fewer rows or shorter completions")
    return list(dict.fromkeys(knobs))


def refusal(plan: StepMemory, device_bytes: int, knobs: Sequence[str]) -> str | None:
    """The one-line refusal when the plan's per-device peak exceeds `device_bytes`, else None."""
    if plan.total <= device_bytes:
        return None
    ranked = sorted(plan.parts().items(), key=lambda kv: -kv[1])
    largest = ", ".join(f"{name} {format_bytes(n)}" for name, n in ranked[:3])
    tail = ", ".join(knobs[:-1]) + f" or {knobs[-1]}" if len(knobs) > 1 else "".join(knobs)
    return (
        f"this step needs about {format_bytes(plan.total)} on each device, {format_bytes(device_bytes)} there "
        f"(largest: {largest}); {tail}"
    )


def check(plan: StepMemory, device_gb: float, knobs: Sequence[str]) -> StepMemory:
    """Raise OutOfMemoryError (one line, exit code 2) when the plan does not fit a device of `device_gb` GB."""
    message = refusal(plan, int(device_gb * GB), knobs)
    if message is not None:
        raise OutOfMemoryError(message)
    return plan
