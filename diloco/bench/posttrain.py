"""`diloco bench posttrain CONFIG --pretrained RUN_DIR`: post-training across islands against one island and
data-parallel training on the same samples, SFT then DPO and RL, scored on the task's whole held-out split.

CONFIG is the SFT stage of a DiLoCo run (configs/addition.toml: its [workload] names the task); the columns see the
same examples per inner step, M islands of batch B:

    diloco   CONFIG as given: M islands, batch B each, the outer loop
    one      islands.count = 1, batch M·B (the same config otherwise: its own outer step every H)
    sync     train.mode = "sync": the M batches' gradients averaged every step, no outer loop

Each column runs SFT from `--pretrained` (init.from), then DPO and RL, each from the column's own SFT run, with the
stage's overrides (`--dpo`, `--rl`; README's by default). The runs are `simulate`'s: a `diloco launch` of the same
config ends with the same digest (benchmarks/log/posttrain.md), so the figures are the federation's.

Every θ (the pre-trained one and each stage's) is then scored on `--heldout` problems of the task's held-out split
(default: all of it, for two-digit addition 1007, against the 64-256 a run's own evaluation reads): exact match and
the mean reward of greedy answers, and DPO's preference accuracy against the column's SFT θ (its reference). The
result holds each run's own before and after (`initial` / `final`), wall time, WAN bytes and digest, the held-out
scores, and per stage DiLoCo's exact match over each baseline's (`ratios`).

With `--lora OVERRIDES` (workload.lora's keys, e.g. "workload.lora.rank=8") it compares LoRA with full fine-tuning
instead (`run_lora_bench`), the DiLoCo column only, every other setting equal and so the same steps:

    sft   full and LoRA from `--pretrained`
    rl    GRPO (the `--rl` settings), full and LoRA, both from the full SFT run (a LoRA run's θ is its adapters, which
          no run starts from: both GRPO runs start from one θ)

Each stage reports the bytes per round (all islands, pushed and pulled) and the held-out scores, and per stage the
LoRA run's over the full run's: bytes per round, exact match and reward (`ratios`).
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from diloco.bench.errors import BenchError
from diloco.config import RunConfig, load_config
from diloco.ops.trained import load_trained
from diloco.run.setup import Evaluator, build_setup
from diloco.simulator.simulate import run_simulation
from islands.posttrain.rewards import BUILTIN
from islands.posttrain.task import builtin_task

COLUMNS = ("diloco", "one", "sync")
"""The columns, in the order they run and print."""

STAGES = ("sft", "dpo", "rl")
"""The stages of each column: sft from the pre-trained θ, dpo and rl from the column's sft."""

DPO_DEFAULT = "workload.kind=dpo workload.sft_weight=1 train.rounds=30 inner.lr=3e-4 inner.warmup_steps=20"
RL_DEFAULT = "workload.kind=rl workload.reward=builtin:addition train.rounds=100 inner.lr=1e-4 inner.warmup_steps=20"
"""README's stage settings (configs/addition.toml's comment)."""

HELDOUT_CAP = 2000
"""The most held-out problems scored by default (a split too large to enumerate is sampled this far)."""


def column_overrides(cfg: RunConfig, column: str) -> list[str]:
    """What turns the DiLoCo config `cfg` into `column`'s, with the same examples per inner step."""
    if column == "diloco":
        return []
    if column == "one":
        first = cfg.islands.island_names[0]
        return [
            "islands.count=1",
            f"islands.names=[{first}]",
            "quorum.min_islands=1",
            f"train.batch_size={cfg.islands.count * cfg.train.batch_size}",
        ]
    if column == "sync":
        return ["train.mode=sync"]
    raise ValueError(f"unknown column {column!r} (one of {', '.join(COLUMNS)})")


def stage_overrides(stage: str, source: Path, dpo: str, rl: str) -> list[str]:
    """A stage's own overrides: where it starts (init.from) and, for dpo and rl, its settings."""
    settings = {"sft": "", "dpo": dpo, "rl": rl}[stage]
    return [f"init.from={source}", *shlex.split(settings)]


