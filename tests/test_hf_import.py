"""Hugging Face checkpoints in and out, held to transformers' own numbers (tests/fixtures/hf/, made by
make_fixtures.py with the real transformers): [model] from config.json, the project's forward against transformers'
logits (1e-5, float32) and greedy continuation (token for token), import then export bit for bit, and one line with
exit code 2, nothing written, for every bad checkpoint."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from diloco.config import ConfigError, load_config
from diloco.ops.export import write_hf
from diloco.run.warm_start import checkpoint_dir, checkpoint_params
from floor.files import file_sha256
from floor.safetensors import SafetensorsFile
from islands.models.hf.checkpoint import INDEX, Checkpoint, CheckpointError, parse_size, plan_shards
from islands.models.hf.families import checkpoint_model
from islands.models.registry import ARCHITECTURES, build_model
from islands.models.transformer import forward
from islands.sampling import generate
from pytrees.naming import flatten_named
from tests.conftest import child_env, fails, write_corpus

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "hf"
FAMILIES = sorted(p.name for p in FIXTURES.iterdir() if (p / "config.json").is_file())
RUN_TOML = """
[run]
name = "hf"
seed = 0

[model]
seq_len = 32

[data]
kind = "jsonl"
path = "{corpus}"
cache_dir = "{cache}"
val_fraction = 0.1

[train]
rounds = 1
inner_steps = 1
batch_size = 2
eval_batches = 1
checkpoint_every = 1

[islands]
count = 1

[init]
from = "{source}"
"""


def write_documents(path: Path) -> Path:
    """The `write_corpus` words as JSONL documents of a text field, for a checkpoint's tokenizer to tokenize."""
    words = write_corpus(path.with_suffix(".txt")).read_text().split()
    lines = (json.dumps({"text": " ".join(words[i : i + 40])}) for i in range(0, len(words), 40))
    path.write_text("\n".join(lines) + "\n")
    return path


def run_config(tmp: Path, source: Path, extra: str = "") -> Path:
    path = tmp / "run.toml"
    corpus = write_documents(tmp / "corpus.jsonl")
    path.write_text(RUN_TOML.format(corpus=corpus, cache=tmp / "token-cache", source=source) + extra)
    return path


def reference(family: str) -> dict:
    return json.loads((FIXTURES / family / "reference.json").read_text())


