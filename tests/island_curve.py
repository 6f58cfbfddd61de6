"""Child process for test_island: train one island and print its loss curve as JSON.

Run as `python tests/island_curve.py DEVICES:MICROBATCH:SHARD[:TENSOR[:KIND]] ...` (one variant per argument; TENSOR
is islands.tensor, default 1; KIND a model.kind of `MODELS`, default transformer) with XLA_FLAGS giving the process
enough CPU devices; prints one JSON list, and the parent compares the curves.
"""

from __future__ import annotations

import json
import sys

import jax
import numpy as np

from islands.config import InnerConfig
from islands.data import BatchStream, synthetic_tokens
from islands.inner import make_inner_optimizer
from islands.island import Island
from islands.models.config import ModelConfig
from islands.models.registry import build_model
from pytrees.naming import path_name

SHAPE = {"seq_len": 16, "d_model": 32, "n_layers": 1, "d_ff": 64, "vocab_size": 64}
MODELS = {
    "transformer": ModelConfig(**SHAPE, n_heads=2),
    "moe": ModelConfig(**SHAPE, kind="moe", n_heads=4, n_experts=4, top_k=2),
    "llama": ModelConfig(**SHAPE, kind="llama", n_heads=4, n_kv_heads=2, tie_embeddings=False),
    "llama_moe": ModelConfig(**SHAPE, kind="llama_moe", n_heads=4, n_kv_heads=2, n_experts=4, top_k=2),
}
"""One block of each family: GPT-2 (2 heads), its MoE (4 experts), Llama with grouped-query attention (4 query heads,
2 key/value heads, its own output head) and with routed experts."""


def curve(devices: int, microbatch: int, shard: bool, tensor: int = 1, kind: str = "transformer") -> dict:
    model = build_model(MODELS[kind])
    tokens = synthetic_tokens(20_000, 64, seed=0)
    stream = BatchStream(tokens, batch_size=8, seq_len=16, seed=0, stream_id=0)
    tx = make_inner_optimizer(InnerConfig(lr=1e-2, warmup_steps=2), total_steps=12)
    island = Island("t", model, tx, stream, n_devices=devices, microbatch=microbatch, shard_params=shard, tensor=tensor)
    init = model.init(jax.random.key(0))  # arrays on device 0, like the coordinator's global parameters
    island.start(init)
    run = island.train(12)
    island.set_params(init)
    island.train(1)
    leaves = jax.tree.leaves(island.state.params)
    return {
        "losses": run.losses.tolist(),
        "devices": len(island.mesh.devices.flat),
        "passes": island.passes,
        "param_sum": float(sum(np.abs(np.asarray(x)).sum() for x in leaves)),
        "sharded": any(not x.sharding.is_fully_replicated for x in leaves),
        "tensor_split": sorted(
            path_name(p)
            for p, x in jax.tree_util.tree_leaves_with_path(island.state.params)
            if "tensor" in x.sharding.spec
        ),
        # the train step donates its state: it must never have freed the caller's arrays
        "caller_params_intact": not any(x.is_deleted() for x in jax.tree.leaves(init)),
    }


def main() -> None:
    variants = [arg.split(":") for arg in sys.argv[1:]]
    print(
        json.dumps(
            [curve(int(d), int(m), bool(int(s)), *(int(t) for t in rest[:1]), *rest[1:]) for d, m, s, *rest in variants]
        )
    )


if __name__ == "__main__":
    main()