def ratio(a: float, b: float) -> float | None:
    """a / b rounded, None where b is 0 (a figure of nothing learnt)."""
    return round(a / b, 4) if b else None


def heldout_count(cfg: RunConfig, asked: int | None) -> int:
    """The held-out problems to score: `asked`, else the whole split (at most HELDOUT_CAP)."""
    if asked is not None:
        if asked < 1:
            raise BenchError(f"--heldout must be >= 1 (got {asked})")
        return asked
    task = builtin_task(cfg.workload.task, cfg.run.seed, cfg.workload.task_digits)
    size = task.split_size("heldout")
    return min(size, HELDOUT_CAP) if size is not None else HELDOUT_CAP


class HeldOutScorer:
    """Scores θs on n held-out problems: greedy exact match and reward (rl's evaluation), DPO's preference accuracy
    against a reference run (dpo's)."""

    def __init__(self, config: str, overrides: Sequence[str], n: int) -> None:
        self.config, self.n = config, n
        base = load_config(config, list(overrides))
        self.common = [*overrides, *column_overrides(base, "one"), f"workload.heldout_examples={n}"]
        self._rl = self._evaluator(["workload.kind=rl", f"workload.reward={BUILTIN}{base.workload.task}"])

    def _evaluator(self, extra: list[str]) -> Evaluator:
        """The evaluation of the config with `extra` overrides (every parameter: a LoRA run is scored merged)."""
        cfg = load_config(self.config, [*self.common, *extra, "workload.lora.rank=0"])
        return Evaluator.of(cfg, build_setup(cfg, islands=()))

    def score(self, run: Path, reference: Path | None) -> dict[str, float]:
        """exact_match and reward of run's newest θ; with a reference run, dpo_accuracy against it too."""
        params = load_trained(run).params  # a LoRA run's adapters merged into their base
        _, out = self._rl.measure(params)
        scores = {"exact_match": out["rl_exact_match"], "reward": out["rl_reward"]}
        if reference is not None:
            dpo = self._evaluator(["workload.kind=dpo", f"workload.reference={reference}"])
            scores["dpo_accuracy"] = dpo.measure(params)[1]["dpo_accuracy"]
        return {k: round(v, 4) for k, v in scores.items()}


def _checked_inputs(config: str, overrides: Sequence[str], pretrained: Path) -> RunConfig:
    """The bench's config, refused in one line without a built-in task or without a pre-trained run directory."""
    base = load_config(config, list(overrides))
    if not base.workload.task:
        raise BenchError(f"{config}: bench posttrain needs a [workload] with a built-in task (workload.task)")
    if not pretrained.is_dir():
        raise BenchError(f"--pretrained '{pretrained}' is not a run directory")
    return base


