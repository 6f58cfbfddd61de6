"""Child process for test_gpt2_config: train one island of configs/gpt2-small.toml at reduced width, print JSON.

Run as `python tests/gpt2_curve.py '["key=value", ...]' ...` (one JSON list of overrides per variant, applied after
REDUCED) with XLA_FLAGS giving the process enough CPU devices. The island is built the way every driver builds one
(`build_setup`, `make_island`), so the config's own knobs (compute_dtype, remat, shard_params, microbatch, devices)
are what runs.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import jax
import numpy as np

from diloco.config import load_config
from diloco.run.setup import build_setup, make_island

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "gpt2-small.toml"

REDUCED = [
    "model.d_model=64",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.d_ff=256",
    "model.seq_len=32",
    "model.vocab_size=512",
    "train.batch_size=8",
    "train.microbatch=1",
    "train.rounds=1",
    "train.inner_steps=6",
    "inner.lr=3e-3",
    "inner.warmup_steps=2",
    "islands.count=1",
    "islands.devices=4",
    # no prepared token file in a test: the built-in synthetic corpus, small
    "data.kind=synthetic",
    'data.path=""',
    "data.synthetic_tokens=20000",
    "data.val_fraction=0.1",
]
"""configs/gpt2-small.toml at a width 2 CPU cores train in seconds (its knobs untouched)."""


def curve(overrides: list[str]) -> dict:
    cfg = load_config(CONFIG, [*REDUCED, *overrides])
    setup = build_setup(cfg)
    name = cfg.islands.island_names[0]
    island = make_island(cfg, name, setup.model, setup.streams[name])
    island.start(setup.init_params)
    run = island.train(cfg.train.inner_steps)
    params = jax.tree.leaves(island.state.params)
    biggest = max(params, key=lambda x: x.size)
    return {
        "losses": run.losses.tolist(),
        "devices": len(island.mesh.devices.flat),
        "passes": island.passes,
        "param_dtypes": sorted({str(x.dtype) for x in params}),
        "opt_float_dtypes": sorted(
            {str(x.dtype) for x in jax.tree.leaves(island.state.inner_opt_state) if np.issubdtype(x.dtype, np.floating)}
        ),
        "sharded_leaves": sum(not x.sharding.is_fully_replicated for x in params),
        "leaves": len(params),
        # the largest parameter: how many devices hold a piece of it, and how big one piece is
        "biggest_shape": list(biggest.shape),
        "biggest_devices": len(biggest.sharding.device_set),
        "biggest_shard_shape": list(biggest.addressable_shards[0].data.shape),
        "biggest_shard_fraction": math.prod(biggest.addressable_shards[0].data.shape) / biggest.size,
    }


def main() -> None:
    print(json.dumps([curve(json.loads(arg)) for arg in sys.argv[1:]]))


if __name__ == "__main__":
    main()
