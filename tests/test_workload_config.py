"""The `[workload]` section: its defaults leave a run as it was, and every bad setting is one line naming the key."""

from __future__ import annotations

import pytest

from diloco.config import ConfigError, load_config, to_dict
from islands.workloads.config import IslandWorkload, WorkloadConfig

BASE = ["data.kind=synthetic", "islands.names=[a,b]"]


def test_the_default_is_today_s_run() -> None:
    cfg = load_config(None, BASE)
    assert cfg.workload == WorkloadConfig()
    assert cfg.workload.kind == "lm" and not cfg.workload.post_training(("a", "b"))
    assert cfg.workload.of("a") == IslandWorkload("lm")
    assert to_dict(cfg)["workload"]["kind"] == "lm"


def test_mixed_workloads_name_each_island_s_kind_and_file() -> None:
    cfg = load_config(
        None,
        [*BASE, "workload.kind=sft", "workload.path=sft.jsonl", "workload.reward=builtin:addition",
         'workload.islands=["b=rl:prompts.jsonl"]'],
    )  # fmt: skip
    assert cfg.workload.of("a") == IslandWorkload("sft", "sft.jsonl")
    assert cfg.workload.of("b") == IslandWorkload("rl", "prompts.jsonl")
    assert cfg.workload.of("admitted") == IslandWorkload("sft", "sft.jsonl")  # not configured: workload.kind
    assert cfg.workload.kinds(("a", "b")) == ("sft", "rl")
    task = load_config(None, [*BASE, "workload.kind=lm", "workload.task=addition", 'workload.islands=["b=sft"]'])
    assert task.workload.of("a") == IslandWorkload("lm") and task.workload.of("b") == IslandWorkload("sft")


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["workload.kind=ppo"], "workload.kind must be one of lm, sft, dpo, rl (got 'ppo')"),
        (["workload.kind=sft"], "workload.kind = 'sft' needs its examples: set workload.path or workload.task"),
        (["workload.kind=dpo", "workload.task=addition", "workload.beta=0"], "workload.beta must be a finite number > 0"),
        (["workload.kind=rl", "workload.task=addition"], "workload.reward must be set for workload.kind = \"rl\""),
        (["workload.kind=rl", "workload.task=addition", "workload.reward=nocolon"], "workload.reward 'nocolon' must be"),
        (["workload.kind=rl", "workload.task=addition", "workload.reward=builtin:addition", "workload.group_size=1"],
         "workload.group_size must be >= 2"),
        (["workload.kind=sft", "workload.task=addition", "workload.path=x.jsonl"], "workload.path and workload.task"),
        (["workload.path=x.jsonl"], "workload.path holds workload.kind's examples"),
        (["workload.task=addition"], "every island runs workload.kind = \"lm\""),
        (['workload.islands=["c=sft"]', "workload.task=addition"], "workload.islands names c, not in islands.names"),
        (['workload.islands=["a=ppo"]'], "workload.islands entry 'a=ppo' must be NAME=KIND or NAME=KIND:PATH"),
        (['workload.islands=["a=sft", "a=dpo"]', "workload.task=addition"], "workload.islands names island a twice"),
        (['workload.islands=["a=sft"]'], "workload.islands entry for a runs 'sft' without examples"),
        (["workload.kind=sft", "workload.task=addition", "model.kind=custom", "model.entry=m:f"],
         'model.kind must be "transformer", "moe", "llama" or "llama_moe"'),
        (["workload.kind=sft", "workload.task=addition", "train.vectorize=true"],
         'train.vectorize = true steps every island in one program: every island must run workload.kind = "lm"'),
        (["workload.kind=sft", "workload.task=addition", "data.sampling=chunks"], 'data.sampling = "chunks"'),
        (["workload.kind=rl", "workload.task=addition", "workload.reward=builtin:addition", "train.batch_size=6"],
         "train.batch_size (6) must be a multiple of workload.group_size (4)"),
        (["workload.kind=rl", "workload.task=addition", "workload.reward=builtin:addition", "workload.max_new_tokens=64"],
         "workload.max_new_tokens (64) must be below model.seq_len (64)"),
        (["workload.kind=rl", "workload.task=addition", "workload.reward=builtin:addition", "workload.top_p=0"],
         "workload.top_p must be in (0, 1]"),
        (["workload.temperature=-1"], "workload.temperature must be a finite number >= 0"),
        (["workload.kl_coef=-0.1"], "workload.kl_coef must be a finite number >= 0"),
        (["workload.reference="], 'workload.reference must be "start"'),
        (["workload.heldout_examples=0"], "workload.heldout_examples must be >= 1"),
        (["workload.kind=sft", "workload.task=sums"], "workload.task must be one of addition (got 'sums')"),
        (["workload.task_digits=10"], "workload.task_digits must be from 1 to 9"),
        (["workload.reward_timeout=-1"], "workload.reward_timeout must be a finite number of seconds >= 0"),
    ],
)  # fmt: skip
def test_a_bad_workload_is_one_line_naming_the_key(overrides: list[str], expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, [*BASE, *overrides])
    message = str(info.value)
    assert expected in message and "\n" not in message, message
