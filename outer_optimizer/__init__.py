"""Pure functions of the outer loop: pseudo-gradient aggregation, outer optimizers (optax transforms) and the
asynchronous mode's staleness weighting."""

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
from outer_optimizer.asynchronous import (
    DelayedNesterovState,
    delayed_nesterov,
    discount,
    staleness_weight,
    valid_staleness_exponent,
)
from outer_optimizer.optimizers import OUTER_OPTIMIZERS, OuterConfig, apply_update, make_outer_step

__all__ = [
    "OUTER_OPTIMIZERS",
    "RULES",
    "Aggregated",
    "DelayedNesterovState",
    "OuterConfig",
    "Rule",
    "apply_update",
    "delayed_nesterov",
    "discount",
    "make_outer_step",
    "make_rule",
    "mean",
    "median",
    "norm_clip",
    "pseudo_gradient",
    "staleness_weight",
    "trim_count",
    "trimmed_mean",
    "valid_staleness_exponent",
    "weighted_mean",
]
