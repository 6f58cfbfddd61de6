"""LoRA (islands/models/lora.py, workload.lora): step 0 is the base, only the adapters train and travel, a merged
export is the base plus the adapters, a small run learns under SFT and RL, and bad settings are one line. Dropout on
the adapters' input is inverted dropout, drawn in training only, by island and inner step: the same again, after a
resume and over the wire."""

from __future__ import annotations

import json
import math
import re
import shutil
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from diloco.cli import main
from diloco.config import ConfigError, load_config
from diloco.harness.procs import Federation, log_lines
from diloco.ops.export import export, export_peft
from diloco.ops.trained import load_trained
from diloco.run.rundir import read_events
from diloco.run.setup import Evaluator, build_setup, make_island
from diloco.simulator.simulate import run_simulation
from islands.config import InnerConfig
from islands.inner import Draw, WithDraw, WithFrozen, island_key, make_inner_optimizer, make_train_step
from islands.island import Island
from islands.mesh import Layout, build_mesh
from islands.models.adapted import Adapted
from islands.models.base import Model, param_count
from islands.models.config import ModelConfig
from islands.models.lora import Lora, LoraError, adapt
from islands.models.registry import ARCHITECTURES, build_model
from islands.models.transformer import forward
from pytrees.digest import tree_digest
from pytrees.naming import flatten_named, unflatten_named
from tests.conftest import TINY_TOML, cut_after_round, fails, write_corpus
from tests.test_workloads import RL, SIZE
from tests.test_workloads import TASK as WORKLOAD_TASK

pytestmark = pytest.mark.timeout(300)

LLAMA = ModelConfig(kind="llama", vocab_size=64, seq_len=8, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=32)
GPT2 = ModelConfig(kind="transformer", vocab_size=64, seq_len=8, d_model=16, n_layers=2, n_heads=2, d_ff=32)
TASK = ["workload.task=addition", "workload.heldout_examples=8", "workload.max_new_tokens=4"]
LORA = ["workload.lora.rank=4", "workload.lora.targets=[wqkv,wo,w1,w2]"]


def _logits(cfg: ModelConfig, params: dict, tokens: jax.Array) -> jax.Array:
    return forward(params, tokens, cfg, ARCHITECTURES[cfg.kind])[0]


@pytest.mark.parametrize(
    ("cfg", "targets", "adapted"),
    [(LLAMA, (), 8), (LLAMA, ("wq", "w_down"), 4), (GPT2, (), 4), (GPT2, ("wqkv", "wo", "w1", "w2"), 8)],
)
def test_step_zero_is_the_base_and_only_targets_are_adapted(cfg: ModelConfig, targets: tuple, adapted: int) -> None:
    model = build_model(cfg)
    base = model.init(jax.random.key(0))
    lora = Lora.over(base, rank=2, alpha=8.0, targets=targets)
    adapters = lora.init(jax.random.key(1))
    names = flatten_named(adapters)
    assert len(names) == 2 * adapted and all(n.rsplit("/", 1)[-1] in ("lora_a", "lora_b") for n in names)
    assert param_count(adapters) < param_count(base) / 4
    tokens = jax.random.randint(jax.random.key(2), (2, cfg.seq_len), 0, cfg.vocab_size)
    np.testing.assert_array_equal(_logits(cfg, lora.merged(adapters), tokens), _logits(cfg, base, tokens))
    batch = jax.random.randint(jax.random.key(3), (2, cfg.seq_len + 1), 0, cfg.vocab_size)
    (loss, _), grads = jax.value_and_grad(adapt(model, lora).loss, has_aux=True)(adapters, batch)
    assert loss == model.loss(base, batch)[0]
    assert jax.tree.structure(grads) == jax.tree.structure(adapters)  # the gradient is over the adapters alone
    assert any(float(jnp.abs(g).sum()) > 0 for n, g in flatten_named(grads).items() if n.endswith("lora_b"))


