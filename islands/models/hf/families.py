"""Which family module reads a Hugging Face checkpoint (by config.json's `architectures`) or writes a `[model]`
(by model.kind), and the `[model]` section of a run that starts from a checkpoint.

A family module (`llama`, `gpt2`) has: ARCHITECTURES (architecture -> model_type), `model_section(config,
architecture, error, where)` (the [model] keys config.json fixes), `architecture_of(model)`, `config_json(model,
architecture)`, `rules(model, architecture)` (islands/models/hf/tensors.py), `ignored(model)` (checkpoint tensors the
model does not read) and `complete(params, model)` (leaves an export needs that the model lacks).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, fields
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from islands.models.config import ModelConfig, ModelError
from islands.models.hf import gpt2, llama, tensors
from islands.models.hf.checkpoint import CONFIG, Checkpoint, CheckpointError, read_config
from islands.models.hf.tensors import Rule

FAMILIES: tuple[ModuleType, ...] = (llama, gpt2)
ARCHITECTURES: dict[str, ModuleType] = {name: family for family in FAMILIES for name in family.ARCHITECTURES}
"""Every architecture that imports, and its family module."""

KINDS: dict[str, ModuleType] = {"llama": llama, "llama_moe": llama, "transformer": gpt2}
"""model.kind -> the family module that exports it (kinds moe and custom have no Hugging Face architecture)."""

EQUIVALENT_ZERO = ("n_kv_heads", "head_dim")
"""[model] keys whose 0 means "what d_model and n_heads give" (a run config that writes 0 agrees with any value that
equals it)."""


def architecture(config: dict[str, Any], where: str) -> str:
    """config.json's one architecture, refused in one line unless it is one that imports."""
    names = config.get("architectures")
    if not isinstance(names, list) or len(names) != 1 or not isinstance(names[0], str):
        raise CheckpointError(f"{where} must list one architecture in 'architectures' (got {names!r})")
    if names[0] not in ARCHITECTURES:
        raise CheckpointError(
            f"{where}: architecture {names[0]!r} is not supported (supported: {', '.join(sorted(ARCHITECTURES))})"
        )
    return names[0]


def checkpoint_model(config: dict[str, Any], where: str) -> dict[str, Any]:
    """The [model] keys that a checkpoint's config.json fixes, validated as a ModelConfig of them would be."""
    name = architecture(config, where)
    try:
        section = ARCHITECTURES[name].model_section(config, name, CheckpointError, where)
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, CheckpointError):
            raise
        raise CheckpointError(f"{where} does not describe a {name} ({type(exc).__name__}: {exc})") from None
    return section


def merged_model(user: dict[str, Any], directory: Path) -> dict[str, Any]:
    """The [model] section of a run whose init.from is the Hugging Face directory `directory`: the keys its config.json
    fixes, then the run config's others (seq_len, compute_dtype, remat, ...). A key the run config sets to another
    value than config.json's is one line naming both."""
    where = f"init.from's config.json ('{directory / CONFIG}')"
    fixed = checkpoint_model(read_config(directory, "init.from"), where)
    known = {f.name for f in fields(ModelConfig)}
    for key, value in user.items():
        if key not in fixed or key not in known:
            continue  # the run's own key (or a typo, which the config loader names)
        if value != fixed[key] and not (key in EQUIVALENT_ZERO and value == 0):
            raise CheckpointError(f"model.{key} is {value!r} in the run config, but {where} gives {fixed[key]!r}")
    return {**user, **fixed}


def family_of(model: ModelConfig) -> ModuleType:
    """The family module that exports `model`; a ModelError naming model.kind when none does."""
    if model.kind not in KINDS:
        raise ModelError(f"model.kind = {model.kind!r} has no Hugging Face architecture (export the project's format)")
    return KINDS[model.kind]


@dataclass(frozen=True)
class Import:
    """A Hugging Face checkpoint checked against the model a run builds from it (`open_import`), ready to `read`."""

    checkpoint: Checkpoint
    rules: list[Rule]
    shapes: dict[str, tuple[int, ...]]
    located: dict[str, str]
    """The rules' tensor names -> the checkpoint's (`tensors.check`)."""

    def leaves(self) -> Iterator[tuple[str, np.ndarray]]:
        """Every leaf, float32, named as pytrees/naming.py names it, each as soon as it is whole (`tensors.read`)."""
        return tensors.read(self.checkpoint, self.rules, self.shapes, self.located)

    def read(self) -> dict[str, np.ndarray]:
        """Every leaf at once (for a caller that keeps them all as host arrays anyway)."""
        return dict(self.leaves())


def open_import(directory: Path, model: ModelConfig, shapes: dict[str, tuple[int, ...]], where: str) -> Import:
    """The checkpoint at `directory` checked, before any tensor's bytes are read, against `model` (whose leaves have
    `shapes`): its index, every shard's header, every tensor's name, shape and dtype; each problem one line."""
    checkpoint = Checkpoint.open(directory, where)
    name = architecture(checkpoint.config, f"{where}'s config.json ('{directory / CONFIG}')")
    family = ARCHITECTURES[name]
    rules = family.rules(model, name)
    what = f"the {name} that config.json describes"
    located = tensors.check(checkpoint, rules, shapes, what, family.ignored(model), where)
    return Import(checkpoint, rules, shapes, located)