def test_the_fixtures_cover_every_family_and_stay_small() -> None:
    assert FAMILIES == ["gpt2", "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "smollm2"]
    assert sum(f.stat().st_size for f in FIXTURES.rglob("*") if f.is_file()) < 3_000_000


# -- config.json -> [model] ----------------------------------------------------------------------------------------

EXPECTED = {
    "llama": {"kind": "llama", "d_model": 32, "n_heads": 4, "n_kv_heads": 2, "head_dim": 8, "rope_scaling": "llama3",
              "rope_theta": 500000.0, "rope_scaling_original_max_position": 16, "tie_embeddings": False},
    "qwen2": {"qkv_bias": True, "attn_bias": False, "rope_theta": 1e6, "d_ff": 48, "norm_eps": 1e-6},
    "qwen3": {"qk_norm": True, "head_dim": 16, "tie_embeddings": True, "qkv_bias": False},
    "mistral": {"n_kv_heads": 1, "sliding_window": 0, "rope_scaling": "none"},
    "smollm2": {"d_model": 48, "n_heads": 6, "tie_embeddings": True, "rope_theta": 100000.0},
    "qwen3_moe": {"kind": "llama_moe", "n_experts": 4, "top_k": 2, "d_ff": 16, "norm_topk_prob": True, "qk_norm": True},
    "qwen2_moe": {"kind": "llama_moe", "shared_expert_d_ff": 24, "norm_topk_prob": False, "qkv_bias": True},
    "mixtral": {"kind": "llama_moe", "d_ff": 32, "norm_topk_prob": True, "rope_theta": 1e6},
    "gpt2": {"kind": "transformer", "seq_len": 32, "d_ff": 128, "attn_bias": True, "norm_eps": 1e-5},
}  # fmt: skip


@pytest.mark.parametrize("family", FAMILIES)
def test_config_json_gives_the_model_section(family: str) -> None:
    section = checkpoint_model(json.loads((FIXTURES / family / "config.json").read_text()), family)
    assert {key: section[key] for key in EXPECTED[family]} == EXPECTED[family]
    assert section["vocab_size"] == 320 and section["n_layers"] == 2


def test_the_checkpoints_tokenizer_is_the_runs_unless_one_is_named(tmp_path: Path) -> None:
    source = FIXTURES / "llama"
    cfg = load_config(run_config(tmp_path, source))
    assert cfg.data.tokenizer == str(source / "tokenizer.json")
    own = tmp_path / "own" / "tokenizer.json"
    assert load_config(run_config(tmp_path, source), [f"data.tokenizer={own}"]).data.tokenizer == str(own)
    sft = ["data.kind=text", f"data.path={tmp_path / 'corpus.txt'}", "workload.kind=sft", "workload.task=addition"]
    assert load_config(run_config(tmp_path, source), sft).data.tokenizer == str(source / "tokenizer.json")


def test_a_byte_corpus_for_a_checkpoint_with_a_tokenizer_is_one_line(tmp_path: Path) -> None:
    """Bytes as ids to a model that reads its tokenizer's ids would train silently wrong: refused."""
    text = ["data.kind=text", f"data.path={tmp_path / 'corpus.txt'}"]
    with pytest.raises(ConfigError, match="data.kind = 'text' feeds the corpus to the model as byte ids"):
        load_config(run_config(tmp_path, FIXTURES / "llama"), text)


def test_the_hubs_older_config_layout_gives_the_same_model() -> None:
    """Llama 3.x and Qwen3-MoE as most Hub checkpoints write them: rope_theta and rope_scaling, num_experts."""
    config = json.loads((FIXTURES / "llama" / "config.json").read_text())
    rope = config.pop("rope_parameters")
    older = config | {"rope_theta": rope.pop("rope_theta"), "rope_scaling": rope}
    assert checkpoint_model(older, "old") == checkpoint_model(
        json.loads((FIXTURES / "llama" / "config.json").read_text()), "new"
    )
    moe = json.loads((FIXTURES / "qwen3_moe" / "config.json").read_text())
    older_moe = {k: v for k, v in moe.items() if k != "num_local_experts"} | {"num_experts": moe["num_local_experts"]}
    assert checkpoint_model(older_moe, "old") == checkpoint_model(moe, "new")


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"architectures": ["BertForMaskedLM"]}, "architecture 'BertForMaskedLM' is not supported"),
        ({"architectures": None}, "must list one architecture"),
        ({"hidden_size": None}, "has no 'hidden_size'"),
        ({"hidden_act": "gelu"}, "hidden_act = 'gelu' is not supported"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4}}, "rope type 'yarn'"),
    ],
)
def test_a_config_json_the_model_cannot_compute_is_one_line(change: dict, expected: str) -> None:
    config = json.loads((FIXTURES / "llama" / "config.json").read_text())
    config.update(change)
    config = {k: v for k, v in config.items() if v is not None or k in ("rope_scaling",)}
    with pytest.raises(CheckpointError, match=expected.replace("(", r"\(").replace("[", r"\[")):
        checkpoint_model(config, "config.json")


def test_sizes_and_shards() -> None:
    assert parse_size("5GB") == 5 * 10**9 and parse_size("64KiB") == 65536 and parse_size("1000") == 1000
    for bad in ("", "5XB", "-1", "0"):
        with pytest.raises(ValueError):
            parse_size(bad)
    assert plan_shards([("a", 6), ("b", 5), ("c", 20), ("d", 1)], 10) == [["a"], ["b"], ["c"], ["d"]]
    assert plan_shards([("a", 4), ("b", 5), ("c", 2)], 10) == [["a", "b"], ["c"]]


# -- the forward and greedy generation against transformers -------------------------------------------------------


