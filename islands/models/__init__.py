"""The model zoo: `config` (the `[model]` section, JAX-free), `base` (the `Model` contract), `transformer` and
`moe` (the built-in models) and `registry` (`build_model`: a `Model` from a `ModelConfig`, a user's model too).

Empty of imports, so that importing one of them (the config loader imports `config`) loads no other.
"""
