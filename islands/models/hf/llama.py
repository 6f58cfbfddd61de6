"""The Llama family in Hugging Face's layout: LlamaForCausalLM (Llama 3.x, SmolLM2), MistralForCausalLM,
Qwen2ForCausalLM, Qwen3ForCausalLM, and the mixtures of experts Qwen3MoeForCausalLM, Qwen2MoeForCausalLM and
MixtralForCausalLM, onto model.kind "llama" / "llama_moe" (islands/models/llama.py's params layout).

config.json -> [model] (`model_section`), reading both the layout transformers 5 writes (`rope_parameters`,
`num_local_experts`) and the one most checkpoints on the Hub have (`rope_theta` and `rope_scaling`, `num_experts`); a
key config.json omits takes the value transformers' config class gives it (`DEFAULTS`). What the project's model does
not compute (another activation, MLP biases, YaRN rope, dense layers between sparse ones) is refused in one line.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from islands.models.config import ModelConfig
from islands.models.hf.tensors import Rule, linear, same

ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "MixtralForCausalLM": "mixtral",
}
"""architecture -> its model_type."""

MIXTURES = ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "MixtralForCausalLM")

DEFAULTS: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": {"rms_norm_eps": 1e-6, "rope_theta": 10000.0},
    "MistralForCausalLM": {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "sliding_window": 4096},
    "Qwen2ForCausalLM": {"rms_norm_eps": 1e-6, "rope_theta": 10000.0},
    "Qwen3ForCausalLM": {"rms_norm_eps": 1e-6, "rope_theta": 10000.0},
    "Qwen3MoeForCausalLM": {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "norm_topk_prob": False},
    "Qwen2MoeForCausalLM": {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "norm_topk_prob": False},
    "MixtralForCausalLM": {"rms_norm_eps": 1e-5, "rope_theta": 1e6},
}
"""What transformers' config classes give a key that config.json omits (every class: tie_word_embeddings false,
num_key_value_heads = num_attention_heads, head_dim = hidden_size / num_attention_heads, silu)."""


class Reader:
    """config.json's keys, a missing required one or a refused value one line naming it."""

    def __init__(self, config: dict[str, Any], architecture: str, error: type[Exception], where: str) -> None:
        self.config, self.architecture, self.error, self.where = config, architecture, error, where

    def get(self, key: str, default: Any = None) -> Any:
        """config.json's value of `key` (null included), or where it is absent transformers' default."""
        return self.config[key] if key in self.config else DEFAULTS[self.architecture].get(key, default)

    def need(self, key: str) -> Any:
        value = self.config.get(key)
        if value is None:
            raise self.error(f"{self.where} has no {key!r}, which {self.architecture} needs")
        return value

    def refuse(self, key: str, why: str) -> Exception:
        return self.error(f"{self.where}: {key} = {self.config.get(key)!r} is not supported ({why})")


def rope(r: Reader) -> dict[str, Any]:
    """The rotary keys: transformers 5's rope_parameters, or rope_theta with rope_scaling (None: unscaled)."""
    params = r.config.get("rope_parameters") or {}
    key = "rope_parameters" if params else "rope_scaling"
    scaling = params or r.config.get("rope_scaling") or {}
    if not isinstance(scaling, dict):
        raise r.refuse(key, "an object is expected")
    theta = params.get("rope_theta", r.get("rope_theta"))
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return {"rope_theta": float(theta), "rope_scaling": "none"}
    if kind != "llama3":
        raise r.refuse(key, f"rope type {kind!r}: default and llama3 are")
    return {
        "rope_theta": float(theta),
        "rope_scaling": "llama3",
        "rope_scaling_factor": float(scaling["factor"]),
        "rope_scaling_low_freq_factor": float(scaling["low_freq_factor"]),
        "rope_scaling_high_freq_factor": float(scaling["high_freq_factor"]),
        "rope_scaling_original_max_position": int(scaling["original_max_position_embeddings"]),
    }


