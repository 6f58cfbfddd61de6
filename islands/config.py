"""The `[inner]` section of a run config: the island's inner optimizer (AdamW, its schedule, clipping).

JAX-free, like every config section, so that loading and validating a config does not import JAX
(tests/test_layering.py); `islands/inner.py` builds the optimizer and the step from it.
"""

from __future__ import annotations

from dataclasses import dataclass

SCHEDULES = ("cosine", "wsd")


@dataclass(frozen=True)
class InnerConfig:
    lr: float = 3e-3
    """Peak AdamW learning rate."""
    warmup_steps: int = 100
    """Linear warmup from 0 to lr over this many inner steps."""
    min_lr_ratio: float = 0.1
    """The schedule ends at lr * min_lr_ratio (cosine: after all the run's inner steps; wsd: after its decay)."""
    schedule: str = "cosine"
    """The learning-rate schedule: "cosine" (warmup, then cosine decay over the run's planned inner steps: its shape
    depends on train.rounds) or "wsd" (warmup-stable-decay: warmup, lr held until inner.decay_start_step, then a
    linear decay; its shape does not depend on the planned length, so a run lengthened on resume trains as one
    planned that long from the start, docs/architecture.md "A run that changes on resume")."""
    decay_start_step: int = 0
    """wsd only: the inner step at which the decay starts (round × train.inner_steps for a decay from a round's
    start); 0: not started, lr stays at its peak to the end of the run. May change on resume: the decay phase is
    started explicitly, once the run's length is known."""
    decay_steps: int = 0
    """wsd only: the decay's length in inner steps; 0: to the end of the run (the one part of wsd that reads
    train.rounds, and only once the decay has started)."""
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
        if self.schedule not in SCHEDULES:
            raise ValueError(f"inner.schedule must be one of {', '.join(SCHEDULES)} (got {self.schedule!r})")
        if self.decay_start_step < 0 or self.decay_steps < 0:
            raise ValueError(
                f"inner.decay_start_step and inner.decay_steps must be >= 0 "
                f"(got {self.decay_start_step}, {self.decay_steps})"
            )
        if self.schedule != "wsd" and (self.decay_start_step or self.decay_steps):
            raise ValueError('inner.decay_start_step and inner.decay_steps apply to inner.schedule = "wsd" only')
        if self.decay_start_step and self.decay_start_step < self.warmup_steps:
            raise ValueError(
                f"inner.decay_start_step ({self.decay_start_step}) must be >= inner.warmup_steps "
                f"({self.warmup_steps}): the decay starts after the warmup"
            )
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"inner.min_lr_ratio must be in [0, 1] (got {self.min_lr_ratio})")
        for key in ("b1", "b2"):
            if not 0 <= getattr(self, key) < 1:
                raise ValueError(f"inner.{key} must be in [0, 1) (got {getattr(self, key)})")
        if self.weight_decay < 0 or self.clip_norm < 0 or self.eps <= 0:
            raise ValueError("inner.weight_decay and inner.clip_norm must be >= 0 and inner.eps > 0")