def run_posttrain_bench(
    config: str,
    overrides: Sequence[str],
    run_dir: Path,
    pretrained: Path,
    dpo: str = DPO_DEFAULT,
    rl: str = RL_DEFAULT,
    heldout: int | None = None,
    columns: Sequence[str] = COLUMNS,
) -> dict[str, Any]:
    """Run every column's stages under run_dir/COLUMN-STAGE, score them, and return the result (module docstring)."""
    base = _checked_inputs(config, overrides, pretrained)
    pretrained = pretrained.resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    n = heldout_count(base, heldout)
    results: dict[str, Any] = {}
    for column in columns:
        per_stage: dict[str, Any] = {}
        for stage in STAGES:
            source = pretrained if stage == "sft" else run_dir / f"{column}-sft"
            extra = [*column_overrides(base, column), *stage_overrides(stage, source, dpo, rl)]
            cfg = load_config(config, [*overrides, *extra])
            summary = run_simulation(cfg, run_dir / f"{column}-{stage}", show_progress=False)
            per_stage[stage] = {
                "overrides": extra,
                "initial": summary["initial_scores"],
                "final": summary["final_scores"],
                "wall_s": summary["wall_s"],
                "bytes_up": summary["bytes_up"],
                "digest": summary["params_digest"],
            }
        results[column] = per_stage
    scorer = HeldOutScorer(config, overrides, n)
    pretrained_scores = scorer.score(pretrained, None)
    for column, per_stage in results.items():
        sft = run_dir / f"{column}-sft"
        for stage, row in per_stage.items():
            row["heldout"] = scorer.score(run_dir / f"{column}-{stage}", sft if stage == "dpo" else None)
    ratios = {
        stage: {
            f"diloco/{other}": ratio(
                results["diloco"][stage]["heldout"]["exact_match"], results[other][stage]["heldout"]["exact_match"]
            )
            for other in results
            if other != "diloco" and "diloco" in results
        }
        for stage in STAGES
    }
    return {
        "config": config,
        "overrides": list(overrides),
        "pretrained": str(pretrained),
        "heldout_problems": n,
        "pretrained_heldout": pretrained_scores,
        "columns": results,
        "ratios": ratios,
        "run_dir": str(run_dir),
    }


LORA_STAGES = ("sft", "rl")
"""The stages `run_lora_bench` compares: SFT, and GRPO from the full SFT run."""


def run_lora_bench(
    config: str,
    overrides: Sequence[str],
    run_dir: Path,
    pretrained: Path,
    lora: str,
    rl: str = RL_DEFAULT,
    heldout: int | None = None,
) -> dict[str, Any]:
    """LoRA (`lora`: workload.lora overrides) against full fine-tuning at equal steps (module docstring)."""
    base = _checked_inputs(config, overrides, pretrained)
    adapters = shlex.split(lora)
    if not load_config(config, [*overrides, *adapters]).workload.lora.enabled:
        raise BenchError(f"--lora {lora!r} leaves workload.lora.rank at 0: give it workload.lora.rank=R")
    pretrained = pretrained.resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    n = heldout_count(base, heldout)
    stages: dict[str, Any] = {}
    for stage in LORA_STAGES:
        source = pretrained if stage == "sft" else run_dir / "full-sft"
        stages[stage] = {}
        for mode, extra in (("full", []), ("lora", adapters)):
            settings = [*stage_overrides(stage, source, "", rl), *extra]
            cfg = load_config(config, [*overrides, *settings])
            summary = run_simulation(cfg, run_dir / f"{mode}-{stage}", show_progress=False)
            stages[stage][mode] = {
                "overrides": settings,
                "trained_params": summary["param_count"],
                "initial": summary["initial_scores"],
                "final": summary["final_scores"],
                "wall_s": summary["wall_s"],
                "bytes_up": summary["bytes_up"],
                "bytes_down": summary["bytes_down"],
                "bytes_per_round": round((summary["bytes_up"] + summary["bytes_down"]) / cfg.train.rounds),
                "digest": summary["params_digest"],
            }
    scorer = HeldOutScorer(config, overrides, n)
    for stage, modes in stages.items():
        for mode, row in modes.items():
            row["heldout"] = scorer.score(run_dir / f"{mode}-{stage}", None)
    ratios = {
        stage: {
            "bytes_per_round": ratio(modes["lora"]["bytes_per_round"], modes["full"]["bytes_per_round"]),
            "exact_match": ratio(modes["lora"]["heldout"]["exact_match"], modes["full"]["heldout"]["exact_match"]),
            "reward": ratio(modes["lora"]["heldout"]["reward"], modes["full"]["heldout"]["reward"]),
        }
        for stage, modes in stages.items()
    }
    return {
        "config": config,
        "overrides": list(overrides),
        "lora": adapters,
        "pretrained": str(pretrained),
        "heldout_problems": n,
        "pretrained_heldout": scorer.score(pretrained, None),
        "stages": stages,
        "ratios": ratios,
        "run_dir": str(run_dir),
    }
