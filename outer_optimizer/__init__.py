"""Pure functions of the outer loop: pseudo-gradient aggregation and outer optimizers (optax transforms)."""

from outer_optimizer.aggregate import pseudo_gradient, weighted_mean
from outer_optimizer.optimizers import OUTER_OPTIMIZERS, OuterConfig, apply_update, make_outer_step

__all__ = [
    "OUTER_OPTIMIZERS",
    "OuterConfig",
    "apply_update",
    "make_outer_step",
    "pseudo_gradient",
    "weighted_mean",
]
