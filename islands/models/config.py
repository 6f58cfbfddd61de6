"""The `[model]` section of a run config: which model an island trains and how big it is.

JAX-free, like every config section, so that loading and validating a config does not import JAX
(tests/test_layering.py); the models themselves are `transformer.py`, `moe.py` and a user's `entry`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from floor.errors import UserError
from islands.user_code import entry_form_ok

KINDS: tuple[str, ...] = ("transformer", "moe", "custom")
"""The model kinds `build_model` knows."""

COMPUTE_DTYPES: tuple[str, ...] = ("float32", "bfloat16")
"""The values of model.compute_dtype."""


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
    """Which model to build: "transformer" (dense decoder-only), "moe" (the same with a top-k routed
    mixture of experts in place of each MLP), or "custom" (a user model named by `entry`)."""

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
    """Attention heads per block; must divide d_model."""

    d_ff: int = 512
    """Hidden width of each MLP (of each expert, for kind = "moe")."""

    n_experts: int = 4
    """kind = "moe" only: experts per block."""

    top_k: int = 2
    """kind = "moe" only: experts each token is routed to (<= n_experts)."""

    aux_loss_weight: float = 0.01
    """kind = "moe" only: weight of the Switch-style load-balancing loss added to the cross-entropy."""

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
        if self.d_model % self.n_heads:
            raise ModelError(f"model.d_model ({self.d_model}) must be divisible by model.n_heads ({self.n_heads})")
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise ModelError(
                f"model.compute_dtype must be one of {', '.join(COMPUTE_DTYPES)} (got {self.compute_dtype!r})"
            )
        if not isinstance(self.remat, bool):
            raise ModelError(f"model.remat must be true or false (got {self.remat!r})")
        if self.top_k > self.n_experts:
            raise ModelError(f"model.top_k ({self.top_k}) must be <= model.n_experts ({self.n_experts})")
        # Normalise TOML ints (`init_scale = 1`) to floats so equal configs compare and hash equal.
        object.__setattr__(
            self, "aux_loss_weight", _check_float("aux_loss_weight", self.aux_loss_weight, positive=False)
        )
        object.__setattr__(self, "init_scale", _check_float("init_scale", self.init_scale, positive=True))
