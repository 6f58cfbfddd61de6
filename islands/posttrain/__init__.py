"""Post-training (issue 27): what an island fine-tunes on and how its answers are judged.

`data` (the JSON Lines formats of SFT, DPO and RL data and their reader), `task` (built-in tasks whose answers a
program checks, which make such data with no download), `rewards` (a reward function from a task or a user's module,
and scoring answers with it) and `accuracy` (exact match and preference accuracy). These four are pure Python and
NumPy: they load without JAX.

Empty of imports, so that importing one of them loads no other.
"""