def model_section(config: dict[str, Any], architecture: str, error: type[Exception], where: str) -> dict[str, Any]:
    """The [model] keys that config.json of `architecture` fixes (the rest, seq_len included, are the run's)."""
    r = Reader(config, architecture, error, where)
    if r.get("hidden_act", "silu") != "silu":
        raise r.refuse("hidden_act", "the Llama family's MLP is SwiGLU (silu)")
    if r.get("mlp_bias", False):
        raise r.refuse("mlp_bias", "the MLPs have no biases")
    heads = r.need("num_attention_heads")
    d_model = r.need("hidden_size")
    qwen2 = architecture in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")
    window = r.get("sliding_window") if r.get("use_sliding_window", architecture not in ("Qwen2ForCausalLM",
                   "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM")) else None  # fmt: skip
    section: dict[str, Any] = {
        "kind": "llama_moe" if architecture in MIXTURES else "llama",
        "vocab_size": r.need("vocab_size"),
        "d_model": d_model,
        "n_layers": r.need("num_hidden_layers"),
        "n_heads": heads,
        "n_kv_heads": r.get("num_key_value_heads") or heads,
        "head_dim": r.get("head_dim") or d_model // heads,
        "norm_eps": float(r.get("rms_norm_eps")),
        "tie_embeddings": bool(r.get("tie_word_embeddings", False)),
        "attn_bias": bool(r.get("attention_bias", False)) and not qwen2,
        "qkv_bias": qwen2 and bool(r.get("qkv_bias", True)),
        "qk_norm": architecture.startswith("Qwen3"),
        "sliding_window": int(window or 0),
        **rope(r),
    }
    if architecture not in MIXTURES:
        return {**section, "d_ff": r.need("intermediate_size")}
    if architecture != "MixtralForCausalLM":
        if r.get("decoder_sparse_step", 1) != 1:
            raise r.refuse("decoder_sparse_step", "every layer's feed-forward is the mixture")
        if r.get("mlp_only_layers", []):
            raise r.refuse("mlp_only_layers", "every layer's feed-forward is the mixture")
    experts = r.config.get("num_experts") or r.need("num_local_experts")
    return {
        **section,
        "d_ff": r.need("intermediate_size" if architecture == "MixtralForCausalLM" else "moe_intermediate_size"),
        "n_experts": experts,
        "top_k": r.need("num_experts_per_tok"),
        "norm_topk_prob": architecture == "MixtralForCausalLM" or bool(r.get("norm_topk_prob")),
        "shared_expert_d_ff": int(r.get("shared_expert_intermediate_size", 0)) if qwen2 else 0,
    }


def architecture_of(model: ModelConfig) -> str:
    """The Hugging Face architecture that computes what `model` does (for an export of a run that did not start from
    a checkpoint); a ValueError naming the [model] key no architecture has."""
    if model.sliding_window:
        raise ValueError("model.sliding_window: export a model without one (every window here is >= seq_len)")
    if model.kind == "llama":
        if model.qk_norm:
            if model.qkv_bias:
                raise ValueError("model.qkv_bias with model.qk_norm: Qwen3 has biases on all four projections or none")
            return "Qwen3ForCausalLM"
        if model.qkv_bias:
            if model.attn_bias:
                raise ValueError("model.attn_bias with model.qkv_bias: Qwen2's output projection has no bias")
            return "Qwen2ForCausalLM"
        return "LlamaForCausalLM"
    if model.shared_expert_d_ff or model.qkv_bias:
        if not (model.qkv_bias and model.shared_expert_d_ff) or model.qk_norm or model.attn_bias:
            raise ValueError("a llama_moe model is Qwen2-MoE with qkv_bias and a shared expert, and nothing else")
        return "Qwen2MoeForCausalLM"
    if model.qk_norm:
        return "Qwen3MoeForCausalLM"
    if not model.norm_topk_prob or model.attn_bias:
        raise ValueError("model.norm_topk_prob = false (or attn_bias) without qk_norm: no Hugging Face mixture has it")
    return "MixtralForCausalLM"