def test_a_bfloat16_base_merges_into_float32_weights() -> None:
    base = build_model(LLAMA).init(jax.random.key(0))
    lora = Lora.over(base, rank=2, alpha=4.0, dtype="bfloat16")
    assert {leaf.dtype for leaf in jax.tree.leaves(lora.base)} == {jnp.dtype(jnp.bfloat16)}
    merged = lora.merged(lora.init(jax.random.key(1)))
    assert {leaf.dtype for leaf in jax.tree.leaves(merged)} == {jnp.dtype(jnp.float32)}


def test_the_step_applies_the_adapters_unmerged_to_the_merged_loss_at_a_fraction_of_the_flops() -> None:
    """The loss a step differentiates reads each adapted matrix unmerged (x·W + s·(x·A)·B): the same loss and adapter
    gradients as the merged weights', within float32 rounding, and XLA's count of the gradient's flops is lower: the
    merged weights' backward makes each adapted matrix's whole [in, out] gradient."""
    cfg = replace(LLAMA, d_model=64, d_ff=128, n_layers=1)
    model = build_model(cfg)
    lora = Lora.over(model.init(jax.random.key(0)), rank=2, alpha=4.0, targets=("wq", "wo", "w_up", "w_down"))
    adapters = jax.tree.map(lambda a: a + 0.01, lora.init(jax.random.key(1)))  # B != 0: the factors matter
    batch = jax.random.randint(jax.random.key(2), (4, cfg.seq_len + 1), 0, cfg.vocab_size)

    def loss_of(apply: Callable[[dict], dict]) -> Callable[[dict], jax.Array]:
        return lambda a: model.loss(apply(a), batch)[0]

    unmerged, merged = jax.value_and_grad(loss_of(lora.adapted)), jax.value_and_grad(loss_of(lora.merged))
    (lu, gu), (lm, gm) = unmerged(adapters), merged(adapters)
    assert float(lu) == pytest.approx(float(lm), rel=1e-6)
    for u, m in zip(jax.tree.leaves(gu), jax.tree.leaves(gm), strict=True):
        np.testing.assert_allclose(np.asarray(u), np.asarray(m), rtol=1e-4, atol=1e-7)
    flops = [jax.jit(f).lower(adapters).compile().cost_analysis()["flops"] for f in (unmerged, merged)]
    assert flops[0] < 0.9 * flops[1], flops


