"""tree_digest names θ by every leaf's path, dtype, shape and bytes, and by nothing else."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pytrees.digest import DIGEST_BYTES, tree_digest

pytestmark = pytest.mark.timeout(60)

BASE = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(4, np.float32)}


def _flip_one_bit(x: np.ndarray) -> np.ndarray:
    y = x.copy()
    y.reshape(-1).view(np.uint32)[0] ^= 1
    return y


@pytest.mark.parametrize(
    ("why", "other"),
    [
        ("one bit of one value", {**BASE, "a": _flip_one_bit(BASE["a"])}),
        ("a leaf's name", {"a": BASE["a"], "c": BASE["b"]}),
        ("a shape (same bytes)", {**BASE, "a": BASE["a"].reshape(3, 2)}),
        ("a dtype (same bytes)", {**BASE, "b": BASE["b"].view(np.int32)}),
        ("a leaf more", {**BASE, "z": np.zeros(0, np.float32)}),
    ],
)
def test_any_difference_changes_the_digest(why: str, other: dict) -> None:
    assert tree_digest(other) != tree_digest(BASE), why


def test_equal_trees_have_one_digest_wherever_the_bytes_lie() -> None:
    digest = tree_digest(BASE)
    assert len(digest) == 2 * DIGEST_BYTES and int(digest, 16) >= 0
    strided = {"a": np.asfortranarray(BASE["a"]), "b": np.stack([BASE["b"], BASE["b"]], 1)[:, 0]}  # not C-contiguous
    assert tree_digest(strided) == digest
    assert tree_digest({k: jnp.asarray(v) for k, v in BASE.items()}) == digest  # device arrays hash as host bytes