def config_json(model: ModelConfig, architecture: str) -> dict[str, Any]:
    """config.json of `model` as `architecture` (rope in the layout every transformers version reads)."""
    config: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": ARCHITECTURES[architecture],
        "vocab_size": model.vocab_size,
        "hidden_size": model.d_model,
        "num_hidden_layers": model.n_layers,
        "num_attention_heads": model.n_heads,
        "num_key_value_heads": model.kv_heads,
        "head_dim": model.head_size,
        "intermediate_size": model.d_ff,
        "hidden_act": "silu",
        "rms_norm_eps": model.norm_eps,
        "rope_theta": model.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": model.seq_len,
        "tie_word_embeddings": model.tie_embeddings,
        "sliding_window": None,
        "use_sliding_window": False,
        "bos_token_id": None,  # a run trained here has no special tokens (the config class's defaults are another's)
        "eos_token_id": None,
    }
    if model.rope_scaling == "llama3":
        config["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": model.rope_scaling_factor,
            "low_freq_factor": model.rope_scaling_low_freq_factor,
            "high_freq_factor": model.rope_scaling_high_freq_factor,
            "original_max_position_embeddings": model.rope_scaling_original_max_position,
        }
    if architecture in ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
        config["attention_bias"] = model.attn_bias
    if architecture in MIXTURES:
        config["num_experts_per_tok"] = model.top_k
        config["num_local_experts" if architecture == "MixtralForCausalLM" else "num_experts"] = model.n_experts
        if architecture != "MixtralForCausalLM":
            config |= {"moe_intermediate_size": model.d_ff, "norm_topk_prob": model.norm_topk_prob,
                       "decoder_sparse_step": 1, "mlp_only_layers": []}  # fmt: skip
        if architecture == "Qwen2MoeForCausalLM":
            config["shared_expert_intermediate_size"] = model.shared_expert_d_ff
    return config


def feed_forward(model: ModelConfig, architecture: str, i: int) -> list[Rule]:
    """The rules of block i's feed-forward: a SwiGLU MLP, or the router, the experts and a shared expert."""
    ours = f"blocks/{i}/ff"
    if model.kind == "llama":
        mlp = f"model.layers.{i}.mlp"
        return [linear(f"{ours}/{w}", f"{mlp}.{p}.weight") for w, p in (("w_gate", "gate_proj"), ("w_up", "up_proj"),
                ("w_down", "down_proj"))]  # fmt: skip
    if architecture == "MixtralForCausalLM":
        moe, names = f"model.layers.{i}.block_sparse_moe", (("w_gate", "w1"), ("w_up", "w3"), ("w_down", "w2"))
    else:
        moe, names = f"model.layers.{i}.mlp", (("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj"))
    experts = [
        Rule(f"{ours}/{w}", tuple(f"{moe}.experts.{e}.{p}.weight" for e in range(model.n_experts)), transpose=True)
        for w, p in names
    ]
    rules = [linear(f"{ours}/router", f"{moe}.gate.weight"), *experts]
    if model.shared_expert_d_ff:
        shared = f"{moe}.shared_expert"
        rules += [linear(f"{ours}/shared/{w}", f"{shared}.{p}.weight") for w, p in names]
        rules.append(linear(f"{ours}/shared/gate", f"{moe}.shared_expert_gate.weight"))
    return rules


def rules(model: ModelConfig, architecture: str) -> list[Rule]:
    """Every leaf of `model`'s params and where `architecture` keeps it."""
    out = [same("embed/tok", "model.embed_tokens.weight"), same("final_norm/scale", "model.norm.weight")]
    if not model.tie_embeddings:
        out.append(linear("lm_head", "lm_head.weight"))
    for i in range(model.n_layers):
        ours, layer = f"blocks/{i}", f"model.layers.{i}"
        out += [same(f"{ours}/ln1/scale", f"{layer}.input_layernorm.weight"),
                same(f"{ours}/ln2/scale", f"{layer}.post_attention_layernorm.weight")]  # fmt: skip
        attn = f"{layer}.self_attn"
        out += [linear(f"{ours}/attn/w{x}", f"{attn}.{x}_proj.weight") for x in "qkvo"]
        biased = "qkvo" if model.attn_bias else "qkv" if model.qkv_bias else ""
        out += [same(f"{ours}/attn/b{x}", f"{attn}.{x}_proj.bias") for x in biased]
        if model.qk_norm:
            out += [same(f"{ours}/attn/{x}_norm/scale", f"{attn}.{x}_norm.weight") for x in "qk"]
        out += feed_forward(model, architecture, i)
    return out


def ignored(model: ModelConfig) -> tuple[str, ...]:
    """Tensors a checkpoint may hold that a model with tied embeddings does not read (transformers ties them too)."""
    return ("lm_head.weight",) if model.tie_embeddings else ()


def complete(params: dict[str, np.ndarray], model: ModelConfig) -> dict[str, np.ndarray]:
    """`params` as they are: every leaf an export writes is the model's."""
    del model
    return params
