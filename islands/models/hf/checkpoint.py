"""A Hugging Face model directory on local disk, as `save_pretrained` writes it and the Hub serves it:

    DIR/config.json                     the architecture (`architectures`, `model_type`) and its sizes
    DIR/model.safetensors               every tensor; or, sharded, the shards and their index:
    DIR/model.safetensors.index.json    {"metadata": {"total_size": BYTES}, "weight_map": {TENSOR: SHARD, ...}}
    DIR/model-00001-of-0000N.safetensors, ...
    DIR/tokenizer.json, tokenizer_config.json, generation_config.json, ...   (`TOKENIZER_FILES`: copied through)

`Checkpoint.open` checks all of it before a tensor's bytes are read: config.json is a JSON object, the index lists only
shards that lie beside it, every shard's header is valid (floor/safetensors.py) and holds what the index says it does,
and no tensor is in two shards. `Checkpoint.read` then visits the shards one after the other, each tensor once, so a
checkpoint is never in memory twice. As transformers does, model.safetensors is read where both it and an index are.
`write` is the reverse: tensors in shards of at most `max_bytes`, and the index where there is more than one.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from floor import safetensors
from floor.errors import UserError
from floor.safetensors import Entry, SafetensorsError, SafetensorsFile

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)
"""The files beside the weights that a run keeps and an export writes back as they were: the tokenizer (its special
tokens and chat template) and the generation defaults."""

RUN_FILES = "hf"
"""The directory of a run (RUN/hf/) that keeps the config.json and `TOKENIZER_FILES` of the checkpoint it started from:
the tokenizer the run's text goes through, and what `diloco export --format hf` writes back beside the weights."""

SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
"""--max-shard-size's units, as transformers reads them (KB = 1000 bytes, KiB = 1024)."""


class CheckpointError(UserError, ValueError):
    """A Hugging Face directory that cannot be read or written as asked: one line naming the file, key or tensor."""


def kept_tokenizer_file(run_dir: Path, tokenizer: str, init_from: str) -> Path | None:
    """RUN/hf/tokenizer.json where `tokenizer` (a run's data.tokenizer) is the tokenizer.json of its init.from
    checkpoint, which the run copied there when it started (diloco/config.py `with_checkpoint_model` names the
    checkpoint's own, or the RUN/hf/ one of the run init.from names, which lies in or above init.from): the bytes the
    run read, wherever the checkpoint has gone since. None otherwise."""
    kept = run_dir / RUN_FILES / "tokenizer.json"
    if not (tokenizer and init_from and kept.is_file()):
        return None
    named, source = Path(tokenizer).expanduser(), Path(init_from).expanduser()
    home = named.parent.parent  # the run directory whose RUN/hf/ holds it
    of_a_run = named.parent.name == RUN_FILES and (source == home or home in source.parents)
    if named != source / "tokenizer.json" and not of_a_run:
        return None
    return kept


def is_checkpoint(path: Path) -> bool:
    """Whether `path` is a Hugging Face model directory (a config.json, and no config.toml: a run directory of this
    project is not one)."""
    return path.is_dir() and (path / CONFIG).is_file() and not (path / "config.toml").exists()


def run_directory(path: Path) -> Path | None:
    """The run directory of this project that `path` names: the run directory itself, or a checkpoint directory or
    step inside it (the nearest of `path` and its three parents with a config.toml); None for any other path."""
    return next((d for d in (path, *list(path.parents)[:3]) if (d / "config.toml").is_file()), None)


def kept_checkpoint(path: Path) -> Path | None:
    """The Hugging Face directory behind init.from `path`: `path` itself when it is one, else the RUN/hf/ of the run
    directory `path` names when that run started from a checkpoint (None otherwise). A run from such a run is a run
    from the same checkpoint as trained so far, so its [model], its tokenizer and the files `diloco export --format
    hf` writes back go down a chain of stages (pre-trained -> SFT -> RL) unchanged."""
    if is_checkpoint(path):
        return path
    run = run_directory(path) if path.exists() else None
    kept = None if run is None else run / RUN_FILES
    return kept if kept is not None and (kept / CONFIG).is_file() else None


