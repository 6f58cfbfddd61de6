"""Shared fixtures: small configs and corpora that tests make for themselves (never the shared data)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent

TINY_TOML = """
[run]
name = "test"
seed = 0

[model]
kind = "transformer"
vocab_size = 256
seq_len = 16
d_model = 32
n_layers = 1
n_heads = 2
d_ff = 64

[data]
kind = "text"
path = "{corpus}"
val_fraction = 0.1

[train]
rounds = 3
inner_steps = 4
batch_size = 8
eval_batches = 2
checkpoint_every = 1
log_every = 2

[inner]
lr = 3e-3
warmup_steps = 2

[islands]
count = 2
"""


def write_corpus(path: Path, n_bytes: int = 40_000, seed: int = 0) -> Path:
    """A learnable byte corpus: words drawn from a small vocabulary, so loss falls well below log(256)."""
    rng = np.random.default_rng(seed)
    words = ["the", "island", "round", "delta", "outer", "inner", "model", "wan", "link", "loss", "step"]
    text = " ".join(words[i] for i in rng.integers(0, len(words), size=n_bytes // 4))
    path.write_bytes(text.encode()[:n_bytes])
    return path


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    return write_corpus(tmp_path / "corpus.txt")


@pytest.fixture
def tiny_config(tmp_path: Path, corpus: Path) -> Path:
    cfg = tmp_path / "tiny.toml"
    cfg.write_text(TINY_TOML.format(corpus=corpus))
    return cfg


def child_env(devices: int = 1) -> dict[str, str]:
    """Environment for a child JAX process with `devices` CPU devices (set before JAX starts)."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def run_cli(*args: str, timeout: float = 240, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "diloco.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=child_env(),
        cwd=cwd or REPO,
    )
