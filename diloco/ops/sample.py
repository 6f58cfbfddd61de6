"""`diloco sample RUN_DIR --prompt TEXT ...`: continue prompts with the newest committed θ of a run.

The run's θ and config come from `diloco/ops/trained.py` (what init.from reads), its text codec from islands/text.py
(bytes, or the run's tokenizer.json), the generation from islands/sampling.py on a mesh of the run's islands.devices
(as many as this process has). All prompts are one batch, padded to the longest: every row has the same number of
positions for its continuation, `--max-new-tokens` (default: what the context leaves, at most `DEFAULT_NEW_TOKENS`).
A continuation ends early at the stop text (`--stop`, one token of the run's text; by default the run tokenizer's
end-of-sequence token where it has one, else a post-training run's stop, a newline, and none for a language model's),
which its `continuation` leaves out and its `tokens` keep.
A bad argument is one line naming it, before the run is read; a prompt too long for the context is one line too.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from diloco.ops.trained import load_trained
from floor.errors import UserError
from islands.mesh import Layout, build_mesh
from islands.models.axes import axis_units
from islands.sampling import generate, place_rows
from islands.text import TextCodec, TokenizerText, text_codec
from islands.workloads.text import with_stop

DEFAULT_NEW_TOKENS = 128
"""New tokens per prompt when --max-new-tokens is not given (fewer when the context has less room)."""


class SampleError(UserError, ValueError):
    """An argument of `diloco sample` that cannot be used (a temperature below 0, a prompt too long, ...)."""


def check_arguments(
    prompts: Sequence[str], max_new_tokens: int | None, temperature: float, top_p: float, stop: str | None = None
) -> None:
    """Refuse a bad argument in one line naming its flag, before the run directory is read."""
    if stop == "":
        raise SampleError("--stop is empty: give the text a continuation ends at (a newline: --stop $'\\n')")
    if not prompts:
        raise SampleError("give at least one --prompt TEXT")
    for i, prompt in enumerate(prompts, 1):
        if not prompt:
            raise SampleError(f"--prompt {i} is empty: a continuation needs at least one token to follow")
    if max_new_tokens is not None and max_new_tokens < 1:
        raise SampleError(f"--max-new-tokens must be >= 1 (got {max_new_tokens})")
    if not np.isfinite(temperature) or temperature < 0:
        raise SampleError(f"--temperature must be a finite number >= 0 (got {temperature}; 0 is greedy)")
    if not (0 < top_p <= 1):
        raise SampleError(f"--top-p must be in (0, 1] (got {top_p}; 1 keeps every token)")


def sample(
    run_dir: Path,
    prompts: Sequence[str],
    max_new_tokens: int | None = None,
    temperature: float = 1.0,
    top_p: float = 1.0,
    seed: int = 0,
    stop: str | None = None,
) -> dict[str, Any]:
    """Each prompt's continuation from the run's newest committed θ, with where θ came from (JSON-able). `stop`:
    the text a continuation ends at (None: the run's own, module docstring)."""
    check_arguments(prompts, max_new_tokens, temperature, top_p, stop)
    trained = load_trained(run_dir)
    seq_len = trained.model.seq_len
    codec = text_codec(trained.data, trained.model.vocab_size, "diloco sample")
    stop_token = None if stop is None else _stop_token(codec, stop)
    has_eos = isinstance(codec, TokenizerText) and codec.eos is not None
    if stop is None and (has_eos or trained.workload.post_training(trained.islands.island_names)):
        stop_token = with_stop(codec).stop
        stop = codec.decode([stop_token])
    encoded = [codec.encode(p) for p in prompts]
    width = max(len(ids) for ids in encoded)
    room = seq_len - width
    if room < 1 or (max_new_tokens is not None and max_new_tokens > room):
        longest = int(np.argmax([len(ids) for ids in encoded])) + 1
        want = 1 if max_new_tokens is None else max_new_tokens
        raise SampleError(
            f"--prompt {longest} is {width} tokens: with {want} new token(s) that is beyond model.seq_len ({seq_len}) "
            f"of this run; shorten it or ask for at most {max(room, 0)} new tokens"
        )
    new_tokens = min(DEFAULT_NEW_TOKENS, room) if max_new_tokens is None else max_new_tokens
    rows = np.zeros((len(encoded), width), np.int32)
    for b, ids in enumerate(encoded):
        rows[b, : len(ids)] = ids
    lens = np.array([len(ids) for ids in encoded], np.int32)
    n_devices = min(trained.islands.devices, len(jax.devices()))
    mesh = build_mesh(n_devices, tensor=math.gcd(n_devices, trained.islands.tensor))
    layout = Layout(mesh, trained.islands.shard_params, axis_units(trained.model))
    params, (rows_placed, lens_placed) = place_rows(layout, trained.params, rows, lens)
    tokens, lengths = generate(
        params,
        trained.model,
        rows_placed,
        lens_placed,
        key=jax.random.key(seed),
        max_new_tokens=new_tokens,
        temperature=temperature,
        top_p=top_p,
        stop_token=stop_token,
    )
    tokens, lengths = np.asarray(tokens)[: len(prompts)], np.asarray(lengths)[: len(prompts)]
    samples = []
    for p, t, n in zip(prompts, tokens, lengths, strict=True):
        ids = t[:n].tolist()
        shown = ids[:-1] if ids and stop_token is not None and ids[-1] == stop_token else ids
        samples.append({"prompt": p, "continuation": codec.decode(shown), "tokens": ids})
    return {
        "run_dir": str(trained.run_dir),
        "checkpoint": str(trained.step_dir),
        "round": trained.round,
        "digest": trained.digest,
        "text": codec.kind,
        "max_new_tokens": new_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "seed": seed,
        "stop": stop,
        "samples": samples,
    }


def _stop_token(codec: TextCodec, stop: str) -> int:
    """The one token id of the stop text in the run's text; a text of more or fewer tokens is one line."""
    ids = codec.encode(stop)
    if len(ids) != 1:
        raise SampleError(f"--stop {stop!r} is {len(ids)} tokens of this run's text: a continuation stops at one token")
    return ids[0]


def as_text(result: dict[str, Any]) -> str:
    """The continuations as plain text: the one continuation alone, or each under a `==> PROMPT <==` line."""
    samples = result["samples"]
    if len(samples) == 1:
        return samples[0]["continuation"]
    return "\n\n".join(f"==> {s['prompt']} <==\n{s['continuation']}" for s in samples)
