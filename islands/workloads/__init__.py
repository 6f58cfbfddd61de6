"""Workloads (issue 27): what an island minimizes. `lm` is next-token loss on a corpus (islands/data.py, the model's
own loss); the post-training workloads fine-tune the same parameters on examples instead: `sft` (prompt and response,
the loss on the response), `dpo` (preference pairs against a frozen reference) and `rl` (group-relative policy
optimization on a reward).

`config` is the `[workload]` section (JAX-free); `text` adds the stop token to the run's text codec (islands/text.py);
`batches` makes fixed-shape batches of examples and the streams an island draws them from; `rollouts` rl's on-policy
batches; `losses` the post-training losses; `evaluate` their held-out evaluation. The outer loop sees none of it: a
workload changes only an island's batches and its loss.

Empty of imports, so that loading the config section loads nothing else.
"""
