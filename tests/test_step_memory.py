"""The memory plan at size (islands/step_memory.py): the pure function by a table of cases, its parameter count against
the model's own init, one tiny step against XLA's compiled figure, and `diloco plan`'s one-line refusal."""

from __future__ import annotations

from dataclasses import replace

import jax
import jax.numpy as jnp
import pytest

from diloco.bench.plan import CONFIGS, SHAPES
from diloco.cli import main
from diloco.config import load_config
from floor.codec import CodecSpec
from islands.config import InnerConfig
from islands.inner import make_inner_optimizer, make_train_step
from islands.memory import Footprint, OutOfMemoryError
from islands.mesh import Layout, batch_sharding, build_mesh
from islands.models.config import ModelConfig, ModelError
from islands.models.registry import build_model
from islands.models.registry import parameter_count as traced_count
from islands.step_memory import check, leaves, parameter_count, step_memory
from islands.workloads.config import LoraConfig

SMALL = ModelConfig(
    kind="llama", vocab_size=1024, seq_len=128, d_model=256, n_layers=4, n_heads=8, n_kv_heads=4, d_ff=768
)
"""Every width divisible by 8: FSDP and the tensor axis split every matrix."""


@pytest.mark.parametrize(
    "cfg",
    [
        SMALL,
        replace(SMALL, tie_embeddings=False, qkv_bias=True),
        replace(SMALL, qk_norm=True, head_dim=48, attn_bias=True),
    ],
)
def test_parameter_count_is_the_models(cfg: ModelConfig) -> None:
    assert parameter_count(cfg) == traced_count(cfg)


def test_the_llama_3_shapes_have_their_published_sizes() -> None:
    counts = [parameter_count(load_config(CONFIGS / f"{name}.toml").model) for name in SHAPES]
    assert counts == [1_235_814_400, 8_030_261_248, 70_553_706_496]


def _norms(cfg: ModelConfig) -> int:
    return 4 * sum(leaf.numel for leaf in leaves(cfg) if leaf.name.endswith("scale"))


@pytest.mark.parametrize(("data", "tensor"), [(2, 1), (8, 1), (1, 8), (4, 2), (2, 4)])
def test_parameter_bytes_scale_with_the_mesh(data: int, tensor: int) -> None:
    # FSDP x tensor split every matrix data * tensor ways; only the norms stay replicated over the tensor axis.
    cfg = replace(SMALL, n_kv_heads=8)
    whole = step_memory(cfg, 8, 1).parameters
    sharded = step_memory(cfg, 8 * data, 1, data, tensor, shard_params=True)
    assert sharded.parameters * data * tensor - whole == _norms(cfg) * (tensor - 1)
    assert sharded.optimizer == 2 * sharded.gradients == 2 * sharded.parameters


def test_kv_heads_that_the_tensor_axis_cannot_split_are_replicated() -> None:
    # 4 key/value heads over a tensor axis of 8: wk and wv whole on every device, the rest split 8 ways.
    whole, norms = step_memory(SMALL, 1).parameters, _norms(SMALL)
    wk = SMALL.d_model * SMALL.kv_heads * SMALL.head_size * 4
    kv = SMALL.n_layers * 2 * wk
    assert step_memory(SMALL, 1, 1, 1, 8).parameters == (whole - norms - kv) // 8 + norms + kv
    assert step_memory(SMALL, 1, 1, 1, 4).parameters == (whole - norms) // 4 + norms


def test_lora_keeps_optimizer_state_for_the_adapters_only() -> None:
    full = step_memory(SMALL, 8, 1)
    lora = step_memory(SMALL, 8, 1, lora=LoraConfig(rank=8, base_dtype="bfloat16"), uplink=CodecSpec(kind="int8"))
    # per block A [in, 8] and B [8, out] of wq (256 -> 256), wk and wv (256 -> 128), wo (256 -> 256); float32
    adapters = 4 * SMALL.n_layers * 8 * ((256 + 256) + 2 * (256 + 128) + (256 + 256))
    assert lora.trainable * 4 == adapters
    assert lora.optimizer == 2 * adapters and full.optimizer == 8 * parameter_count(SMALL)
    assert lora.parameters == 2 * parameter_count(SMALL) + adapters  # the base in bfloat16
    assert lora.host.residual == lora.host.global_copy == adapters  # only the adapters are pushed
    # Applied unmerged: the adapted matrices are read in the base's dtype; each other frozen leaf is cast to float32.
    attention = SMALL.n_layers * (2 * 256 * 256 + 2 * 256 * 128)
    assert lora.frozen_casts == 4 * (parameter_count(SMALL) - attention) and full.frozen_casts == 0
    assert step_memory(SMALL, 8, 1, lora=LoraConfig(rank=8)).frozen_casts == 0  # a float32 base is read as it is


