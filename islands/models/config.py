"""The `[model]` section of a run config: which model an island trains and how big it is.

JAX-free, like every config section, so that loading and validating a config does not import JAX
(tests/test_layering.py); the models themselves are `transformer.py` (GPT-2 shape), `llama.py` (the Llama family:
Llama 3.x, Qwen2 / 2.5 / 3, Mistral-style dense models, SmolLM2), `moe.py` (the routed experts of both) and a
user's `entry`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from floor.errors import UserError
from islands.user_code import entry_form_ok

KINDS: tuple[str, ...] = ("transformer", "moe", "llama", "llama_moe", "custom")
"""The model kinds `build_model` knows."""

LLAMA_KINDS: tuple[str, ...] = ("llama", "llama_moe")
"""The kinds of the Llama family (islands/models/llama.py): the keys from n_kv_heads on apply to them."""

ROPE_SCALINGS: tuple[str, ...] = ("none", "llama3")
"""The values of model.rope_scaling: none, or Llama 3's frequency-dependent scaling of the rotary frequencies."""

COMPUTE_DTYPES: tuple[str, ...] = ("float32", "bfloat16")
"""The values of model.compute_dtype."""

LORA_MODULES: tuple[str, ...] = ("wqkv", "wq", "wk", "wv", "wo", "w1", "w2", "w_gate", "w_up", "w_down")
"""The block matrices workload.lora.targets may name (islands/models/lora.py): GPT-2's wqkv, wo, w1, w2 and the Llama
family's wq, wk, wv, wo, w_gate, w_up, w_down (a shared expert's too)."""

LORA_ATTENTION: tuple[str, ...] = ("wqkv", "wq", "wk", "wv", "wo")
"""What workload.lora.targets = [] adapts: every attention projection the model has."""


class ModelError(UserError, ValueError):
    """A user error in the model section of the config (bad sizes, an entry that does not import)."""


def _check_int(name: str, value: object, minimum: int = 1) -> None:
    # bool is an int subclass; `d_model = true` in TOML is a mistake, not the number 1.
    if not isinstance(value, int) or isinstance(value, bool):
        raise ModelError(f"model.{name} must be an integer (got {value!r})")
    if value < minimum:
        raise ModelError(f"model.{name} must be >= {minimum} (got {value})")


def _check_float(name: str, value: object, *, positive: bool) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise ModelError(f"model.{name} must be a number (got {value!r})")
    if not np.isfinite(value) or value < 0 or (positive and value == 0):
        bound = "> 0" if positive else ">= 0"
        raise ModelError(f"model.{name} must be a finite number {bound} (got {value})")
    return float(value)


