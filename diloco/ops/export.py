"""`diloco export RUN_DIR --out DIR`: a run's newest committed θ as files any framework loads (docs/export.md).

    DIR/model.safetensors   every parameter, float32, named by its pytree path (pytrees/naming.py:
                            "blocks/0/attn/wqkv"); written by floor/safetensors.py, no runtime dependency
    DIR/config.json         FORMAT, the [model] section, how text becomes tokens (`text_kind`),
                            the round θ was committed at, its digest, where it was read from
    DIR/tokenizer.json      the run's Hugging Face tokenizer, for a data.kind = "tokens" run

θ is what `diloco sample` and `init.from` read (diloco/ops/trained.py). An existing DIR that holds anything is refused
unless `force`, which replaces these three files (and removes a tokenizer.json that the run has none for).

A run with workload.lora (islands/models/lora.py) exports its adapters merged into their base, W + (α / r)·A·B, in
either format: the model a run without LoRA would have exported; `--format peft` writes the adapters alone
(`export_peft`), as PEFT's LoraModel saves them, for its PeftModel.from_pretrained over the base checkpoint:

    DIR/adapter_model.safetensors   base_model.model.{Hugging Face module}.lora_A.weight [r, in] and .lora_B.weight
                                    [out, r] per adapted matrix (A and B of islands/models/lora.py, transposed)
    DIR/adapter_config.json         peft_type LORA, r, lora_alpha, target_modules (the Hugging Face modules' names)

`--format hf` writes a Hugging Face directory instead (`export_hf`), which transformers' AutoModelForCausalLM and
AutoTokenizer load without this project (islands/models/hf/):

    DIR/config.json                 the config.json the run started from (RUN/hf/), or one made from [model]
                                    (with the run tokenizer's BOS / EOS / pad ids)
    DIR/model.safetensors           Hugging Face's tensor names and layouts, in float32 or bfloat16; or shards of
    DIR/model-0000i-of-0000N...     at most --max-shard-size each and model.safetensors.index.json
    DIR/tokenizer.json, ...         the tokenizer files the run started from (RUN/hf/), else the run's own with
                                    the tokenizer_config.json beside it (special tokens, chat template)
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from diloco.config import to_dict
from diloco.ops.trained import Trained, load_trained
from floor import safetensors
from floor.errors import UserError
from islands.data import DataConfig
from islands.models.base import param_count
from islands.models.config import ModelConfig
from islands.models.hf import checkpoint, tensors
from islands.models.hf.families import checkpoint_model, family_of
from islands.prepared import TOKENIZER_FILE
from islands.text import CHAT_TEMPLATE_FILE, TOKENIZER_CONFIG, TokenizerText, read_tokenizer_config, tokenizer_file
from pytrees.naming import flatten_named

FORMAT = "diloco-export/1"
"""config.json's `format`: bumped when a field a loader reads changes meaning."""
WEIGHTS = "model.safetensors"
CONFIG = "config.json"
FORMATS = ("diloco", "hf", "peft")
"""--format: the project's own (the default), Hugging Face's, or a LoRA run's adapters alone in PEFT's layout."""
PEFT_WEIGHTS = "adapter_model.safetensors"
PEFT_CONFIG = "adapter_config.json"
DTYPES: dict[str, np.dtype] = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}
"""--dtype of a Hugging Face export: the weights as trained, or halved."""
MAX_SHARD_SIZE = "5GB"
"""--max-shard-size's default (the Hub's usual shard)."""
SPECIAL_IDS = ("bos_token", "eos_token", "pad_token")
"""The special tokens whose ids a config.json made from [model] carries (`special_token_ids`)."""


class ExportError(UserError, ValueError):
    """`diloco export` cannot write where it was told to (a non-empty --out without --force, a file)."""


def check_out(out: Path, force: bool) -> None:
    """Refuse an --out that is a file, or a directory holding anything unless `force`."""
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {str(out)!r} is a file, not a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ExportError(f"--out {str(out)!r} is not empty: choose another directory, or --force to replace an export")


def text_kind(data_kind: str, tokenizer: Path | None) -> str:
    """config.json's `text`: "tokenizer" (the run's tokenizer.json, beside it), "bytes" (a token is a UTF-8 byte) or
    "ids" (a data.kind = "tokens" run whose corpus has no tokenizer.json: the ids mean what its preparer made them
    mean)."""
    if tokenizer is not None:
        return "tokenizer"
    return "ids" if data_kind == "tokens" else "bytes"


