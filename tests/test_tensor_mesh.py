"""The two-axis island mesh (islands/mesh.py): where each leaf lives by its logical axes, and a data x tensor mesh
that trains every family to the curve of one device."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

from diloco.config import load_config
from islands.mesh import DATA, TENSOR, Layout, MeshError, build_mesh, leaf_spec
from islands.models.axes import logical_axes
from islands.models.config import ModelConfig
from islands.models.registry import build_model
from pytrees.naming import path_name
from tests.island_curve import MODELS
from tests.test_island import _curves, _result

UNITS = {"heads": 4, "kv_heads": 2, "qkv": 12, "experts": 4}
"""A block of 4 query heads of width 8, 2 key/value heads, 4 experts."""

CASES = [
    # (leaf, shape, data, tensor, shard_params) -> spec
    ("blocks/0/attn/wq", (32, 32), 1, 2, False, P(None, TENSOR)),  # column split: 2 heads a device
    ("blocks/0/attn/wo", (32, 32), 1, 2, False, P(TENSOR, None)),  # row split: the partial sums all-reduced
    ("blocks/0/attn/wk", (32, 16), 1, 2, False, P(None, TENSOR)),  # 2 kv heads over 2: one each
    ("blocks/0/attn/wk", (32, 16), 1, 4, False, P()),  # 2 kv heads over 4: kept whole (MaxText's rule)
    ("blocks/0/attn/wk", (32, 16), 2, 4, True, P(DATA, None)),  # ... and FSDP still splits it
    ("blocks/0/attn/wq", (32, 32), 2, 2, True, P(DATA, TENSOR)),  # FSDP on the other dimension
    ("blocks/0/attn/wqkv", (32, 96), 1, 4, False, P(None, TENSOR)),  # 12 fused heads over 4
    ("blocks/0/ff/w_gate", (32, 64), 1, 4, False, P(None, TENSOR)),
    ("blocks/0/ff/w_down", (64, 32), 1, 4, False, P(TENSOR, None)),
    ("blocks/0/ff/w_up", (4, 32, 64), 1, 4, False, P(TENSOR, None, None)),  # an expert stack: by expert
    ("blocks/0/ff/w_up", (4, 32, 64), 1, 8, False, P(None, None, TENSOR)),  # 4 experts over 8: by hidden width
    ("blocks/0/ff/b1", (4, 64), 1, 4, False, P(TENSOR, None)),
    ("blocks/0/ff/router", (32, 4), 1, 4, False, P()),
    ("embed/tok", (64, 32), 1, 2, False, P(TENSOR, None)),  # the vocabulary
    ("lm_head", (32, 64), 2, 2, True, P(DATA, TENSOR)),
    ("blocks/0/ln1/scale", (32,), 1, 4, False, P()),  # the residual stream's width is never tensor-split
    ("blocks/0/ln1/scale", (32,), 4, 1, True, P(DATA)),
    ("0/mu/blocks/0/attn/wq", (32, 32), 1, 2, False, P(None, TENSOR)),  # an optimizer moment: as its parameter
    ("0/count", (), 2, 2, True, P()),
    ("blocks/0/attn/wo/lora_a", (32, 8), 1, 2, False, P(TENSOR, None)),  # LoRA's A: as wo's input, by head
    ("blocks/0/attn/wq/lora_b", (8, 32), 1, 2, False, P(None, TENSOR)),  # LoRA's B: as wq's output
    ("blocks/0/ff/w_up/lora_a", (32, 8), 2, 2, True, P(DATA, None)),
    # One axis (tensor 1): today's FSDP rule, the largest dimension the data axis divides.
    ("blocks/0/attn/wq", (32, 32), 4, 1, True, P(DATA, None)),
    ("blocks/0/ff/w_gate", (32, 64), 4, 1, True, P(None, DATA)),
    ("blocks/0/ff/w_gate", (32, 64), 4, 1, False, P()),
    ("user/leaf", (6, 8), 2, 1, True, P(None, DATA)),
]


@pytest.mark.parametrize(("name", "shape", "data", "tensor", "shard", "spec"), CASES)
def test_leaf_spec(name: str, shape: tuple[int, ...], data: int, tensor: int, shard: bool, spec: P) -> None:
    assert leaf_spec(shape, logical_axes(name, len(shape)), data, tensor, shard, UNITS) == spec


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_every_leaf_of_every_family_has_logical_axes(kind: str) -> None:
    """A leaf a family adds without a rule would be kept whole on every device of the tensor axis: caught here."""
    cfg: ModelConfig = MODELS[kind]
    params = jax.eval_shape(build_model(cfg).init, jax.random.key(0))
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        axes = logical_axes(path_name(path), leaf.ndim)
        assert axes is not None and len(axes) == leaf.ndim, (kind, path_name(path), leaf.shape)


def test_a_tensor_split_needs_named_leaves() -> None:
    """A user model's leaves name no axes: one line at the island's start, not a model kept whole on every device."""
    user = {"user": {"w": np.zeros((4, 4))}, "embed": {"tok": np.zeros((8, 4))}}
    Layout(build_mesh(1)).check(user)  # tensor 1: FSDP alone needs no names
    with pytest.raises(MeshError, match="islands.tensor = 2 .* leaf 'user/w' has none") as err:
        Layout(AbstractMesh((1, 2), (DATA, TENSOR))).check(user)
    assert "\n" not in str(err.value)
    with pytest.raises(MeshError, match="islands.tensor \\(2\\) must divide the island's 3 device"):
        build_mesh(3, [jax.devices()[0]] * 3, tensor=2)


def test_islands_tensor_must_divide_the_devices(tmp_path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("[islands]\ndevices = 4\ntensor = 3\n")
    with pytest.raises(ValueError, match=r"islands.tensor \(3\) must be >= 1 and divide islands.devices \(4\)"):
        load_config(path)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_axis_mesh_gives_the_one_axis_curve() -> None:
    """Every family on 2 x 2 (4 devices, tensor 2) and Llama's two on 2 x 4 (8 devices, tensor 4; one with FSDP on
    the data axis too) train to the curve of one device: the same losses and parameters within float32 reduction-
    order noise (the tensor axis's partial sums are added in another order)."""
    kinds = sorted(MODELS)
    variants = [f"1:0:0:1:{k}" for k in kinds] + [f"4:0:0:2:{k}" for k in kinds]
    wide = ["8:0:0:4:llama_moe", "8:0:1:4:llama"]
    curves = _result(_curves(8, *variants, *wide))
    one = dict(zip(kinds, curves[: len(kinds)], strict=True))
    two_by_two = dict(zip(kinds, curves[len(kinds) : 2 * len(kinds)], strict=True))
    two_by_four = dict(zip(["llama_moe", "llama"], curves[2 * len(kinds) :], strict=True))
    for kind, other in [*two_by_two.items(), *two_by_four.items()]:
        assert other["tensor_split"], (kind, other)  # something is split along the tensor axis
        assert one[kind]["losses"][-1] < one[kind]["losses"][0] - 0.3, kind  # it learns
        np.testing.assert_allclose(other["losses"], one[kind]["losses"], rtol=2e-5, atol=2e-5, err_msg=kind)
        assert other["param_sum"] == pytest.approx(one[kind]["param_sum"], rel=1e-5), kind
    assert "blocks/0/attn/wk" in two_by_two["llama"]["tensor_split"]  # 2 kv heads over 2
    assert "blocks/0/attn/wk" not in two_by_four["llama"]["tensor_split"]  # ... not over 4
    assert two_by_four["llama"]["sharded"] and two_by_four["llama"]["devices"] == 8