def imported(tmp_path: Path, family: str) -> tuple:
    """The run config of a run from the fixture, and θ_0 as init.from reads it."""
    cfg = load_config(run_config(tmp_path, FIXTURES / family))
    like = jax.eval_shape(build_model(cfg.model).init, jax.random.key(0))
    directory = checkpoint_dir(cfg)
    assert directory is not None
    return cfg, checkpoint_params(cfg, directory, like)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_the_forward_matches_transformers_logits_and_greedy_picks(tmp_path: Path, family: str) -> None:
    """One forward over the inputs and transformers' greedy continuation: the inputs' logits within 1e-5 of
    transformers', and at every position of the continuation the top logit is transformers' next token (so a greedy
    run here, each step's prefix transformers' own, picks what it picked, token for token)."""
    cfg, params = imported(tmp_path, family)
    ref = reference(family)
    ids = np.concatenate([ref["input_ids"], ref["greedy"]], axis=1).astype(np.int32)
    logits, _ = jax.jit(forward, static_argnums=(2, 3))(params, ids, cfg.model, ARCHITECTURES[cfg.model.kind])
    logits = np.asarray(logits)
    prompt = len(ref["input_ids"][0])
    delta = float(np.abs(logits[:, :prompt] - np.load(FIXTURES / family / "logits.npy")).max())
    assert delta < 1e-5, delta
    assert logits[:, prompt - 1 : -1].argmax(-1).tolist() == ref["greedy"]


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_greedy_generation_matches_transformers_token_for_token(tmp_path: Path, family: str) -> None:
    """islands/sampling.py's generation (prefill, then one token at a time over the KV cache) from the imported
    weights gives transformers' greedy continuation; a dense family with Llama 3 rope scaling and grouped-query
    attention, and a mixture of experts with q/k norms."""
    cfg, params = imported(tmp_path, family)
    ref = reference(family)
    ids = jnp.asarray(ref["input_ids"], jnp.int32)
    new = len(ref["greedy"][0])
    tokens, lengths = generate(
        params, cfg.model, ids, jnp.full((ids.shape[0],), ids.shape[1]), key=jax.random.key(0),
        max_new_tokens=new, temperature=0.0,
    )  # fmt: skip
    assert np.asarray(tokens).tolist() == ref["greedy"] and np.asarray(lengths).tolist() == [new] * len(ids)


# -- import then export --------------------------------------------------------------------------------------------


def tensors_of(directory: Path) -> dict[str, np.ndarray]:
    out = {}
    for shard in sorted(directory.glob("model*.safetensors")):
        with SafetensorsFile(shard) as f:
            out |= {name: f.read(name) for name in f.entries}
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_import_then_export_gives_every_tensor_back_bit_for_bit(tmp_path: Path, family: str) -> None:
    cfg = load_config(run_config(tmp_path, FIXTURES / family))
    like = jax.eval_shape(build_model(cfg.model).init, jax.random.key(0))
    shapes = {name: tuple(a.shape) for name, a in flatten_named(like, to_numpy=False).items()}
    from islands.models.hf.families import open_import

    params = open_import(FIXTURES / family, cfg.model, shapes, "init.from").read()
    assert all(a.dtype == np.float32 for a in params.values())
    theirs = tensors_of(FIXTURES / family)
    dtype = "bfloat16" if next(iter(theirs.values())).dtype != np.float32 else "float32"
    out = tmp_path / "export"
    out.mkdir()
    shard = "60KB" if (FIXTURES / family / INDEX).exists() else "5GB"
    files, architecture = write_hf(out, cfg.model, params, FIXTURES / family / "config.json", dtype, parse_size(shard))
    ours = tensors_of(out)
    assert sorted(ours) == sorted(theirs)
    for name, array in theirs.items():
        assert ours[name].dtype == array.dtype and ours[name].tobytes() == array.tobytes(), name
    assert json.loads((out / "config.json").read_text()) == json.loads((FIXTURES / family / "config.json").read_text())
    assert architecture == reference(family)["architecture"]
    assert ((out / INDEX).exists()) == ((FIXTURES / family / INDEX).exists())
    Checkpoint.open(out)  # and the export is a valid checkpoint to start another run from


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3_moe", "mixtral", "gpt2"])
def test_an_export_without_the_source_config_makes_one_that_imports_to_the_same_model(
    tmp_path: Path, family: str
) -> None:
    """A run trained from scratch here has no config.json to write back: the one made from [model] reads back as it."""
    cfg = load_config(run_config(tmp_path, FIXTURES / family))
    rng = np.random.default_rng(0)
    like = jax.eval_shape(build_model(cfg.model).init, jax.random.key(0))
    params = {n: rng.normal(size=a.shape).astype(np.float32) for n, a in flatten_named(like, to_numpy=False).items()}
    out = tmp_path / "export"
    out.mkdir()
    write_hf(out, cfg.model, params, None, "float32", parse_size("5GB"))
    config = json.loads((out / "config.json").read_text())
    assert checkpoint_model(config, "made") == checkpoint_model(
        json.loads((FIXTURES / family / "config.json").read_text()), "fixture"
    ) | ({"seq_len": 32} if family == "gpt2" else {})
    assert sorted(tensors_of(out)) == sorted(tensors_of(FIXTURES / family))


