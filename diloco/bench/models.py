"""`diloco bench models`: the step time of the Llama family's block against the GPT-2 block at equal parameters.

Three stacks of L blocks (islands/models/transformer.py's `block`, each with its family's `Architecture`), sized to
the same parameters per block:
  gpt2         LayerNorm, multi-head attention with GPT-2's biases (model.attn_bias), GELU MLP of d_ff = 4 D
  llama        RMSNorm, multi-head attention with rotary embeddings, SwiGLU MLP of the d_ff that matches gpt2's block
               (8 D / 3 with multi-head attention: Llama's own choice)
  llama_gqa    the same with --kv-heads key/value heads, its smaller attention paid back in a wider SwiGLU
A step is the forward and backward pass of the stack on a random [B, T, D] input (loss: the mean square of the
output), jitted once; the embeddings and the output projection are left out, as they are the same matmuls in every
family. The stacks take turns, `repeats` times `steps` steps each after a compiling call, and the medians are reported
with each Llama row's ratio to gpt2's (> 1: slower), and the 1-minute load average before and after (the machine may be
shared: the ratio, measured in one run, is the figure).

Run: ``diloco bench models [--d-model D] [--heads H] [--kv-heads K] [--layers L] [--batch B] [--seq-len T]
[--dtype float32|bfloat16] [--steps S] [--repeats R]``.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from islands.models import llama, transformer
from islands.models.base import param_count
from islands.models.config import ModelConfig


def family_configs(d_model: int, heads: int, kv_heads: int, layers: int, seq_len: int, dtype: str
                   ) -> dict[str, tuple[ModelConfig, transformer.Architecture]]:  # fmt: skip
    """The three stacks (module docstring): each row's config and architecture, the Llama rows' d_ff solved for the
    gpt2 block's parameter count."""
    common = {"d_model": d_model, "n_heads": heads, "n_layers": layers, "seq_len": seq_len, "compute_dtype": dtype}
    gpt2 = ModelConfig(kind="transformer", d_ff=4 * d_model, attn_bias=True, **common)
    target = block_params(gpt2, transformer.GPT2)
    rows = {"gpt2": (gpt2, transformer.GPT2)}
    for name, kv in (("llama", heads), ("llama_gqa", kv_heads)):
        draft = ModelConfig(kind="llama", d_ff=1, n_kv_heads=kv, **common)
        without_mlp = block_params(draft, llama.LLAMA) - 3 * d_model
        d_ff = round((target - without_mlp) / (3 * d_model))
        rows[name] = (ModelConfig(kind="llama", d_ff=d_ff, n_kv_heads=kv, **common), llama.LLAMA)
    return rows


def block_params(cfg: ModelConfig, arch: transformer.Architecture) -> int:
    """The parameters of one block of `arch` at cfg (shapes only)."""
    shapes = jax.eval_shape(lambda key: transformer.init_params(key, cfg, arch), jax.random.key(0))
    return param_count(shapes["blocks"][0])


def stack_step(cfg: ModelConfig, arch: transformer.Architecture) -> Callable[[Any, jax.Array], Any]:
    """The jitted gradient of the stack's mean square output with respect to its blocks' params."""

    def loss(blocks: list, x: jax.Array) -> jax.Array:
        x = x.astype(cfg.compute_dtype)
        for p in blocks:
            x, _ = transformer.block(p, x, cfg, arch)
        return jnp.mean(jnp.square(x.astype(jnp.float32)))

    return jax.jit(jax.grad(loss))


def run_models_bench(
    d_model: int = 256,
    heads: int = 8,
    kv_heads: int = 2,
    layers: int = 4,
    batch: int = 8,
    seq_len: int = 256,
    dtype: str = "float32",
    steps: int = 5,
    repeats: int = 5,
) -> dict[str, Any]:
    rows = family_configs(d_model, heads, kv_heads, layers, seq_len, dtype)
    x = jax.random.normal(jax.random.key(1), (batch, seq_len, d_model), jnp.float32)
    runs = {}
    for name, (cfg, arch) in rows.items():
        blocks = jax.jit(lambda key, cfg=cfg, arch=arch: transformer.init_params(key, cfg, arch))(jax.random.key(0))
        step = stack_step(cfg, arch)
        jax.block_until_ready(step(blocks["blocks"], x))  # compile
        runs[name] = (step, blocks["blocks"])
    load = [round(os.getloadavg()[0], 2)]
    times: dict[str, list[float]] = {name: [] for name in rows}
    for _ in range(repeats):
        for name, (step, blocks) in runs.items():
            t0 = time.perf_counter()
            jax.block_until_ready([step(blocks, x) for _ in range(steps)])
            times[name].append((time.perf_counter() - t0) / steps)
    load.append(round(os.getloadavg()[0], 2))
    median = {name: statistics.median(ts) for name, ts in times.items()}
    return {
        "shape": {
            "d_model": d_model,
            "heads": heads,
            "kv_heads": kv_heads,
            "layers": layers,
            "batch": batch,
            "seq_len": seq_len,
            "dtype": dtype,
            "steps": steps,
            "repeats": repeats,
        },  # fmt: skip
        "rows": {
            name: {
                "d_ff": cfg.d_ff,
                "kv_heads": cfg.kv_heads,
                "params_per_block": block_params(cfg, arch),
                "step_ms": round(1e3 * median[name], 2),
                "ratio_to_gpt2": round(median[name] / median["gpt2"], 3),
            }
            for name, (cfg, arch) in rows.items()
        },
        "load_avg_1min": load,
        "devices": f"{jax.device_count()} {jax.devices()[0].platform}",
    }