@dataclass(frozen=True)
class ModelConfig:
    """Which model an island trains and how big it is (the `[model]` table of a run config)."""

    kind: str = "transformer"
    """Which model to build: "transformer" (dense decoder-only, GPT-2 shape), "moe" (the same with a top-k routed
    mixture of experts in place of each MLP), "llama" (the Llama family: RMSNorm, rotary positions, SwiGLU,
    grouped-query attention), "llama_moe" (the same with routed SwiGLU experts: Qwen3-MoE, Mixtral, Qwen2-MoE), or
    "custom" (a user model named by `entry`)."""

    entry: str = ""
    """For kind = "custom": where the user's builder lives, as "package.module:function". The function
    is called with this config and returns an object with `init` and `loss` callables."""

    vocab_size: int = 256
    """Number of token ids; 256 covers byte-level text."""

    seq_len: int = 64
    """Context length: tokens per example fed to the model (batches carry seq_len + 1 for the targets)."""

    d_model: int = 128
    """Width of the residual stream."""

    n_layers: int = 3
    """Number of transformer blocks."""

    n_heads: int = 4
    """Attention (query) heads per block; must divide d_model for kinds transformer and moe."""

    d_ff: int = 512
    """Hidden width of each MLP (of each expert, for kinds moe and llama_moe)."""

    n_experts: int = 4
    """kinds moe and llama_moe only: experts per block."""

    top_k: int = 2
    """kinds moe and llama_moe only: experts each token is routed to (<= n_experts)."""

    aux_loss_weight: float = 0.01
    """kinds moe and llama_moe only: weight of the Switch-style load-balancing loss added to the cross-entropy."""

    norm_eps: float = 1e-5
    """The epsilon of every normalisation (LayerNorm for kinds transformer and moe, RMSNorm for the Llama family):
    Hugging Face's layer_norm_epsilon / rms_norm_eps."""

    attn_bias: bool = False
    """Every attention projection has a bias: GPT-2's c_attn and c_proj biases (kinds transformer and moe: bqkv, bo),
    Hugging Face Llama's attention_bias (the Llama family: bq, bk, bv, bo)."""

    n_kv_heads: int = 0
    """Llama family: key/value heads of grouped-query attention (must divide n_heads); 0 means n_heads (multi-head
    attention). Kinds transformer and moe have n_heads of them."""

    head_dim: int = 0
    """Llama family: width of each attention head; 0 means d_model / n_heads. Qwen3 sets it apart from
    d_model / n_heads (the query projection is then [d_model, n_heads * head_dim])."""

    rope_theta: float = 10000.0
    """Llama family: the base θ of the rotary position embeddings (Llama 3: 500000, Qwen2: 1000000)."""

    rope_scaling: str = "none"
    """Llama family: "none", or "llama3" (Llama 3.1's scaling of the rotary frequencies, by the four keys below)."""

    rope_scaling_factor: float = 8.0
    """rope_scaling = "llama3": the factor the low frequencies are divided by."""

    rope_scaling_low_freq_factor: float = 1.0
    """rope_scaling = "llama3": wavelengths above original_max_position / low_freq_factor are scaled in full."""

    rope_scaling_high_freq_factor: float = 4.0
    """rope_scaling = "llama3": wavelengths below original_max_position / high_freq_factor are not scaled (the ones
    between are interpolated); must be > rope_scaling_low_freq_factor."""

    rope_scaling_original_max_position: int = 8192
    """rope_scaling = "llama3": the context length the model was pre-trained at (original_max_position_embeddings)."""

    qkv_bias: bool = False
    """Llama family: the query, key and value projections have biases, the output projection none (Qwen2 / 2.5)."""

    qk_norm: bool = False
    """Llama family: an RMSNorm over each head's queries and keys before the rotary embedding (Qwen3)."""

    tie_embeddings: bool = True
    """The output projection is the transposed input embedding. Llama family only may set it false (an own lm_head:
    Llama 3 8B, Mistral); kinds transformer and moe are always tied."""

    sliding_window: int = 0
    """Llama family: Mistral-style sliding-window attention's window; 0 for none. A window at least seq_len wide
    sees every position and is the same as none; a narrower one is refused (not implemented)."""

    norm_topk_prob: bool = True
    """llama_moe only: renormalise the top_k gates to sum to 1 (Mixtral, Qwen3-MoE), else keep the router's
    probabilities (Qwen2-MoE)."""

    shared_expert_d_ff: int = 0
    """llama_moe only: hidden width of a shared SwiGLU expert every token goes through, scaled by a sigmoid gate
    (Qwen2-MoE's shared_expert_intermediate_size); 0 for none."""

    init_scale: float = 0.02
    """Standard deviation of the normal initialisation of weight matrices and embeddings."""

    compute_dtype: str = "float32"
    """dtype of the matmuls and activations of the forward and backward passes: "float32" or "bfloat16" (mixed
    precision, for accelerators; on CPU bfloat16 is usually slower). Parameters, their gradients and the optimizer
    state stay float32 either way (the master weights: pseudo-gradients, codecs and the coordinator see float32):
    weights are cast where they are used, and layer-norm statistics, the attention softmax and the cross-entropy
    run in float32 for stability. Honoured by kind transformer and moe; a custom model may read it."""

    remat: bool = False
    """Rematerialise every transformer block in the backward pass (`jax.checkpoint`, nothing saved inside a block):
    a block keeps only its input [batch, seq_len, d_model] for the backward pass, which recomputes the rest, at the
    cost of about one more forward pass per step. For models whose activations do not fit (train.microbatch is the
    other knob); the loss and gradients are the same. Honoured by kind transformer and moe."""

    @property
    def kv_heads(self) -> int:
        """Key/value heads per block: n_kv_heads, or n_heads where that is 0."""
        return self.n_kv_heads or self.n_heads

    @property
    def head_size(self) -> int:
        """Width of each attention head: head_dim, or d_model / n_heads where that is 0."""
        return self.head_dim or self.d_model // self.n_heads

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ModelError(f"model.kind must be one of {', '.join(KINDS)} (got {self.kind!r})")
        if not isinstance(self.entry, str):
            raise ModelError(f"model.entry must be a string (got {self.entry!r})")
        if self.kind == "custom":
            if not self.entry:
                raise ModelError('model.entry must name the builder ("package.module:function") for kind custom')
            if not entry_form_ok(self.entry):
                raise ModelError(f"model.entry {self.entry!r} must have the form 'package.module:function'")
        for name in ("vocab_size", "seq_len", "d_model", "n_layers", "n_heads", "d_ff", "n_experts", "top_k"):
            _check_int(name, getattr(self, name))
        for name in ("n_kv_heads", "head_dim", "sliding_window", "shared_expert_d_ff"):
            _check_int(name, getattr(self, name), minimum=0)
        _check_int("rope_scaling_original_max_position", self.rope_scaling_original_max_position)
        for name in ("remat", "attn_bias", "qkv_bias", "qk_norm", "tie_embeddings", "norm_topk_prob"):
            if not isinstance(getattr(self, name), bool):
                raise ModelError(f"model.{name} must be true or false (got {getattr(self, name)!r})")
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise ModelError(
                f"model.compute_dtype must be one of {', '.join(COMPUTE_DTYPES)} (got {self.compute_dtype!r})"
            )
        if self.rope_scaling not in ROPE_SCALINGS:
            raise ModelError(
                f"model.rope_scaling must be one of {', '.join(ROPE_SCALINGS)} (got {self.rope_scaling!r})"
            )
        if self.top_k > self.n_experts:
            raise ModelError(f"model.top_k ({self.top_k}) must be <= model.n_experts ({self.n_experts})")
        # Normalise TOML ints (`init_scale = 1`) to floats so equal configs compare and hash equal.
        for name, positive in (
            ("aux_loss_weight", False),
            ("init_scale", True),
            ("norm_eps", True),
            ("rope_theta", True),
            ("rope_scaling_factor", True),
            ("rope_scaling_low_freq_factor", True),
            ("rope_scaling_high_freq_factor", True),
        ):
            object.__setattr__(self, name, _check_float(name, getattr(self, name), positive=positive))
        if self.kind in LLAMA_KINDS:
            self._check_llama()
        else:
            self._check_not_llama()

    def _check_llama(self) -> None:
        if self.n_heads % self.kv_heads:
            raise ModelError(f"model.n_kv_heads ({self.n_kv_heads}) must divide model.n_heads ({self.n_heads})")
        if not self.head_dim and self.d_model % self.n_heads:
            raise ModelError(
                f"model.d_model ({self.d_model}) must be divisible by model.n_heads ({self.n_heads}), "
                "or model.head_dim set"
            )
        if self.head_size % 2:
            raise ModelError(f"model.head_dim ({self.head_size}) must be even (rotary embeddings rotate pairs)")
        if 0 < self.sliding_window < self.seq_len:
            raise ModelError(
                f"model.sliding_window ({self.sliding_window}) below model.seq_len ({self.seq_len}) is not supported "
                "(a window of at least seq_len, or 0, attends to every position)"
            )
        if self.rope_scaling == "llama3" and self.rope_scaling_high_freq_factor <= self.rope_scaling_low_freq_factor:
            raise ModelError(
                f"model.rope_scaling_high_freq_factor ({self.rope_scaling_high_freq_factor}) must be > "
                f"model.rope_scaling_low_freq_factor ({self.rope_scaling_low_freq_factor})"
            )
        if self.kind == "llama" and self.shared_expert_d_ff:
            raise ModelError('model.shared_expert_d_ff needs model.kind = "llama_moe"')

    def _check_not_llama(self) -> None:
        """Kinds transformer, moe and custom: the Llama family's keys keep their defaults (or say the same)."""
        if self.d_model % self.n_heads:
            raise ModelError(f"model.d_model ({self.d_model}) must be divisible by model.n_heads ({self.n_heads})")
        if self.n_kv_heads not in (0, self.n_heads):
            raise ModelError(f"model.n_kv_heads (grouped-query attention) needs model.kind {' or '.join(LLAMA_KINDS)}")
        if self.head_dim not in (0, self.d_model // self.n_heads):
            raise ModelError(f"model.head_dim other than d_model / n_heads needs model.kind {' or '.join(LLAMA_KINDS)}")
        defaults = {f.name: f.default for f in fields(self)}
        keys = (
            "rope_scaling",
            "qkv_bias",
            "qk_norm",
            "tie_embeddings",
            "sliding_window",
            "norm_topk_prob",
            "shared_expert_d_ff",
        )
        for name in keys:
            if getattr(self, name) != defaults[name]:
                raise ModelError(f"model.{name} needs model.kind {' or '.join(LLAMA_KINDS)}")