@pytest.mark.parametrize(
    ("cfg", "targets", "message"),
    [
        (GPT2, ("wq",), "workload.lora.targets names 'wq', which this model has no block matrix of"),
        (LLAMA, ("wqkv",), "workload.lora.targets names 'wqkv', which this model has no block matrix of"),
        (
            ModelConfig(
                kind="llama_moe",
                vocab_size=64,
                seq_len=8,
                d_model=16,
                n_layers=1,
                n_heads=2,
                d_ff=8,
                n_experts=2,
                top_k=1,
            ),  # fmt: skip
            ("w_up",),
            "blocks/0/ff/w_up is a stack of experts [2, 16, 8]; LoRA adapts 2-D matrices",
        ),
    ],
)
def test_a_target_the_model_cannot_adapt_is_one_line(cfg: ModelConfig, targets: tuple, message: str) -> None:
    with pytest.raises(LoraError, match=re.escape(message)):
        Lora.over(build_model(cfg).init(jax.random.key(0)), rank=2, alpha=1.0, targets=targets)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["workload.lora.rank=-1"], "workload.lora.rank must be >= 1 (0: no LoRA)"),
        (["workload.lora.rank=2", "workload.lora.alpha=0"], "workload.lora.alpha must be a finite number > 0"),
        (["workload.lora.targets=[q_proj]"], "workload.lora.targets names 'q_proj', not a block matrix LoRA adapts"),
        (["workload.lora.targets=[wq,wq]"], "workload.lora.targets names a matrix twice"),
        (["workload.lora.dropout=1"], "workload.lora.dropout must be >= 0 and < 1 (got 1"),
        (["workload.lora.dropout=-0.1"], "workload.lora.dropout must be >= 0 and < 1 (got -0.1)"),
        (["workload.lora.base_dtype=float16"], "workload.lora.base_dtype must be one of float32, bfloat16"),
        (["workload.lora.rank=2", "inner.kind=muon"], "workload.lora trains low-rank adapters, which are not the"),
        (
            ["workload.lora.rank=2", "model.kind=custom", "model.entry=tests.custom_model:build"],
            "workload.lora adapts the block matrices of this project's models: model.kind must be",
        ),
    ],
)
def test_a_bad_lora_setting_is_one_line(tiny_config: Path, overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(tiny_config, overrides)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_a_target_absent_from_the_run_model_is_one_cli_line(
    tiny_config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["simulate", str(tiny_config), "--run-dir", str(tmp_path / "r"), "workload.lora.rank=2"]
    fails(capsys, [*argv, "workload.lora.targets=[w_gate]"], "workload.lora.targets names 'w_gate', which this model")


@pytest.mark.slow
def test_sft_with_lora_trains_the_adapters_only_and_exports_merged(tiny_config: Path, tmp_path: Path) -> None:
    full_cfg = load_config(tiny_config, ["workload.kind=sft", *TASK])
    cfg = load_config(tiny_config, ["workload.kind=sft", *TASK, *LORA, "inner.lr=1e-2"])
    full, setup = build_setup(full_cfg, islands=()), build_setup(cfg, islands=())
    assert setup.n_params * 4 < full.n_params  # the tree that trains, travels and is saved is the adapters
    summary = run_simulation(cfg, tmp_path / "run", show_progress=False)
    base_scores = Evaluator.of(full_cfg, full).measure(full.init_params)[1]
    assert summary["initial_scores"] == base_scores  # step 0 is the base
    assert summary["final_scores"]["sft_ce"] < summary["initial_scores"]["sft_ce"] - 0.1
    assert summary["bytes_up"] < cfg.train.rounds * cfg.islands.count * full.n_params  # a quarter of θ's fp32 bytes

    trained = load_trained(tmp_path / "run")
    assert trained.digest == summary["params_digest"]  # the run's θ is its adapters
    out = export(tmp_path / "run", tmp_path / "export")
    merged = load_file(tmp_path / "export" / "model.safetensors")
    model_params = jax.tree.map(np.asarray, setup.lora.merged(trained.adapters))
    tokens = jax.random.randint(jax.random.key(0), (2, cfg.model.seq_len), 0, cfg.model.vocab_size)
    exported = unflatten_named(merged, full.init_params)
    expected = _logits(cfg.model, model_params, tokens)
    np.testing.assert_allclose(_logits(cfg.model, exported, tokens), expected, atol=1e-5, rtol=0)
    assert out["param_count"] == full.n_params
    peft = export_peft(tmp_path / "run", tmp_path / "peft")
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["peft_type"] == "LORA" and peft["tensors"] == 8
    tensors = load_file(tmp_path / "peft" / "adapter_model.safetensors")
    a = tensors["base_model.model.transformer.h.0.attn.c_attn.lora_A.weight"]
    b = tensors["base_model.model.transformer.h.0.attn.c_attn.lora_B.weight"]
    assert a.shape == (4, 32) and b.shape == (96, 4)


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A full SFT run of tests/test_workloads.py's size: where the LoRA runs of RL and DPO start (their base)."""
    tmp = tmp_path_factory.mktemp("lora")
    config = tmp / "tiny.toml"
    config.write_text(TINY_TOML.format(corpus=write_corpus(tmp / "corpus.txt")))
    overrides = [*SIZE, *WORKLOAD_TASK, "workload.kind=sft", "train.rounds=2", "train.inner_steps=20"]
    run_simulation(load_config(config, overrides), tmp / "sft", show_progress=False)
    return tmp


@pytest.mark.slow
def test_rl_and_dpo_with_lora_start_at_their_base_and_learn(sft_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config, base = sft_run / "tiny.toml", f"init.from={sft_run / 'sft'}"
    common = [*SIZE, *WORKLOAD_TASK, base, "workload.lora.rank=4", "workload.lora.targets=[wqkv,wo,w1,w2]"]
    rl = load_config(config, [*common, *RL, "inner.lr=1e-2", "train.rounds=2", "train.inner_steps=20",
                              "workload.group_size=8", "train.batch_size=32"])  # fmt: skip
    summary = run_simulation(rl, sft_run / "rl", show_progress=False)
    assert summary["final_scores"]["rl_reward"] > summary["initial_scores"]["rl_reward"]
    inner = read_events(sft_run / "rl" / "metrics.jsonl", "inner")
    assert all(e["kl"] >= 0.0 for e in inner) and len(inner) == 2 * 20 // 2 * 2

    dpo = load_config(config, [*common, "workload.kind=dpo", "train.rounds=1", "train.inner_steps=2"])
    first = run_simulation(dpo, sft_run / "dpo", show_progress=False)["initial_scores"]
    assert first["dpo_loss"] == pytest.approx(math.log(2.0), abs=1e-6)  # θ_0 merged is the reference

    args = ["sample", str(sft_run / "rl"), "--prompt", "12+34=", "--temperature", "0", "--max-new-tokens", "4"]
    assert main([*args, "--json"]) == 0  # the adapters merged at load
    (answer,) = json.loads(capsys.readouterr().out)["samples"]
    assert 1 <= len(answer["tokens"]) <= 4


def test_bench_posttrain_lora_refuses_what_it_cannot_compare(
    tiny_config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["bench", "posttrain", str(tiny_config), "--pretrained", str(tmp_path), "--run-dir", str(tmp_path / "b")]
    task = ["workload.kind=sft", *TASK]
    fails(capsys, [*argv, "--lora", "workload.lora.alpha=8", *task], "--lora 'workload.lora.alpha=8' leaves")
    fails(capsys, [*argv, "--lora", "workload.lora.rank=2", "--columns", "one", *task], "--lora compares SFT and")


def test_the_train_step_takes_the_base_as_an_argument_not_as_constants() -> None:
    model = build_model(LLAMA)
    lora = Lora.over(model.init(jax.random.key(0)), rank=2, alpha=4.0)
    adapted = adapt(model, lora)
    tx = make_inner_optimizer(InnerConfig(), 10)
    step = make_train_step(adapted.loss, tx, Layout(build_mesh(1)))
    assert isinstance(step, WithFrozen)
    adapters = adapted.init(jax.random.key(1))
    batch = jax.random.randint(jax.random.key(2), (1, 2, LLAMA.seq_len + 1), 0, LLAMA.vocab_size)
    text = step.lower(adapters, tx.init(adapters), batch).as_text()
    embedding = f"tensor<{LLAMA.vocab_size}x{LLAMA.d_model}xf32>"
    assert not [line for line in text.splitlines() if "stablehlo.constant" in line and embedding in line]
    params, _, metrics = step(adapters, tx.init(adapters), batch)
    assert float(metrics["loss"]) == pytest.approx(float(model.loss(lora.base, batch[0])[0]), rel=1e-6)
    assert jax.tree.structure(params) == jax.tree.structure(adapters)


# -- dropout ---------------------------------------------------------------------------------------------------------


def test_dropout_zeroes_an_input_entry_with_probability_p_and_scales_the_kept_ones_by_one_over_one_minus_p() -> None:
    p, rows = 0.25, 4096
    row = jax.random.normal(jax.random.key(0), (16,))
    x = jnp.tile(row, (rows, 1))
    w, a, b = (jax.random.normal(jax.random.key(i), shape) for i, shape in enumerate([(16, 8), (16, 2), (2, 8)], 1))
    adapted = Adapted(w, a, b, 2.0, jax.random.key(5), p)
    dropped = np.asarray(adapted.dropped(x))
    kept = dropped != 0
    np.testing.assert_allclose(dropped[kept], np.asarray(x)[kept] / (1 - p), rtol=1e-6)
    assert kept.mean() == pytest.approx(1 - p, abs=0.01)  # 4096 x 16 draws: the kept share's std is 0.0017
    # E[drop(x)] = x, so the adapter's term keeps its expectation: the mean of 4096 masks' within 5 of its std
    std = np.abs(np.asarray(row)) * np.sqrt(p / (1 - p) / rows)
    assert np.all(np.abs(dropped.mean(axis=0) - np.asarray(row)) <= 5 * std)
    expected = x @ w + 2.0 * (dropped @ a) @ b
    np.testing.assert_allclose(np.asarray(adapted.apply(x)), np.asarray(expected), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(adapted.dropped(x)), dropped)  # one key, one mask
    assert not np.array_equal(np.asarray(replace(adapted, key=jax.random.key(6)).dropped(x)), dropped)
    assert Adapted(w, a, b, 2.0, None, p).dropped(x) is x  # no key (evaluation): nothing dropped
    assert Adapted(w, a, b, 2.0, jax.random.key(5), 0.0).dropped(x) is x
    half = adapted.dropped(x.astype(jnp.bfloat16))
    assert half.dtype == jnp.bfloat16 and float(jnp.abs(half).max()) > 0


def _adapted(dropout: float) -> tuple[Model, dict]:
    """LLAMA with adapters over its base, B != 0 (so the adapters' input matters to the loss as to B's gradient)."""
    model = build_model(LLAMA)
    adapted = adapt(model, Lora.over(model.init(jax.random.key(0)), rank=2, alpha=4.0, dropout=dropout))
    return adapted, jax.tree.map(lambda x: x + 0.05, adapted.init(jax.random.key(1)))


def test_without_dropout_the_step_draws_nothing_and_a_loss_without_a_key_drops_nothing() -> None:
    """Dropout 0 is the step it was: no draw argument, no random bits in its program; and the loss that a step with
    dropout differentiates, called without a key (the corpus's evaluation), is dropout 0's exactly."""
    (plain, adapters), (dropping, _) = _adapted(0.0), _adapted(0.25)
    tx = make_inner_optimizer(InnerConfig(), 10)
    batch = jax.random.randint(jax.random.key(2), (1, 4, LLAMA.seq_len + 1), 0, LLAMA.vocab_size)
    step = make_train_step(plain.loss, tx, Layout(build_mesh(1)))
    assert isinstance(step, WithFrozen) and not isinstance(step, WithDraw)
    assert "threefry" not in step.lower(adapters, tx.init(adapters), batch).as_text()
    drawing = make_train_step(dropping.loss, tx, Layout(build_mesh(1)))
    assert isinstance(drawing, WithDraw) and "threefry" in drawing.lower(adapters, tx.init(adapters), batch).as_text()
    assert dropping.loss(adapters, batch[0])[0] == plain.loss(adapters, batch[0])[0]
    # merged, what sampling, rollouts, the held-out evaluation and export read, takes no key: nothing to drop
    for m, d in zip(
        jax.tree.leaves(dropping.loss.lora.merged(adapters)),
        jax.tree.leaves(plain.loss.lora.merged(adapters)),
        strict=True,
    ):
        np.testing.assert_array_equal(np.asarray(m), np.asarray(d))


@pytest.mark.parametrize("passes", [1, 2])
def test_a_step_with_dropout_draws_by_island_and_inner_step_and_the_same_again(passes: int) -> None:
    (plain, adapters), (dropping, _) = _adapted(0.0), _adapted(0.25)
    tx = make_inner_optimizer(InnerConfig(warmup_steps=0), 10)  # a first step that moves θ
    batch = jax.random.randint(jax.random.key(2), (passes, 4 // passes, LLAMA.seq_len + 1), 0, LLAMA.vocab_size)
    steps = {m: make_train_step(m.loss, tx, Layout(build_mesh(1))) for m in (plain, dropping)}

    def one(model: Model, *draw: Draw) -> tuple[str, float, float]:
        fresh = jax.tree.map(jnp.array, adapters)  # the step donates its params
        params, _, metrics = steps[model](fresh, tx.init(fresh), batch, *draw)
        return tree_digest(params), float(metrics["loss"]), float(metrics["grad_norm"])

    def at(island: str, step: int) -> tuple[str, float, float]:
        return one(dropping, (island_key(0, island), np.uint32(step)))

    none, first = one(plain), at("island-0", 3)
    assert at("island-0", 3) == first  # the same island and step: the same masks, bit for bit
    others = [none, at("island-0", 4), at("island-1", 3), one(dropping, (island_key(1, "island-0"), np.uint32(3)))]
    for other in others:  # dropout 0, the next step, another island, another run.seed: other masks
        assert all(o != f for o, f in zip(other, first, strict=True)), (other, first)


def test_an_island_draws_by_its_name_and_inner_step_so_a_restored_island_draws_alike(tiny_config: Path) -> None:
    """Three inner steps at once equal two, a new island restored from that state (as a resumed run restores it)
    and one more: the third step draws by the island's own step count, not by the call's. An island of another
    name, or without dropout, ends elsewhere."""
    cfg = load_config(tiny_config, [*LORA, "workload.lora.dropout=0.25", "inner.warmup_steps=0"])
    setup = build_setup(cfg, islands=["island-0"])
    stream = setup.streams["island-0"]  # `start` and `restore` put its cursor where each island stands

    def island(name: str, model: Model = setup.model) -> Island:
        return make_island(cfg, name, model, stream, check_memory=False)

    whole = island("island-0")
    whole.start(setup.init_params)
    losses = whole.train(3).losses
    first = island("island-0")
    first.start(setup.init_params)
    head = first.train(2).losses
    resumed = island("island-0")
    resumed.restore(first.state)
    tail = resumed.train(1).losses
    assert tree_digest(resumed.state.params) == tree_digest(whole.state.params)
    np.testing.assert_array_equal(np.concatenate([head, tail]), losses)
    other = island("island-1")
    other.start(setup.init_params)
    other.train(3)
    plain = build_setup(load_config(tiny_config, [*LORA, "inner.warmup_steps=0"]), islands=["island-0"])
    undropped = island("island-0", plain.model)
    undropped.start(setup.init_params)
    undropped.train(3)
    digests = {tree_digest(i.state.params) for i in (whole, other, undropped)}
    assert len(digests) == 3


@pytest.mark.slow
def test_a_lora_run_with_dropout_resumes_to_the_same_parameters(tiny_config: Path, tmp_path: Path) -> None:
    """As tests/test_simulate.py's kill-and-resume: a run cut back to its round-1 checkpoint draws the masks of the
    uninterrupted run and ends with its digest, which a run without dropout does not reach."""
    cfg = load_config(tiny_config, [*LORA, "workload.lora.dropout=0.1", "inner.lr=1e-2"])
    run_dir = tmp_path / "run"
    reference = run_simulation(cfg, run_dir, show_progress=False)
    cut_after_round(run_dir, 1)
    resumed = run_simulation(cfg, run_dir, show_progress=False)
    assert [e["round"] for e in read_events(run_dir / "metrics.jsonl", "resumed")] == [1]
    assert resumed["params_digest"] == reference["params_digest"]
    assert resumed["final_eval_loss"] == reference["final_eval_loss"]
    plain = run_simulation(load_config(tiny_config, [*LORA, "inner.lr=1e-2"]), tmp_path / "plain", show_progress=False)
    assert plain["params_digest"] != reference["params_digest"]


@pytest.mark.slow
def test_a_llama_lm_run_with_lora_learns_and_exports_peft_names(tiny_config: Path, tmp_path: Path) -> None:
    llama = ["model.kind=llama", "model.n_kv_heads=1", "train.rounds=2", "inner.lr=1e-2", "workload.lora.rank=2"]
    cfg = load_config(tiny_config, llama)
    summary = run_simulation(cfg, tmp_path / "run", show_progress=False)
    assert summary["final_eval_loss"] < summary["initial_eval_loss"]  # plain lm: the corpus's loss
    out = export_peft(tmp_path / "run", tmp_path / "peft")
    assert out["target_modules"] == ["k_proj", "o_proj", "q_proj", "v_proj"]  # the attention projections
    tensors = load_file(tmp_path / "peft" / "adapter_model.safetensors")
    assert tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"].shape == (2, 32)
    assert tensors["base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight"].shape == (16, 2)
    trained = load_trained(tmp_path / "run")
    a, b = (trained.adapters["blocks"][0]["attn"]["wq"][k] for k in ("lora_a", "lora_b"))
    np.testing.assert_array_equal(a.T, tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"])
    base = build_model(cfg.model).init(jax.random.key(cfg.run.seed))["blocks"][0]["attn"]["wq"]  # no init.from
    merged = trained.params["blocks"][0]["attn"]["wq"]
    np.testing.assert_allclose(merged, np.asarray(base) + (16.0 / 2) * (a @ b), atol=1e-6)  # W + (α / r)·A·B
    assert not np.array_equal(merged, np.asarray(base))


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_a_lora_federation_over_the_wire_ends_as_simulate_and_refuses_an_island_of_another_base(
    federation: Callable[..., Federation], tiny_config: Path, tmp_path: Path
) -> None:
    """Adapters over a base read from init.from (a short run of the tiny config), trained with dropout by a
    coordinator and two island processes over real gRPC, end with `simulate`'s digest: each island process draws the
    masks of `simulate`'s island of its name. Then init.from's checkpoint is replaced by another
    run's after a coordinator started on it (a host whose file differs at the same path): the island that reads it
    is refused at its Join in one line naming the frozen base (exit 2), where its config digest alone would match."""
    from tests.conftest import WAIT_S

    bases = {}
    for seed in (0, 1):
        bases[seed] = tmp_path / f"base-{seed}"
        argv = ["simulate", str(tiny_config), "--run-dir", str(bases[seed]), "--no-progress", "train.rounds=1"]
        assert main([*argv, f"run.seed={seed}"]) == 0
    lora = ["workload.lora.rank=2", "workload.lora.targets=[wqkv,w2]", "quorum.min_islands=2", "train.rounds=2"]
    fed = federation(*lora, "workload.lora.dropout=0.1", f"init.from={bases[0]}")
    fed.start()
    fed.wait_exit(2 * WAIT_S)
    launched = json.loads((fed.run_dir / "summary.json").read_text())
    assert main(["simulate", fed.config, "--run-dir", str(tmp_path / "sim"), "--no-progress", *fed.overrides]) == 0
    assert launched["params_digest"] == json.loads((tmp_path / "sim" / "summary.json").read_text())["params_digest"]

    moved = tmp_path / "moved"
    shutil.copytree(bases[0], moved)
    other = federation(*lora, f"init.from={moved}")
    other.start_coordinator()
    shutil.rmtree(moved)
    shutil.copytree(bases[1], moved)
    island = other.start_island("island-0")
    assert island.wait(timeout=WAIT_S) == 2
    (line,) = log_lines(other.log_path("island-0"))
    assert "FAILED_PRECONDITION" in line and "frozen base (workload.lora over init.from) differs" in line, line