def test_lora_dropout_keeps_each_adapted_inputs_dropped_copy_and_mask() -> None:
    """workload.lora.dropout: each adapted matrix of a block keeps its own dropped input (c bytes an entry) and its
    mask (1 byte), though wq, wk and wv read the same x; wo's input, the heads' output, splits over the tensor axis."""
    targets = ("wq", "wk", "wv", "wo")
    tokens, c = 1 * SMALL.seq_len, 4  # a pass of one sequence, float32 compute
    for tensor in (1, 2):
        plain = step_memory(SMALL, 8, 1, tensor=tensor, lora=LoraConfig(rank=8, targets=targets))
        dropping = step_memory(SMALL, 8, 1, tensor=tensor, lora=LoraConfig(rank=8, targets=targets, dropout=0.1))
        inputs = 3 * SMALL.d_model + SMALL.n_heads * SMALL.head_size // tensor  # wq, wk, wv's D; wo's Hq Dh
        extra = SMALL.n_layers * (c + 1) * inputs * tokens
        assert dropping.activations_full - plain.activations_full == extra
        assert dropping.activations_remat - plain.activations_remat == extra // SMALL.n_layers  # one block's


def test_remat_keeps_one_blocks_activations() -> None:
    plan = step_memory(replace(SMALL, remat=True), 8, 1)
    assert plan.activations == plan.activations_remat < plan.activations_full / 2
    assert step_memory(SMALL, 8, 1).activations == plan.activations_full
    # what a pass of more sequences saves grows with them
    assert step_memory(SMALL, 8, 2).activations_full > 1.9 * plan.activations_full


def test_kv_cache_and_uplink_buffers() -> None:
    plan = step_memory(SMALL, 8, 1, data=2, tensor=2, sample_rows=16, sample_length=128)
    assert plan.kv_cache == 2 * 4 * (16 // 2) * (4 // 2) * 128 * 32 * 4  # layers, rows, kv heads, length, Dh, f32
    fp32 = step_memory(SMALL, 8, 1).host
    assert fp32.residual == 0 and fp32.encoding == fp32.delta == 4 * parameter_count(SMALL)
    int8 = step_memory(SMALL, 8, 1, uplink=CodecSpec(kind="int8")).host
    assert int8.residual == fp32.delta and int8.encoding < fp32.delta / 3.9


def test_an_island_split_across_processes_splits_its_uplink_buffers() -> None:
    """With FSDP across 4 processes, each process holds a quarter of Δ and of the residual; the leader the global copy
    and the whole push's encoding, a follower its quarter of both. Without FSDP the processes change nothing."""
    int8 = CodecSpec(kind="int8")
    one = step_memory(SMALL, 8, 1, data=8, shard_params=True, uplink=int8)
    four = step_memory(SMALL, 8, 1, data=8, shard_params=True, uplink=int8, processes=4)
    assert one.follower_host is None and four.follower_host is not None
    p = parameter_count(SMALL)
    assert (four.host.delta, four.host.residual, four.host.global_copy) == (p, p, 4 * p)
    assert four.host.encoding == one.host.encoding
    follower = four.follower_host
    assert (follower.delta, follower.residual, follower.global_copy) == (p, p, p)
    assert follower.encoding == one.host.encoding // 4
    replicated = step_memory(SMALL, 8, 1, data=8, uplink=int8, processes=4)
    assert replicated.host == one.host and replicated.follower_host is None


def test_plan_within_1_5x_of_xla() -> None:
    """One tiny step compiled on this process's first device: the plan's state and step against XLA's figure."""
    cfg = ModelConfig(kind="llama", vocab_size=512, seq_len=64, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2)
    model, tx, layout = build_model(cfg), make_inner_optimizer(InnerConfig(), 10), Layout(build_mesh(1))
    params = jax.eval_shape(model.init, jax.random.key(0))
    opt = jax.eval_shape(tx.init, params)
    batch = jax.ShapeDtypeStruct((1, 8, 65), jnp.int32, sharding=batch_sharding(layout.mesh))
    footprint = Footprint.of(
        make_train_step(model.loss, tx, layout).lower(layout.shapes(params), layout.shapes(opt), batch).compile()
    )
    assert footprint is not None
    plan = step_memory(cfg, 8)
    ratio = (plan.state + plan.step) / footprint.total
    assert 1 / 1.5 <= ratio <= 1.5


def test_what_does_not_fit_is_refused_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    config = str(CONFIGS / "llama-3.1-70b.toml")
    assert main(["plan", config, "islands.devices=64", "islands.tensor=8", "model.remat=true"]) == 0
    assert main(["plan", config]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "largest: activations" in err[0] and "turn on model.remat" in err[0]
    with pytest.raises(OutOfMemoryError, match=r"265 MB on each device, 1.00 MB there \(largest: activations"):
        check(step_memory(SMALL, 8, 8), 0.001, ["lower train.microbatch"])


def test_mistakes_are_one_line() -> None:
    with pytest.raises(ModelError, match="names 'wqkv', which this model has no block matrix of"):
        step_memory(SMALL, 8, lora=LoraConfig(rank=4, targets=("wqkv",)))
    with pytest.raises(ModelError, match="model.kind = llama"):
        step_memory(ModelConfig(), 8)
    assert main(["plan", str(CONFIGS / "llama-3.2-1b.toml"), "islands.tensor=3"]) == 2