# -- bad checkpoints: one line, exit 2, no run directory -----------------------------------------------------------


def broken_copy(tmp: Path, family: str) -> Path:
    copy = tmp / f"{family}-copy"
    shutil.copytree(FIXTURES / family, copy)
    return copy


def edit_json(path: Path, **changes: object) -> None:
    data = json.loads(path.read_text())
    path.write_text(json.dumps({k: v for k, v in (data | changes).items() if v is not None}))


def break_missing_shard(d: Path) -> str:
    (d / "model-00002-of-00005.safetensors").unlink()
    return "model-00002-of-00005.safetensors' that model.safetensors.index.json lists does not exist"


def break_truncated(d: Path) -> str:
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[:100])
    return "is not a valid safetensors file: its header length field says"


def break_lying_header(d: Path) -> str:
    data = (d / "model.safetensors").read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    header["model.norm.weight"]["shape"] = [33]
    text = json.dumps(header).encode()
    text += b" " * (n - len(text)) if len(text) <= n else b""
    (d / "model.safetensors").write_bytes(len(text).to_bytes(8, "little") + text + data[8 + n :])
    return "tensor 'model.norm.weight' is F32[33]"


def break_architecture(d: Path) -> str:
    edit_json(d / "config.json", architectures=["FalconForCausalLM"])
    return "architecture 'FalconForCausalLM' is not supported"


def break_missing_key(d: Path) -> str:
    edit_json(d / "config.json", num_hidden_layers=None)
    return "has no 'num_hidden_layers', which LlamaForCausalLM needs"


def break_wrong_shape(d: Path) -> str:
    from floor import safetensors

    with SafetensorsFile(d / "model.safetensors") as f:
        arrays = {name: f.read(name) for name in f.entries}
    arrays["model.layers.1.self_attn.k_proj.weight"] = np.zeros((8, 32), np.float32)
    safetensors.write(d / "model.safetensors", arrays, {"format": "pt"})
    return "tensor 'model.layers.1.self_attn.k_proj.weight' in"


def break_disagreeing_run_config(d: Path) -> str:
    return "model.n_heads is 8 in the run config, but init.from's config.json"


BREAKS = {
    "missing shard": ("mixtral", break_missing_shard, ""),
    "truncated file": ("llama", break_truncated, ""),
    "lying header": ("llama", break_lying_header, ""),
    "unsupported architecture": ("llama", break_architecture, ""),
    "missing config key": ("llama", break_missing_key, ""),
    "wrong tensor shape": ("llama", break_wrong_shape, ""),
    "run config disagrees": ("llama", break_disagreeing_run_config, "n_heads = 8\n"),
}


@pytest.mark.parametrize("case", sorted(BREAKS))
@pytest.mark.slow
def test_a_bad_checkpoint_is_one_line_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    family, breaks, model_keys = BREAKS[case]
    source = broken_copy(tmp_path, family)
    expected = breaks(source)
    config = run_config(tmp_path, source)
    if model_keys:
        config.write_text(config.read_text().replace("[model]\n", f"[model]\n{model_keys}"))
    run_dir = tmp_path / "run"
    fails(capsys, ["simulate", str(config), "--run-dir", str(run_dir), "--no-progress"], expected)
    assert not run_dir.exists()


