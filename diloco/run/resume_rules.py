"""What may change when a run directory resumes, and what may not (docs/architecture.md "A run that changes on resume").

A run directory holds one run: its config.toml is the run's identity. Resuming it with a different config is one
of two things. A change that leaves what the run has learned meaningful (its length, who takes part, how it waits,
links, logging) is the same run going on: it is accepted, logged as a `config_changed` event with the old and new
value of every changed key, and written back to config.toml. A change that would make the saved state mean
something else (the model, the data and its order, the seed, the optimizers' hyper-parameters that the saved
moments were taken under, the codecs whose residuals are saved in their terms) starts another run: it is refused
with one line naming the keys.

`MAY_CHANGE` is the table; README's copy is checked against it (tests/test_resume_rules.py). A key is matched
exactly or by its section (`"quorum"` covers every `quorum.*` key). Every key not in the table may not change, so
a key added later is refused on resume until someone decides otherwise here. A key of `SAME_CONTENT` names a file:
what the run depends on is the file's bytes, not its path, so another path to the same bytes (a checkpoint
directory moved) is a change like those of the table, and other bytes are refused.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

MAY_CHANGE: dict[str, str] = {
    "run.name": "a label",
    "train.rounds": 'the run\'s length: lengthen a run (or end it sooner); pair with inner.schedule = "wsd"',
    "train.checkpoint_every": "how often state is saved",
    "train.log_every": "how often inner losses are logged",
    "train.eval_batches": "how much held-out data each evaluation reads",
    "train.round_seconds": "time-budgeted rounds' budget",
    "init": "read only when a run starts: a resuming run continues from its own checkpoints",
    "inner.decay_start_step": "start the warmup-stable-decay decay once the run's length is known",
    "inner.decay_steps": "the decay's length",
    "outer.aggregate": "robust aggregation, turned on or changed when islands misbehave",
    "outer.norm_bound": "robust aggregation's bound",
    "outer.trim": "robust aggregation's trim",
    "islands.count": "the configured roster (islands admitted while the run goes on need no change)",
    "islands.names": "the configured roster",
    "islands.devices": "an island's device count (its batch is kept by gradient accumulation)",
    "islands.tensor": "an island's tensor split (its checkpoint is restored into the new layout)",
    "islands.slowdown": "emulated slow islands",
    "islands.device_step_s": "emulated device-bound steps",
    "islands.max": "the roster's bound",
    "islands.admissions_per_minute": "the admission rate's bound",
    "islands.retire_after_s": "when a lost island is retired",
    "codec.zstd_level": "entropy coding of the same quantized bytes",
    "quorum": "who a round waits for and how long",
    "network": "links, secrets (rotated) and waits",
    "transport": "the wire's bounds and timeouts",
}


SAME_CONTENT: dict[str, str] = {
    "data.tokenizer": "the run's tokenizer.json (a checkpoint's, by default): its ids are what the model learned",
}


class ResumeRefused(ValueError):
    """The resumed config changes keys that may not change (their dotted names in `keys`)."""

    def __init__(self, keys: list[str]) -> None:
        self.keys = keys
        super().__init__(", ".join(keys))


def may_change(key: str) -> bool:
    """Whether the dotted config key may take another value when a run resumes."""
    section = key.split(".", 1)[0]
    return key in MAY_CHANGE or section in MAY_CHANGE


def lookup(config: dict[str, Any], key: str) -> Any:
    """The value of a dotted key in a config dict (None where absent)."""
    value: Any = config
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def resume_changes(
    stored: dict[str, Any], resumed: dict[str, Any], differing: list[str], same_content: Collection[str] = ()
) -> dict[str, list[Any]]:
    """`{key: [old, new]}` for the differing keys of a resumed config, all of which may change; `ResumeRefused`
    naming those that may not otherwise. `same_content`: the keys of `SAME_CONTENT` whose files hold the same bytes
    at their new paths as at their old ones (the caller reads the files)."""
    refused = [key for key in differing if not may_change(key) and not (key in SAME_CONTENT and key in same_content)]
    if refused:
        raise ResumeRefused(refused)
    return {key: [lookup(stored, key), lookup(resumed, key)] for key in differing}