def read_json(path: Path, where: str) -> dict[str, Any]:
    """A JSON object from a file; one line naming it when it is missing, not JSON or not an object."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{where}: '{path}' does not exist") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{where}: '{path}' is not readable JSON ({exc})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{where}: '{path}' holds a JSON {type(data).__name__}, not an object")
    return data


def read_config(directory: Path, where: str) -> dict[str, Any]:
    """config.json of a Hugging Face directory (an export of this project's own format is refused: it has no
    architecture to read)."""
    config = read_json(directory / CONFIG, where)
    if str(config.get("format", "")).startswith("diloco-export"):
        raise CheckpointError(
            f"{where}: '{directory}' is a `diloco export` in this project's own format: start from the run directory "
            "it came from, or export it with --format hf"
        )
    return config


def _shard_name(name: object, index: Path, where: str) -> str:
    """A weight_map value: a file name beside the index (no directory part, which could point anywhere)."""
    if not isinstance(name, str) or not name or Path(name).name != name or name in (".", ".."):
        raise CheckpointError(f"{where}: '{index}' maps a tensor to {name!r}, not a file name beside it")
    return name


@dataclass(frozen=True)
class Checkpoint:
    """A Hugging Face directory whose config.json, index and shard headers are checked (`open`)."""

    directory: Path
    config: dict[str, Any]
    """config.json."""
    tensors: dict[str, tuple[Path, Entry]]
    """Tensor name -> the shard that holds it and its header entry."""

    @classmethod
    def open(cls, directory: Path, where: str = "init.from") -> Checkpoint:
        config = read_config(directory, where)
        if (directory / WEIGHTS).is_file():
            listed: dict[str, str] | None = None
            shards = [WEIGHTS]
        elif (directory / INDEX).is_file():
            index = read_json(directory / INDEX, where)
            weight_map = index.get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise CheckpointError(f"{where}: '{directory / INDEX}' has no weight_map of tensor names to shards")
            listed = {str(name): _shard_name(shard, directory / INDEX, where) for name, shard in weight_map.items()}
            shards = sorted(set(listed.values()))
        else:
            raise CheckpointError(
                f"{where}: '{directory}' has neither {WEIGHTS} nor {INDEX} (a PyTorch .bin checkpoint must be "
                "converted to safetensors first)"
            )
        missing = [shard for shard in shards if not (directory / shard).is_file()]
        if missing:
            raise CheckpointError(f"{where}: shard '{directory / missing[0]}' that {INDEX} lists does not exist")
        tensors: dict[str, tuple[Path, Entry]] = {}
        for shard in shards:
            path = directory / shard
            try:
                with SafetensorsFile(path) as f:
                    entries = f.entries
            except SafetensorsError as exc:
                raise CheckpointError(f"{where}: {exc}") from None
            for name, entry in entries.items():
                if name in tensors:
                    raise CheckpointError(f"{where}: tensor '{name}' is in both '{tensors[name][0]}' and '{path}'")
                if listed is not None and listed.get(name) != shard:
                    raise CheckpointError(f"{where}: '{path}' holds tensor '{name}', which {INDEX} does not map to it")
                tensors[name] = (path, entry)
        if listed is not None:
            absent = sorted(listed.keys() - tensors.keys())
            if absent:
                raise CheckpointError(
                    f"{where}: {INDEX} maps tensor '{absent[0]}' to '{directory / listed[absent[0]]}', which lacks it"
                )
        return cls(directory, config, tensors)

    def read(self, names: Iterable[str]) -> Iterator[tuple[str, np.ndarray]]:
        """The tensors `names` (each once, in any order), shard after shard, in the order of their bytes in each."""
        by_shard: dict[Path, list[str]] = {}
        for name in set(names):
            by_shard.setdefault(self.tensors[name][0], []).append(name)
        for shard in sorted(by_shard):
            with SafetensorsFile(shard) as f:
                for name in sorted(by_shard[shard], key=lambda n: self.tensors[n][1].begin):
                    yield name, f.read(name)


def parse_size(text: str) -> int:
    """ "5GB", "500MB", "64KiB" or a number of bytes -> bytes (as transformers' max_shard_size); a ValueError
    saying why not."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).upper() if match else ""
    if match is None or unit not in SIZE_UNITS or float(match.group(1)) * SIZE_UNITS[unit] < 1:
        raise ValueError(f"{text!r} is not a size (a number of bytes, or one with KB, MB, GB, KiB, MiB, GiB)")
    return int(float(match.group(1)) * SIZE_UNITS[unit])


def plan_shards(sizes: Sequence[tuple[str, int]], max_bytes: int) -> list[list[str]]:
    """Tensor names in their order, cut into shards of at most `max_bytes` each (a larger tensor alone in one)."""
    shards: list[list[str]] = [[]]
    filled = 0
    for name, nbytes in sizes:
        if shards[-1] and filled + nbytes > max_bytes:
            shards.append([])
            filled = 0
        shards[-1].append(name)
        filled += nbytes
    return shards


def write(
    directory: Path,
    sizes: Sequence[tuple[str, int]],
    produce: Callable[[str], np.ndarray],
    max_bytes: int,
) -> list[str]:
    """Write the tensors `sizes` names (with their bytes), each made by `produce(name)` when its shard is written,
    as model.safetensors or as shards and their index; returns the files written. A shard's tensors are in memory
    while it is written, no more."""
    shards = plan_shards(sizes, max_bytes)
    n = len(shards)
    files = [WEIGHTS] if n == 1 else [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    for file, names in zip(files, shards, strict=True):
        safetensors.write(directory / file, {name: produce(name) for name in names}, {"format": "pt"})
    if len(files) > 1:
        index = {
            "metadata": {"total_size": sum(nbytes for _, nbytes in sizes)},
            "weight_map": {name: file for file, names in zip(files, shards, strict=True) for name in sorted(names)},
        }
        (directory / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        files.append(INDEX)
    return files


def copy_files(source: Path, destination: Path, names: Sequence[str] = TOKENIZER_FILES) -> list[str]:
    """Copy the files of `names` that `source` has into `destination` (made if needed); returns those copied."""
    present = [name for name in names if (source / name).is_file()]
    if present:
        destination.mkdir(parents=True, exist_ok=True)
    for name in present:
        shutil.copyfile(source / name, destination / name)
    return present
