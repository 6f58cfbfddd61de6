"""`diloco bench generate`: batched KV-cache generation (islands/sampling.py) against the training step, same model,
same devices.

One config's model (θ_0: the speed of a step does not depend on the weights) on a mesh of its islands.devices:
  train      an island's inner steps (`Island.train`), tokens/s = steps x batch_size x seq_len / wall
  generate   B prompts of P random tokens continued by N tokens (no stop token: every row makes all N), timed whole
             (prefill + N - 1 decode steps) and with N = 1 (prefill and one draw: the time to first token);
             per-token decode = (whole - first) / (N - 1), generation tokens/s = B x N / whole
Runs alternate (train, generate, first token) `repeats` times after a compiling call of each, and the medians are
reported, with the 1-minute load average before and after (the machine may be shared: compare the ratios).

The cost model beside them (`cost_model`), per token, with N_p parameters, L layers, context S, Hq query heads and
Hkv key/value heads of width Dh (model.kv_heads and model.head_size: Hq = Hkv and Hq Dh = d_model for GPT-2; a
grouped-query Llama-family model has Hkv < Hq, and head_dim may differ from d_model / n_heads):
  decode     2 N_p flops (every weight once per token, the tied output projection included) + 4 L S Hq Dh for the
             attention over the cached positions (scores and weighted values over the whole fixed buffer S = P + N - 1:
             the loop attends the full buffer, masked); each decode step also reads every weight (4 N_p bytes) and
             the whole cache, keys and values of Hkv heads (2 L B S Hkv Dh x the compute dtype's bytes:
             `transformer.init_cache`'s arrays), shared by the B rows of the step
  train      6 N_p flops (forward and backward) + 12 L seq_len Hq Dh for the attention (4 L T Hq Dh forward, twice
             that back): PaLM's count (diloco/bench/flops.py, `train_flops_per_token`)
so if both ran at one flop rate, generation tokens/s / training tokens/s would be train flops / decode flops per token
(about 3); a decode step of a small batch is bound by its reads and its per-step overhead instead, which the achieved
flop rates of the two (`achieved_gflops`) show.

Run: ``diloco bench generate CONFIG [--batch B] [--new-tokens N] [--prompt-len P] [--repeats R] [key=value ...]``.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from diloco.bench.errors import BenchError
from diloco.bench.flops import train_flops_per_token
from diloco.config import RunConfig
from diloco.run.setup import build_setup
from islands.inner import make_inner_optimizer
from islands.island import Island
from islands.models.base import param_count
from islands.sampling import SamplingError, check_request, generate, place_rows

TRAIN_STEPS = 10
"""Inner steps per timed training run."""


def _wall(run: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    jax.block_until_ready(run())
    return time.perf_counter() - t0


def cost_model(cfg: RunConfig, n_params: int, batch: int, prompt_len: int, new_tokens: int) -> dict[str, float]:
    """Flops per token of decoding and of training, and the bytes a decode step reads (module docstring)."""
    m = cfg.model
    buffer = prompt_len + new_tokens - 1
    dtype_bytes = 2 if m.compute_dtype == "bfloat16" else 4
    queries = m.n_heads * m.head_size  # the width attention works in (d_model for GPT-2)
    decode = 2 * n_params + 4 * m.n_layers * buffer * queries
    train = train_flops_per_token(m, n_params)
    return {
        "decode_flops_per_token": decode,
        "train_flops_per_token": train,
        "flops_ratio_train_over_decode": round(train / decode, 3),
        "decode_step_weight_bytes": 4 * n_params,
        "decode_step_cache_bytes": 2 * m.n_layers * batch * buffer * m.kv_heads * m.head_size * dtype_bytes,
    }


def run_generate_bench(
    cfg: RunConfig,
    batch: int | None = None,
    new_tokens: int | None = None,
    prompt_len: int | None = None,
    repeats: int = 5,
) -> dict[str, Any]:
    """Time training and generation side by side (module docstring); medians of `repeats` alternating runs."""
    seq_len = cfg.model.seq_len
    batch = cfg.train.batch_size if batch is None else batch
    prompt_len = seq_len // 2 if prompt_len is None else prompt_len
    new_tokens = seq_len - prompt_len if new_tokens is None else new_tokens
    if batch < 1 or repeats < 1 or new_tokens < 2:
        raise BenchError(
            f"bench generate: --batch and --repeats must be >= 1 and --new-tokens >= 2 (got {batch}, {repeats}, "
            f"{new_tokens})"
        )
    try:
        check_request(cfg.model, prompt_len, new_tokens, 1.0, 1.0)
    except SamplingError as exc:
        raise BenchError(f"bench generate: {exc}") from None
    load = [round(os.getloadavg()[0], 2)]
    name = cfg.islands.island_names[0]
    setup = build_setup(cfg, islands=[name])
    tx = make_inner_optimizer(cfg.inner, cfg.total_inner_steps)
    island = Island(
        "bench",
        setup.model,
        tx,
        setup.streams[name],
        n_devices=cfg.islands.devices,
        microbatch=cfg.train.microbatch,
        shard_params=cfg.islands.shard_params,
        tensor=cfg.islands.tensor,
    )
    island.start(setup.init_params)
    rng = np.random.default_rng(cfg.run.seed)
    prompts = rng.integers(0, cfg.model.vocab_size, (batch, prompt_len), dtype=np.int32)
    params, (rows, lens) = place_rows(island.layout, setup.init_params, prompts, np.full(batch, prompt_len, np.int32))

    def make(n: int) -> Callable[[], object]:
        key = jax.random.key(cfg.run.seed)
        return lambda: generate(params, cfg.model, rows, lens, key=key, max_new_tokens=n, temperature=1.0)

    runs = {"train": lambda: island.train(TRAIN_STEPS).losses, "generate": make(new_tokens), "first": make(1)}
    for run in runs.values():
        _wall(run)  # compile outside the timing
    times: dict[str, list[float]] = {key: [] for key in runs}
    for _ in range(repeats):
        for key, run in runs.items():
            times[key].append(_wall(run))
    load.append(round(os.getloadavg()[0], 2))
    median = {key: statistics.median(t) for key, t in times.items()}
    decode_s = (median["generate"] - median["first"]) / (new_tokens - 1)
    train_tps = TRAIN_STEPS * cfg.train.batch_size * seq_len / median["train"]
    generate_tps = batch * new_tokens / median["generate"]
    n_params = param_count(setup.init_params)
    model = cost_model(cfg, n_params, batch, prompt_len, new_tokens)
    return {
        "bench": "generate",
        "param_count": n_params,
        "devices": cfg.islands.devices,
        "compute_dtype": cfg.model.compute_dtype,
        "batch": batch,
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "train_batch": [cfg.train.batch_size, seq_len],
        "train_tokens_per_s": round(train_tps, 1),
        "generate_tokens_per_s": round(generate_tps, 1),
        "generate_over_train": round(generate_tps / train_tps, 4),
        "time_to_first_token_s": round(median["first"], 5),
        "prefill_tokens_per_s": round(batch * prompt_len / median["first"], 1),
        "decode_s_per_token": round(decode_s, 6),
        "decode_tokens_per_s": round(batch / decode_s, 1) if decode_s > 0 else None,
        "seconds": {key: [round(t, 5) for t in ts] for key, ts in times.items()},
        "cost_model": model,
        "achieved_gflops": {
            "train": round(train_tps * model["train_flops_per_token"] / 1e9, 3),
            "decode": round(batch / decode_s * model["decode_flops_per_token"] / 1e9, 3) if decode_s > 0 else None,
        },
        "load_avg_1m": load,
    }
