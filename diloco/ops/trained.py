"""A run directory's trained model, for the commands that use one (`diloco sample`, `diloco export`).

Its newest committed global θ is the one `init.from` would start another run from (diloco/run/warm_start.py:
`find_source`, `read_item`): the newest complete step of checkpoints/coordinator (simulate, launch, a coordinator) or
checkpoints/sync (the data-parallel baseline), or the checkpoint directory or step given instead. Its model, data and
islands sections come from the run's config.toml (`stored_section`), and its text codec from the data section
(islands/text.py). A run from a Hugging Face checkpoint reads the checkpoint's tokenizer from RUN/hf/, where the run
copied it when it started (`kept_tokenizer`), so a finished run decodes wherever the checkpoint has gone since.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import jax

from diloco.config import ConfigError, InitConfig, IslandsConfig, load_config
from diloco.run.warm_start import WarmStartError, find_source, lora_base, read_item, stored_section
from islands.data import DataConfig
from islands.models.config import ModelConfig
from islands.models.hf.checkpoint import kept_tokenizer_file
from islands.models.lora import Lora
from islands.models.registry import build_model
from islands.workloads.config import WorkloadConfig
from pytrees.digest import tree_digest
from pytrees.naming import PyTree


@dataclass(frozen=True)
class Trained:
    """What a run made: its model config and the newest committed θ, with where it came from."""

    run_dir: Path
    """The run directory (the nearest directory with a config.toml above the checkpoint)."""
    step_dir: Path
    """The checkpoint step θ was read from."""
    round: int
    """The rounds (asynchronous mode: updates) the run had committed when it saved θ: the step's number."""
    model: ModelConfig
    data: DataConfig
    islands: IslandsConfig
    workload: WorkloadConfig
    """What its islands minimized ([workload]; the default, lm, for a run older than the section)."""
    params: PyTree
    """The model's parameters as host (numpy) float32 arrays in the model's pytree: θ, or with workload.lora the
    adapters merged into their base."""
    adapters: PyTree = None
    """workload.lora: θ, the adapters (host arrays, islands/models/lora.py's pytree); None without LoRA."""

    @property
    def digest(self) -> str:
        """θ's digest, as the run's `round` events and summary.json's params_digest give it (pytrees/digest.py): the
        adapters' with workload.lora."""
        return tree_digest(self.params if self.adapters is None else self.adapters)


def load_trained(path: Path, where: str = "RUN_DIR") -> Trained:
    """The newest committed θ of the run directory (or checkpoint directory, or step) `path`; `where` names the path
    in a refusal: one that holds no committed θ, or no config.toml to say which model it is."""
    source = find_source(path.expanduser(), where)
    if source.run_dir is None:
        raise WarmStartError(
            f"{where}: '{source.step_dir}' has no config.toml in the three directories above it, so its model is "
            "unknown: give the run directory"
        )
    model = stored_section(source.run_dir, ModelConfig, "model", where)
    init = stored_section(source.run_dir, InitConfig, "init", where)
    data = kept_tokenizer(stored_section(source.run_dir, DataConfig, "data", where), init, source.run_dir)
    islands = stored_section(source.run_dir, IslandsConfig, "islands", where)
    workload = stored_section(source.run_dir, WorkloadConfig, "workload", where)
    if workload.lora.enabled:
        lora = lora_of(source.run_dir, where)
        like = jax.eval_shape(lora.init, jax.random.key(0))
        adapters = jax.device_get(read_item(source.step_dir, "params", like, "parameters", where))
        params = jax.device_get(lora.merged(adapters))
        return Trained(source.run_dir, source.step_dir, source.round, model, data, islands, workload, params, adapters)
    like = jax.eval_shape(build_model(model).init, jax.random.key(0))
    params = read_item(source.step_dir, "params", like, "parameters", where)
    return Trained(source.run_dir, source.step_dir, source.round, model, data, islands, workload, params)


def lora_of(run_dir: Path, where: str) -> Lora:
    """The frozen base and adapter layout of a run with workload.lora, as its islands built them: its config.toml's
    init.from (or the random init of its run.seed) through `lora_base`, which must still be where the run read it."""
    try:
        cfg = load_config(run_dir / "config.toml")
    except (OSError, ConfigError) as exc:
        raise WarmStartError(f"{where}: '{run_dir}/config.toml' does not load ({exc})") from None
    spec = cfg.workload.lora
    base = lora_base(cfg, build_model(cfg.model).init(jax.random.key(cfg.run.seed)))
    return Lora.over(base, spec.rank, spec.alpha, spec.targets, spec.base_dtype)


def kept_tokenizer(data: DataConfig, init: InitConfig, run_dir: Path) -> DataConfig:
    """The run's [data] with its tokenizer read from RUN/hf/ where it is the one of the init.from checkpoint that the
    run copied there (diloco/config.py `with_checkpoint_model` names the checkpoint's own, or the RUN/hf/ one of the
    run init.from names); as stored otherwise."""
    kept = kept_tokenizer_file(run_dir, data.tokenizer, init.from_)
    return data if kept is None else dataclasses.replace(data, tokenizer=str(kept))
