"""Post-training workloads end to end (docs/architecture.md, "Workloads"): in `diloco simulate`, SFT, then DPO and RL
warm-started from it, each improving its own held-out figure on the built-in task; a mixed run (one island sft, one
rl) that resumes bit for bit; the sync baseline on examples; a bad file, reward or reference as one line. And a
federation of processes, one island sft and one rl, that ends with simulate's parameters."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import pytest

from diloco.config import load_config
from diloco.harness.procs import Federation
from diloco.run.rundir import read_events
from diloco.simulator.simulate import run_simulation
from tests.conftest import FAST, WAIT_S, cut_after_round, fails, run_cli

pytestmark = pytest.mark.slow

TASK = [
    "workload.task=addition",
    "workload.task_digits=2",
    "workload.task_examples=2000",
    "workload.heldout_examples=32",
    "workload.max_new_tokens=4",
]
"""Two-digit sums: the format (digits, then the newline) is learnt in a few rounds, the sums themselves are not."""
SIZE = ["model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.d_ff=128", "train.batch_size=16"]
"""A model that learns them in seconds (the tiny config's is too small to)."""
RL = ["workload.kind=rl", "workload.reward=builtin:addition", "inner.warmup_steps=0", "inner.lr=1e-3"]


def simulate(config: Path, run_dir: Path, *overrides: str) -> dict:
    return run_simulation(load_config(config, [*SIZE, *TASK, *overrides]), run_dir, show_progress=False)


@pytest.fixture(scope="module")
def sft(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """An SFT run from the random init: the start of DPO and RL."""
    from tests.conftest import TINY_TOML, write_corpus

    tmp = tmp_path_factory.mktemp("sft")
    config = tmp / "tiny.toml"
    config.write_text(TINY_TOML.format(corpus=write_corpus(tmp / "corpus.txt")))
    run_dir = tmp / "sft"
    return run_dir, simulate(config, run_dir, "workload.kind=sft", "train.rounds=2", "train.inner_steps=20")


def test_sft_learns_the_answers(sft: tuple[Path, dict]) -> None:
    run_dir, summary = sft
    assert summary["workload"] == "sft"
    first, last = summary["initial_scores"], summary["final_scores"]
    assert summary["initial_eval_loss"] == first["sft_ce"] and summary["final_eval_loss"] == last["sft_ce"]
    assert last["sft_ce"] < first["sft_ce"] - 3.0  # from about uniform over 256 bytes (5.5 nats) to the digits
    assert first["sft_exact_match"] == 0.0 and 0.0 <= last["sft_exact_match"] <= 1.0
    rounds = read_events(run_dir / "metrics.jsonl", "round")
    assert [r["scores"]["sft_ce"] for r in rounds][-1] == last["sft_ce"]


def test_sample_ends_a_post_training_run_s_answer_at_its_stop(
    sft: tuple[Path, dict], capsys: pytest.CaptureFixture[str]
) -> None:
    from diloco.cli import main

    def sampled(*extra: str) -> dict:
        args = ["sample", str(sft[0]), "--prompt", "12+34=", "--temperature", "0", "--max-new-tokens", "8", "--json"]
        assert main([*args, *extra]) == 0
        return json.loads(capsys.readouterr().out)

    out = sampled()
    (answer,) = out["samples"]
    assert out["stop"] == "\n" and "\n" not in answer["continuation"]
    ended = answer["tokens"][-1] == ord("\n")  # a newline ends it, else it ran to --max-new-tokens
    assert len(answer["tokens"]) < 8 if ended else len(answer["tokens"]) == 8
    assert answer["continuation"] == bytes(answer["tokens"][:-1] if ended else answer["tokens"]).decode()
    digit = answer["continuation"][:1] or "0"
    assert sampled("--stop", digit)["samples"][0]["tokens"][-1] == ord(digit)  # another stop, one byte here


def test_dpo_from_sft_prefers_the_right_answers(sft: tuple[Path, dict], tiny_config: Path, tmp_path: Path) -> None:
    summary = simulate(tiny_config, tmp_path / "dpo", f"init.from={sft[0]}", "workload.kind=dpo", "train.rounds=3",
                       "train.inner_steps=20")  # fmt: skip
    first, last = summary["initial_scores"], summary["final_scores"]
    assert first["dpo_loss"] == pytest.approx(math.log(2.0), abs=1e-6)  # θ_0 is the reference
    assert first["dpo_accuracy"] == 0.0  # a margin of exactly 0 prefers nothing
    assert last["dpo_accuracy"] > 0.5 and last["dpo_loss"] < first["dpo_loss"]
    inner = read_events(tmp_path / "dpo" / "metrics.jsonl", "inner")
    assert inner and all(set(e) >= {"loss", "accuracy"} and 0.0 <= e["accuracy"] <= 1.0 for e in inner)
    assert inner[-1]["accuracy"] > inner[0]["accuracy"]  # the training batches' own preference accuracy rises


def test_rl_from_sft_raises_the_reward(sft: tuple[Path, dict], tiny_config: Path, tmp_path: Path) -> None:
    summary = simulate(tiny_config, tmp_path / "rl", f"init.from={sft[0]}", *RL, "train.rounds=2",
                       "train.inner_steps=20", "workload.group_size=8", "train.batch_size=32")  # fmt: skip
    first, last = summary["initial_scores"], summary["final_scores"]
    assert summary["initial_eval_loss"] == -first["rl_reward"]
    assert last["rl_reward"] > first["rl_reward"]
    inner = read_events(tmp_path / "rl" / "metrics.jsonl", "inner")  # the sampled answers' reward, step by step
    assert len(inner) == 2 * 20 // 2 * 2  # 2 rounds of 20 steps, an event every 2nd step (log_every), 2 islands
    assert all(0.0 <= e["reward"] <= 1.0 and e["kl"] >= 0.0 for e in inner)


def test_a_mixed_run_trains_both_kinds_and_resumes_bit_for_bit(tiny_config: Path, tmp_path: Path) -> None:
    mixed = ["workload.kind=sft", "workload.reward=builtin:addition", 'workload.islands=["island-1=rl"]',
             "train.rounds=2"]  # fmt: skip
    whole = simulate(tiny_config, tmp_path / "whole", *mixed)
    assert set(whole["final_scores"]) == {"sft_ce", "sft_exact_match", "rl_reward", "rl_exact_match"}
    assert whole["final_eval_loss"] == whole["final_scores"]["sft_ce"]  # workload.kind's figure
    rounds = read_events(tmp_path / "whole" / "metrics.jsonl", "round")
    assert [r["islands"] for r in rounds] == [["island-0", "island-1"]] * 2
    # An rl island resamples what it would have: its answers are a pure function of θ and the batch index
    simulate(tiny_config, tmp_path / "cut", *mixed)
    cut_after_round(tmp_path / "cut", 1)
    resumed = simulate(tiny_config, tmp_path / "cut", *mixed)
    assert resumed["params_digest"] == whole["params_digest"]


def test_the_sync_baseline_trains_on_examples(tiny_config: Path, tmp_path: Path) -> None:
    summary = simulate(tiny_config, tmp_path / "sync", "train.mode=sync", "workload.kind=sft", "train.rounds=2")
    assert summary["mode"] == "sync" and summary["final_scores"]["sft_ce"] < summary["initial_scores"]["sft_ce"]


def test_a_tokens_run_post_trains_through_its_tokenizer(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """data.kind = "tokens": examples, answers and the stop are the BPE tokenizer's ids (sums merged into tokens of
    several digits), and an sft and an rl island train and are scored through it."""
    from tokenizers import Tokenizer

    from diloco.cli import main
    from diloco.run.posttrain import PostTraining
    from islands.posttrain.task import Addition
    from tests.conftest import TINY_TOML, write_corpus

    corpus = write_corpus(tmp_path / "corpus.txt")
    corpus.write_text(corpus.read_text() + "\n" + Addition(seed=1).pretraining_text(3000))  # digits worth merging
    prepared = tmp_path / "prepared"
    assert main(["data", "prepare", str(corpus), "--out", str(prepared), "--train-vocab", "400", "--no-progress"]) == 0
    capsys.readouterr()
    config = tmp_path / "tiny.toml"
    config.write_text(TINY_TOML.format(corpus=prepared))
    overrides = ["data.kind=tokens", "model.vocab_size=400", "workload.kind=sft", "workload.reward=builtin:addition",
                 'workload.islands=["island-1=rl"]', "train.rounds=1", "train.inner_steps=4"]  # fmt: skip
    cfg = load_config(config, [*SIZE, *TASK, *overrides])
    tokenizer = Tokenizer.from_file(str(prepared / "tokenizer.json"))
    codec = PostTraining(cfg, init_params=None).codec
    assert codec.codec.kind == "tokenizer" and codec.stop == tokenizer.token_to_id("Ċ")  # the newline's one token
    assert codec.encode("37+48=") == tokenizer.encode("37+48=", add_special_tokens=False).ids
    assert len(codec.encode("37+48=85")) < len("37+48=85")  # merged: not one id per byte
    summary = run_simulation(cfg, tmp_path / "run", show_progress=False)
    assert set(summary["final_scores"]) == {"sft_ce", "sft_exact_match", "rl_reward", "rl_exact_match"}
    assert summary["final_scores"]["sft_ce"] < summary["initial_scores"]["sft_ce"]
    rl_steps = [e for e in read_events(tmp_path / "run" / "metrics.jsonl", "inner") if e["island"] == "island-1"]
    assert rl_steps and all(0.0 <= e["reward"] <= 1.0 for e in rl_steps)


def test_bad_examples_rewards_and_references_are_one_line(
    tiny_config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    base = ["simulate", str(tiny_config), "--no-progress", "--run-dir"]
    bad = tmp_path / "sft.jsonl"
    bad.write_text('{"prompt": "1+2=", "response": "3"}\n{"prompt": "2+2="}\n')
    fails(capsys, [*base, str(tmp_path / "a"), "workload.kind=sft", f"workload.path={bad}"],
          f"{bad}:2: missing field 'response'")  # fmt: skip
    few = tmp_path / "few.jsonl"
    few.write_text('{"prompt": "1+2=", "response": "3"}\n')
    fails(capsys, [*base, str(tmp_path / "b"), "workload.kind=sft", f"workload.path={few}"],
          "workload.heldout_examples (64) of them are held out with every example that shares their prompts: none is "
          "left to train on")  # fmt: skip
    long = tmp_path / "long.jsonl"
    long.write_text("".join(json.dumps({"prompt": f"{i}=", "response": "x" * 9}) + "\n" for i in range(70)))
    fails(capsys, [*base, str(tmp_path / "c"), "workload.kind=sft", f"workload.path={long}",
                   "workload.max_new_tokens=4"], "more than workload.max_new_tokens (4)")  # fmt: skip
    (tmp_path / "badreward.py").write_text("def boom(prompt, answer):\n    raise ValueError('no reward today')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    fails(capsys, [*base, str(tmp_path / "d"), *TASK, *RL, "workload.reward=badreward:boom"],
          "reward badreward:boom on prompt")  # fmt: skip
    fails(capsys, [*base, str(tmp_path / "e"), *TASK, "workload.kind=dpo", f"workload.reference={tmp_path / 'nope'}"],
          f"workload.reference: '{tmp_path / 'nope'}' does not exist")  # fmt: skip


def test_a_reward_that_never_returns_stops_the_process_with_one_line(tiny_config: Path, tmp_path: Path) -> None:
    """A real `diloco simulate` process whose reward hangs: it exits (the stuck call's thread does not hold it) with
    exit code 2 and one line naming the prompt, and no checkpoint holds a step trained on a missing reward."""
    (tmp_path / "hangs.py").write_text(
        "import threading\n\ndef forever(prompt, answer):\n    threading.Event().wait()\n"
    )
    run_dir = tmp_path / "run"
    done = run_cli("simulate", str(tiny_config), "--no-progress", "--run-dir", str(run_dir), *SIZE, *TASK, *RL,
                   "workload.reward=hangs:forever", "workload.reward_timeout=1", cwd=tmp_path)  # fmt: skip
    assert done.returncode == 2, done.stderr
    err = done.stderr.strip()
    assert err.startswith("diloco: error: reward hangs:forever on prompt '") and "\n" not in err, err
    assert err.endswith("did not return within 1 s (workload.reward_timeout)"), err
    assert list(run_dir.glob("checkpoints/*/*")) == []  # no round ended, so nothing was committed


@pytest.mark.multiprocess
def test_a_federation_of_sft_and_rl_islands_ends_with_simulate_s_digest(
    federation: Callable[..., Federation], tiny_config: Path, tmp_path: Path
) -> None:
    """`diloco coordinator` and two `diloco island` processes, island-0 on sft and island-1 on rl (its answers sampled
    in its own process), end with the parameters `simulate` ends with: the same batches, the same samples, the same
    floats."""
    overrides = ["train.rounds=2", "quorum.min_islands=2", *TASK, "workload.kind=sft",
                 "workload.reward=builtin:addition", 'workload.islands=["island-1=rl"]']  # fmt: skip
    fed = federation(*overrides)
    fed.start_coordinator()
    for name in ("island-0", "island-1"):
        fed.start_island(name)
    fed.wait_exit(WAIT_S)
    launched = json.loads((fed.run_dir / "summary.json").read_text())
    simulated = run_simulation(load_config(tiny_config, [*FAST, *overrides]), tmp_path / "sim", show_progress=False)
    assert launched["rounds"] == simulated["rounds"] == 2
    assert launched["params_digest"] == simulated["params_digest"]
    assert launched["final_scores"] == pytest.approx(simulated["final_scores"], rel=1e-6)
    for name in ("island-0", "island-1"):
        synced = read_events(fed.island_dir(name) / "metrics.jsonl", "synced")
        assert synced[-1]["digest"] == simulated["params_digest"]