@pytest.mark.slow
def test_the_shape_check_reports_what_the_model_needs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = broken_copy(tmp_path, "llama")
    break_wrong_shape(source)
    fails(capsys, ["simulate", str(run_config(tmp_path, source)), "--run-dir", str(tmp_path / "r"), "--no-progress"],
          "is [8, 32], but the LlamaForCausalLM that config.json describes needs [16, 32]")  # fmt: skip


def tokens_config(tmp_path: Path, tokens: Path) -> Path:
    """run_config from the llama fixture with data.kind = "tokens" at `tokens`."""
    config = run_config(tmp_path, FIXTURES / "llama")
    text = (
        config.read_text()
        .replace('kind = "jsonl"', 'kind = "tokens"')
        .replace(str(tmp_path / "corpus.jsonl"), str(tokens))
        .replace(f'cache_dir = "{tmp_path / "token-cache"}"', "")
    )
    config.write_text(text)
    return config


def test_a_corpus_of_another_tokenizer_than_the_checkpoints_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Tokens prepared with a tokenizer of 401 ids, for a checkpoint of 320 with its own tokenizer: refused before
    the run directory, naming the tokenizer to prepare them with; prepared with the checkpoint's, they load."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {f"w{i}": i for i in range(400)} | {"[UNK]": 400}
    tokenizer = Tokenizer(models.WordLevel(words, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "text.txt").write_text(" ".join(f"w{i % 400}" for i in range(2000)))
    assert main_ok(["data", "prepare", str(tmp_path / "text.txt"), "--out", str(tmp_path / "tokens"),
                    "--tokenizer", str(tmp_path / "tokenizer.json")])  # fmt: skip
    config = tokens_config(tmp_path, tmp_path / "tokens")
    run_dir = tmp_path / "run"
    ours = FIXTURES / "llama" / "tokenizer.json"
    fails(capsys, ["simulate", str(config), "--run-dir", str(run_dir), "--no-progress"],
          f"its tokens were made by another tokenizer (401 ids, sha256 {file_sha256(tmp_path / 'tokenizer.json')[:12]}"
          f"...) than '{ours}' (sha256 {file_sha256(ours)[:12]}...): prepare them with `diloco data prepare "
          f"--tokenizer {ours}`")  # fmt: skip
    assert not run_dir.exists()
    assert main_ok(["data", "prepare", str(tmp_path / "text.txt"), "--out", str(tmp_path / "ours"),
                    "--tokenizer", str(ours)])  # fmt: skip
    assert load_config(tokens_config(tmp_path, tmp_path / "ours")).model.vocab_size == 320


def test_a_token_file_with_ids_beyond_the_checkpoints_vocabulary_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A token file without meta.json records no tokenizer: its ids are read, and the first beyond the checkpoint's
    320 and the largest are named with the file."""
    ids = np.arange(2000, dtype=np.uint16) % 300
    ids[100], ids[1500] = 330, 400
    ids.tofile(tmp_path / "corpus.bin")
    run_dir = tmp_path / "run"
    fails(capsys, ["simulate", str(tokens_config(tmp_path, tmp_path / "corpus.bin")), "--run-dir", str(run_dir),
                   "--no-progress"], f"data.path '{tmp_path / 'corpus.bin'}': token id 330 at index 100 is >= "
                   "model.vocab_size (320); the largest id is 400")  # fmt: skip
    assert not run_dir.exists()


def main_ok(args: list[str]) -> bool:
    from diloco.cli import main

    return main(args) == 0


# -- memory: read shard by shard, tensor by tensor -----------------------------------------------------------------

PEAK_CHILD = """
import json, sys
from pathlib import Path
from islands.models.config import ModelConfig
from islands.models.hf.families import open_import
model = ModelConfig(**json.loads(sys.argv[2]))
shapes = {k: tuple(v) for k, v in json.loads(sys.argv[3]).items()}
imported = open_import(Path(sys.argv[1]), model, shapes, "init.from")
def peak():  # this process's own high-water mark (ru_maxrss would carry the parent's across fork and exec)
    line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024
before = peak()
leaves = dict(imported.leaves())
print(json.dumps({"growth": peak() - before, "theta": sum(a.nbytes for a in leaves.values())}))
"""


@pytest.mark.slow
def test_a_bfloat16_checkpoint_imports_without_a_second_copy(tmp_path: Path) -> None:
    """θ as float32 leaves costs the host θ and a leaf or two more, not the checkpoint's bytes as well: a Llama-shaped
    bfloat16 checkpoint in two shards grows a fresh process's peak by less than θ plus three of its largest leaves
    (a reader that kept the file's bytes while converting would need θ plus half of θ)."""
    import ml_dtypes

    from floor import safetensors
    from islands.models.config import ModelConfig
    from islands.models.hf import llama

    section = {"kind": "llama", "vocab_size": 4096, "d_model": 1024, "n_layers": 4, "n_heads": 8, "d_ff": 2816,
               "tie_embeddings": False, "seq_len": 64}  # fmt: skip
    model = ModelConfig(**section)
    shapes = {n: tuple(a.shape) for n, a in flatten_named(jax.eval_shape(build_model(model).init, jax.random.key(0)), to_numpy=False).items()}  # fmt: skip
    rules = llama.rules(model, "LlamaForCausalLM")
    tensors = {}
    for rule in rules:
        shape = rule.their_shape(shapes[rule.ours])
        tensors[rule.theirs[0]] = np.full(shape, 0.5, ml_dtypes.bfloat16)
    names = sorted(tensors)
    half = len(names) // 2
    for i, part in enumerate((names[:half], names[half:]), 1):
        safetensors.write(tmp_path / f"model-0000{i}-of-00002.safetensors", {n: tensors[n] for n in part})
    weight_map = {n: f"model-0000{1 + (j >= half)}-of-00002.safetensors" for j, n in enumerate(names)}
    (tmp_path / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (tmp_path / "config.json").write_text(json.dumps(llama.config_json(model, "LlamaForCausalLM")))
    file_bytes = sum(a.nbytes for a in tensors.values())
    del tensors
    out = subprocess.run(
        [sys.executable, "-c", PEAK_CHILD, str(tmp_path), json.dumps(section), json.dumps(shapes)],
        capture_output=True, text=True, timeout=240, check=True, env=child_env(),
    )  # fmt: skip
    result = json.loads(out.stdout.strip().splitlines()[-1])
    largest = max(np.prod(s) for s in shapes.values()) * 4
    print(json.dumps({**result, "file_bytes": file_bytes, "largest_leaf": int(largest)}))
    assert result["theta"] == 2 * file_bytes
    assert result["growth"] < result["theta"] + 3 * largest, result


def test_a_checkpoint_has_no_inner_state_to_start_from(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = run_config(tmp_path, FIXTURES / "qwen3")
    config.write_text(config.read_text() + "inner_state = true\n")
    fails(capsys, ["simulate", str(config), "--run-dir", str(tmp_path / "run"), "--no-progress"],
          "is a Hugging Face checkpoint, which holds no optimizer state")  # fmt: skip
    assert not (tmp_path / "run").exists()


def test_the_reference_of_a_run_from_a_checkpoint_is_the_checkpoint(tmp_path: Path) -> None:
    """dpo's and rl's workload.reference = "start" is θ_0: the checkpoint's weights, read as init.from reads them."""
    from diloco.run.warm_start import reference_params

    cfg = load_config(run_config(tmp_path, FIXTURES / "qwen3"))
    like = jax.eval_shape(build_model(cfg.model).init, jax.random.key(0))
    params, source = reference_params(cfg, like)
    assert source == str(FIXTURES / "qwen3")
    with SafetensorsFile(FIXTURES / "qwen3" / "model.safetensors") as f:
        wq = f.read("model.layers.1.self_attn.q_proj.weight")
    assert np.array_equal(np.asarray(params["blocks"][1]["attn"]["wq"]), wq.T)


def test_a_model_without_a_hugging_face_architecture_is_refused_in_one_line() -> None:
    from islands.models.config import ModelConfig, ModelError
    from islands.models.hf.families import family_of

    with pytest.raises(ModelError, match="model.kind = 'moe' has no Hugging Face architecture"):
        family_of(ModelConfig(kind="moe"))
