"""Pure functions of the outer loop: `aggregate` (pseudo-gradients into one Δ), `optimizers` (outer optimizers as
optax transforms, the one float add every replica performs), `asynchronous` (staleness weighting, Delayed
Nesterov), `fragments` (Streaming DiLoCo's schedule) and `config` (the `[outer]` section, JAX-free).

Empty of imports, so that importing one of them (the config loader imports `config` and `fragments`) loads no
other.
"""
