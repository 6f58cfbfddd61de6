"""Pure functions of the outer loop: pseudo-gradient aggregation and outer optimizers (optax transforms)."""

from outer_optimizer.aggregate import (
    RULES,
    Aggregated,
    Rule,
    make_rule,
    mean,
    median,
    norm_clip,
    pseudo_gradient,
    trim_count,
    trimmed_mean,
    weighted_mean,
)
from outer_optimizer.optimizers import OUTER_OPTIMIZERS, OuterConfig, apply_update, make_outer_step

__all__ = [
    "OUTER_OPTIMIZERS",
    "RULES",
    "Aggregated",
    "OuterConfig",
    "Rule",
    "apply_update",
    "make_outer_step",
    "make_rule",
    "mean",
    "median",
    "norm_clip",
    "pseudo_gradient",
    "trim_count",
    "trimmed_mean",
    "weighted_mean",
]
