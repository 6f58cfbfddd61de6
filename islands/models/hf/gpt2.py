"""GPT-2 in Hugging Face's layout (GPT2LMHeadModel) onto model.kind "transformer" with attn_bias
(islands/models/transformer.py's params layout).

GPT-2's Conv1D weights are [in, out], as the project's are, so no tensor is transposed; c_attn is the project's
wqkv (queries, keys, values side by side). The learned position table is [n_positions, D], so a GPT-2 checkpoint
fixes model.seq_len too. A run trained here without attention biases exports them as zeros (`complete`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from islands.models.config import ModelConfig
from islands.models.hf.tensors import Rule, same

ARCHITECTURES: dict[str, str] = {"GPT2LMHeadModel": "gpt2"}

ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh")
"""GPT-2's GELU, the tanh approximation (jax.nn.gelu's default), under the names transformers gives it."""


def model_section(config: dict[str, Any], architecture: str, error: type[Exception], where: str) -> dict[str, Any]:
    """The [model] keys that a GPT-2 config.json fixes (every one but the run's own: compute_dtype, remat, ...)."""

    def need(key: str) -> Any:
        if config.get(key) is None:
            raise error(f"{where} has no {key!r}, which {architecture} needs")
        return config[key]

    for key, supported, why in (
        ("activation_function", ACTIVATIONS, "GPT-2's tanh GELU"),
        ("scale_attn_weights", (True,), "scores are scaled by 1/sqrt(head width)"),
        ("scale_attn_by_inverse_layer_idx", (False,), "scores are not scaled by layer"),
        ("reorder_and_upcast_attn", (False,), "scores are upcast after the matmul"),
        ("tie_word_embeddings", (True,), "the output projection is the embedding"),
    ):
        default = supported[0]
        if config.get(key, default) not in supported:
            raise error(f"{where}: {key} = {config[key]!r} is not supported ({why})")
    d_model = need("n_embd")
    return {
        "kind": "transformer",
        "vocab_size": need("vocab_size"),
        "seq_len": need("n_positions"),
        "d_model": d_model,
        "n_layers": need("n_layer"),
        "n_heads": need("n_head"),
        "d_ff": config.get("n_inner") or 4 * d_model,
        "norm_eps": float(config.get("layer_norm_epsilon", 1e-5)),
        "attn_bias": True,
    }


def architecture_of(model: ModelConfig) -> str:
    del model
    return "GPT2LMHeadModel"


def config_json(model: ModelConfig, architecture: str) -> dict[str, Any]:
    return {
        "architectures": [architecture],
        "model_type": "gpt2",
        "vocab_size": model.vocab_size,
        "n_positions": model.seq_len,
        "n_embd": model.d_model,
        "n_layer": model.n_layers,
        "n_head": model.n_heads,
        "n_inner": model.d_ff,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": model.norm_eps,
        "tie_word_embeddings": True,
        "bos_token_id": None,  # a run trained here has no special tokens (the config class's defaults are another's)
        "eos_token_id": None,
    }


CONV1D = (
    ("attn/wqkv", "attn/bqkv", "attn.c_attn"),
    ("attn/wo", "attn/bo", "attn.c_proj"),
    ("ff/w1", "ff/b1", "mlp.c_fc"),
    ("ff/w2", "ff/b2", "mlp.c_proj"),
)
"""A block's (weight, bias) leaves and the Conv1D of GPT-2 that holds them."""


def norm(ours: str, theirs: str) -> list[Rule]:
    return [same(f"{ours}/scale", f"{theirs}.weight"), same(f"{ours}/bias", f"{theirs}.bias")]


def rules(model: ModelConfig, architecture: str) -> list[Rule]:
    """Every leaf of a GPT-2-shape model with attention biases and where GPT2LMHeadModel keeps it."""
    del architecture
    out = [same("embed/tok", "transformer.wte.weight"), same("embed/pos", "transformer.wpe.weight")]
    out += norm("final_norm", "transformer.ln_f")
    for i in range(model.n_layers):
        ours, layer = f"blocks/{i}", f"transformer.h.{i}"
        out += norm(f"{ours}/ln1", f"{layer}.ln_1") + norm(f"{ours}/ln2", f"{layer}.ln_2")
        for weight, bias, conv in CONV1D:
            out += [same(f"{ours}/{weight}", f"{layer}.{conv}.weight"), same(f"{ours}/{bias}", f"{layer}.{conv}.bias")]
    return out


def ignored(model: ModelConfig) -> tuple[str, ...]:
    del model
    return ("lm_head.weight",)


def complete(params: dict[str, np.ndarray], model: ModelConfig) -> dict[str, np.ndarray]:
    """`params` with zero attention biases where the model has none (model.attn_bias false), as GPT-2 needs them."""
    if model.attn_bias:
        return params
    zeros = {}
    for i in range(model.n_layers):
        zeros[f"blocks/{i}/attn/bqkv"] = np.zeros((3 * model.d_model,), np.float32)
        zeros[f"blocks/{i}/attn/bo"] = np.zeros((model.d_model,), np.float32)
    return params | zeros
