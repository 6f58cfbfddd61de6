"""The `[inner]` section of a run config: the island's inner optimizer (AdamW, its schedule, clipping).

JAX-free, like every config section, so that loading and validating a config does not import JAX
(tests/test_layering.py); `islands/inner.py` builds the optimizer and the step from it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class InnerConfig:
    lr: float = 3e-3
    """Peak AdamW learning rate."""
    warmup_steps: int = 100
    """Linear warmup from 0 to lr over this many inner steps."""
    min_lr_ratio: float = 0.1
    """Cosine decay ends at lr * min_lr_ratio after all the run's inner steps."""
    b1: float = 0.9
    """AdamW β1."""
    b2: float = 0.95
    """AdamW β2."""
    eps: float = 1e-8
    """AdamW ε."""
    weight_decay: float = 0.1
    """Decoupled weight decay (applied to every parameter)."""
    clip_norm: float = 1.0
    """Clip the gradient's global norm to this (0 disables clipping)."""

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"inner.lr must be > 0 (got {self.lr})")
        if self.warmup_steps < 0:
            raise ValueError(f"inner.warmup_steps must be >= 0 (got {self.warmup_steps})")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"inner.min_lr_ratio must be in [0, 1] (got {self.min_lr_ratio})")
        for key in ("b1", "b2"):
            if not 0 <= getattr(self, key) < 1:
                raise ValueError(f"inner.{key} must be in [0, 1) (got {getattr(self, key)})")
        if self.weight_decay < 0 or self.clip_norm < 0 or self.eps <= 0:
            raise ValueError("inner.weight_decay and inner.clip_norm must be >= 0 and inner.eps > 0")