def export(run_dir: Path, out: Path, force: bool = False) -> dict[str, Any]:
    """Write the export of the run's newest committed θ into `out`; returns config.json's contents."""
    check_out(out, force)
    trained = load_trained(run_dir)
    tensors = flatten_named(trained.params)
    tokenizer = tokenizer_file(trained.data)
    config = {
        "format": FORMAT,
        "model": to_dict(trained.model),
        "text": text_kind(trained.data.kind, tokenizer),
        "tokenizer": TOKENIZER_FILE if tokenizer is not None else None,
        "round": trained.round,
        "digest": trained.digest,
        "param_count": param_count(trained.params),
        "tensors": len(tensors),
        **({"lora": to_dict(trained.workload.lora)} if trained.adapters is not None else {}),
        "source": str(trained.step_dir),
    }
    out.mkdir(parents=True, exist_ok=True)
    safetensors.write(out / WEIGHTS, tensors, {"format": "np", "diloco": FORMAT, "digest": trained.digest})
    if tokenizer is not None:
        shutil.copyfile(tokenizer, out / TOKENIZER_FILE)
    else:
        (out / TOKENIZER_FILE).unlink(missing_ok=True)
    (out / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return config


def hf_config(
    model: ModelConfig, kept: Path | None, dtype: str, token_ids: dict[str, int] | None = None
) -> tuple[dict[str, Any], str]:
    """config.json of a Hugging Face export of `model` and its architecture: `kept` (the config.json of the checkpoint
    the run started from, RUN/hf/config.json) with the dtype written, else one made from [model] with the run
    tokenizer's special ids (`special_token_ids`), which transformers' generate stops and pads with."""
    family = family_of(model)
    if kept is None:
        try:
            architecture = family.architecture_of(model)
        except ValueError as exc:
            raise ExportError(f"--format hf: {exc}") from None
        return family.config_json(model, architecture) | (token_ids or {}) | {"torch_dtype": dtype}, architecture
    config = checkpoint.read_json(kept, "--format hf")
    fixed = checkpoint_model(config, f"'{kept}'")
    ours = {**to_dict(model), "n_kv_heads": model.kv_heads, "head_dim": model.head_size}
    differing = sorted(key for key, value in fixed.items() if ours.get(key) != value)
    if differing:
        key = differing[0]
        raise ExportError(f"--format hf: model.{key} is {ours.get(key)!r}, but '{kept}' says {fixed[key]!r}")
    written = {key: dtype for key in ("dtype", "torch_dtype") if key in config} or {"torch_dtype": dtype}
    return config | written, config["architectures"][0]


def write_hf(
    out: Path,
    model: ModelConfig,
    params: dict[str, np.ndarray],
    kept: Path | None,
    dtype: str,
    max_bytes: int,
    token_ids: dict[str, int] | None = None,
) -> tuple[list[str], str]:
    """Write `params` (named as pytrees/naming.py names them) of `model` into the existing directory `out` as a
    Hugging Face checkpoint (`hf_config`'s config.json, the weights in `dtype`, shards of at most `max_bytes`);
    returns the files written and the architecture."""
    if dtype not in DTYPES:
        raise ExportError(f"--dtype must be one of {', '.join(DTYPES)} (got {dtype!r})")
    config, architecture = hf_config(model, kept, dtype, token_ids)
    family = family_of(model)
    named = family.complete(params, model)
    rules = family.rules(model, architecture)
    shapes = {name: tuple(array.shape) for name, array in named.items()}
    slots = tensors.slots(rules)
    for stale in [*out.glob("model*.safetensors"), out / checkpoint.INDEX]:
        stale.unlink(missing_ok=True)
    files = checkpoint.write(
        out,
        tensors.hf_sizes(rules, shapes, DTYPES[dtype]),
        lambda name: tensors.export_tensor(*slots[name], named, DTYPES[dtype]),
        max_bytes,
    )
    (out / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return [CONFIG, *files], architecture


def export_hf(
    run_dir: Path, out: Path, force: bool = False, dtype: str = "float32", max_shard_size: str = MAX_SHARD_SIZE
) -> dict[str, Any]:
    """Write the run's newest committed θ into `out` as a Hugging Face directory; returns what was written."""
    if dtype not in DTYPES:
        raise ExportError(f"--dtype must be one of {', '.join(DTYPES)} (got {dtype!r})")
    try:
        max_bytes = checkpoint.parse_size(max_shard_size)
    except ValueError as exc:
        raise ExportError(f"--max-shard-size: {exc}") from None
    check_out(out, force)
    trained = load_trained(run_dir)
    kept = trained.run_dir / checkpoint.RUN_FILES / checkpoint.CONFIG
    base = kept if kept.is_file() else None
    hf_config(trained.model, base, dtype)  # a model no architecture computes is refused before anything is written
    token_ids = special_token_ids(trained.data, trained.model.vocab_size) if base is None else None
    out.mkdir(parents=True, exist_ok=True)
    files, architecture = write_hf(out, trained.model, flatten_named(trained.params), base, dtype, max_bytes, token_ids)
    files += tokenizer_files(trained, out)
    return {
        "format": "hf",
        "architecture": architecture,
        "dtype": dtype,
        "files": files,
        "round": trained.round,
        "digest": trained.digest,
        "param_count": param_count(trained.params),
        "source": str(trained.step_dir),
    }


def export_peft(run_dir: Path, out: Path, force: bool = False) -> dict[str, Any]:
    """Write a LoRA run's newest committed adapters into `out` in PEFT's layout (module docstring); returns what was
    written. A run without workload.lora, or of a model Hugging Face has no architecture for, is one line."""
    check_out(out, force)
    trained = load_trained(run_dir)
    if trained.adapters is None:
        raise ExportError(
            f"--format peft writes LoRA adapters, and '{trained.run_dir}' trained every parameter "
            "(workload.lora.rank = 0): use --format hf"
        )
    family = family_of(trained.model)
    try:
        architecture = family.architecture_of(trained.model)
    except ValueError as exc:
        raise ExportError(f"--format peft: {exc}") from None
    where = {rule.ours: rule.theirs[0] for rule in family.rules(trained.model, architecture) if len(rule.theirs) == 1}
    named = flatten_named(trained.adapters)
    tensors_out: dict[str, np.ndarray] = {}
    modules: set[str] = set()
    for name in sorted(named):
        leaf, factor = name.rsplit("/", 1)
        module = where[leaf].removesuffix(".weight")
        modules.add(module.rsplit(".", 1)[-1])
        peft_factor = "lora_A" if factor == "lora_a" else "lora_B"
        tensors_out[f"base_model.model.{module}.{peft_factor}.weight"] = np.ascontiguousarray(named[name].T)
    lora = trained.workload.lora
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": sorted(modules),
        "bias": "none",
        "fan_in_fan_out": trained.model.kind == "transformer",  # GPT-2's Conv1D stores [in, out]
        "inference_mode": True,
        "base_model_name_or_path": trained.run_dir.joinpath(checkpoint.RUN_FILES).as_posix(),
    }
    out.mkdir(parents=True, exist_ok=True)
    safetensors.write(out / PEFT_WEIGHTS, tensors_out, {"format": "pt", "diloco": FORMAT, "digest": trained.digest})
    (out / PEFT_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return {
        "format": "peft",
        "architecture": architecture,
        "files": [PEFT_WEIGHTS, PEFT_CONFIG],
        "tensors": len(tensors_out),
        "target_modules": config["target_modules"],
        "round": trained.round,
        "digest": trained.digest,
        "param_count": param_count(trained.adapters),
        "source": str(trained.step_dir),
    }


def byte_tokenizer() -> dict[str, Any]:
    """A byte-level run's codec (a token is one byte of the UTF-8 text, id = the byte's value) as a Hugging Face
    tokenizer.json: GPT-2's byte-to-character table (each byte a printable character) as a BPE vocabulary without
    merges, the text split into bytes whole (no regex), decoded back the same way."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    chars = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(others)}
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [],
        "normalizer": None,
        "pre_tokenizer": byte_level,
        "post_processor": None,
        "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {chars[b]: b for b in range(256)}, "merges": []},
    }  # fmt: skip


def special_token_ids(data: DataConfig, vocab_size: int) -> dict[str, int]:
    """config.json's bos_token_id, eos_token_id and pad_token_id: the ids of the special tokens that the
    tokenizer_config.json beside the run's tokenizer names (none for a byte-level run, or a tokenizer without one)."""
    tokenizer = tokenizer_file(data)
    if tokenizer is None:
        return {}
    text = TokenizerText(tokenizer, vocab_size, "diloco export --format hf")
    ids = {f"{name.removesuffix('_token')}_token_id": text.special_id(name) for name in SPECIAL_IDS}
    return {key: value for key, value in ids.items() if value is not None}


def tokenizer_files(trained: Trained, out: Path) -> list[str]:
    """The tokenizer beside a Hugging Face export: the files of the checkpoint the run started from (RUN/hf/), else
    the run's own (its data's tokenizer.json, or a byte-level run's `byte_tokenizer`) with a tokenizer_config.json:
    the one beside the run's tokenizer (its special tokens and chat template, which the run read too), naming the
    class that loads it."""
    kept = trained.run_dir / checkpoint.RUN_FILES
    if kept.is_dir():
        return checkpoint.copy_files(kept, out)
    tokenizer = tokenizer_file(trained.data)
    (out / CHAT_TEMPLATE_FILE).unlink(missing_ok=True)  # a --force export's old one is not this run's
    template: list[str] = []
    if tokenizer is not None:
        shutil.copyfile(tokenizer, out / TOKENIZER_FILE)
        config = read_tokenizer_config(tokenizer)
        template = checkpoint.copy_files(tokenizer.parent, out, (CHAT_TEMPLATE_FILE,))
    else:
        (out / TOKENIZER_FILE).write_text(json.dumps(byte_tokenizer()) + "\n")
        config = {}
    config = {**config, "tokenizer_class": config.get("tokenizer_class", "PreTrainedTokenizerFast")}
    (out / TOKENIZER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return [TOKENIZER_FILE, TOKENIZER_CONFIG, *template]
