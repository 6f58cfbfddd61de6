"""`diloco bench plan`: the memory plan at size (islands/step_memory.py) against XLA at the sizes this host compiles,
and the plan's table for Llama 3.2 1B, 3.1 8B and 3.1 70B on islands of 8 and 64 80 GB devices.

The check: a Llama of tens of millions of parameters (`CHECK_MODEL`) is compiled as an island's train step
(islands/inner.py `make_train_step`, AdamW, on data x tensor meshes of forced host devices, with and
without islands.shard_params, float32 and bfloat16, remat off and on), in a child process that sets
XLA_FLAGS=--xla_force_host_platform_device_count before JAX starts. The measured figure is XLA's compiled memory
analysis per device (islands/memory.py `Footprint.total`: arguments, outputs not donated, temporaries, code): the
buffers XLA assigns the step on each device, which a GPU's allocator must hold while it runs, the same parts the plan
counts (its state and its step; the uplink's host buffers and a generation's cache are not in the step). A process's
resident memory would not compare: on CPU every forced device is the one host's memory, beside the runtime.

Reported (JSON): each case's plan and XLA's figure in MiB and plan / measured (`within_1_5x`: the issue's bound,
either way), and XLA's count of the step's flops per device (its cost analysis: what LoRA's unmerged adapters save
shows there). `--table`: the plan at size for the three Llama shapes (pure arithmetic, nothing compiled).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from diloco.bench.errors import BenchError
from diloco.bench.flops import xla_flops
from islands.memory import GB
from islands.models.config import ModelConfig
from islands.step_memory import step_memory
from islands.workloads.config import LoraConfig

RATIO_BOUND = 1.5
MIB = 1 << 20

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
SHAPES = ("llama-3.2-1b", "llama-3.1-8b", "llama-3.1-70b")
"""The Llama 3 shapes of the table: configs/NAME.toml (1,235,814,400, 8,030,261,248 and 70,553,706,496 parameters)."""

TABLE_SEQ_LEN = 2048
TABLE_MESHES = {8: ((8, 1), (4, 2), (1, 8)), 64: ((8, 8), (64, 1))}
"""Island sizes and their data x tensor splits in the table."""

DEVICES_PER_HOST = 8
"""The table's hosts: an island of 64 devices is 8 processes, its parameters split across them (FSDP)."""

TABLE_LORA = LoraConfig(rank=16, targets=("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"), base_dtype="bfloat16")

CHECK_MODEL = dict(
    kind="llama", vocab_size=8192, seq_len=256, d_model=512, n_layers=4, n_heads=8, n_kv_heads=2, d_ff=1408
)
"""The checked shape: 19.7M parameters (untied), every width of a Llama in small."""

CHECK_CASES: tuple[tuple[int, int, bool, str, bool, bool], ...] = (
    (1, 1, False, "float32", False, False),
    (2, 1, False, "float32", False, False),
    (2, 1, True, "float32", False, False),
    (4, 1, True, "float32", False, False),
    (1, 1, False, "bfloat16", False, False),
    (2, 1, True, "bfloat16", False, False),
    (1, 2, False, "float32", False, False),
    (1, 4, False, "float32", False, False),
    (2, 2, True, "float32", False, False),
    (2, 2, True, "bfloat16", False, False),
    (1, 1, False, "float32", True, False),
    (2, 1, True, "bfloat16", True, False),
    (1, 1, False, "float32", False, True),
    (2, 2, True, "bfloat16", False, True),
)
"""(data, tensor, shard_params, compute dtype, remat, LoRA) of each checked step (LoRA: `CHECK_LORA`); sequences per
device of the data axis per pass: `CHECK_ROWS`."""

CHECK_LORA = LoraConfig(rank=8, targets=TABLE_LORA.targets, base_dtype="bfloat16")

CHECK_ROWS = 4


def table() -> list[dict[str, Any]]:
    """The plan at size: each shape (its config's model and uplink), island size, mesh split, full fine-tune or LoRA,
    remat off and on; bfloat16 compute, one sequence of TABLE_SEQ_LEN tokens per device per pass, FSDP over the data
    axis."""
    from diloco.config import load_config

    rows = []
    for name in SHAPES:
        run = load_config(CONFIGS / f"{name}.toml")
        for devices, meshes in TABLE_MESHES.items():
            for data, tensor in meshes:
                for lora in (None, TABLE_LORA):
                    for remat in (False, True):
                        cfg = replace(run.model, seq_len=TABLE_SEQ_LEN, compute_dtype="bfloat16", remat=remat)
                        plan = step_memory(
                            cfg, data, 1, data, tensor, True, lora, run.codec.spec("uplink"),
                            processes=devices // DEVICES_PER_HOST,
                        )  # fmt: skip
                        rows.append(
                            {
                                "model": name,
                                "devices": devices,
                                "mesh": f"{data}x{tensor}",
                                "lora": lora is not None,
                                "remat": remat,
                                "per_device_gb": round(plan.total / GB, 1),
                                "fits_80gb": plan.total <= 80 * GB,
                                "parts_gb": {k: round(v / GB, 2) for k, v in plan.parts().items()},
                                "leader_host_gb": round(plan.host.total / GB, 1),
                                "follower_host_gb": None
                                if plan.follower_host is None
                                else round(plan.follower_host.total / GB, 1),
                            }
                        )
    return rows


def measure(cases: tuple[tuple[int, int, bool, str, bool, bool], ...] = CHECK_CASES) -> list[dict[str, Any]]:
    """XLA's figure for each case's step, per device (`Footprint.total`), compiled in this process: its JAX must see
    at least the cases' devices. Nothing runs; the state is shapes."""
    import jax
    import jax.numpy as jnp

    from islands.config import InnerConfig
    from islands.inner import make_inner_optimizer, make_train_step
    from islands.memory import Footprint
    from islands.mesh import Layout, batch_sharding, build_mesh
    from islands.models.lora import Lora, adapt
    from islands.models.registry import build_model

    out = []
    for data, tensor, shard, dtype, remat, lora in cases:
        cfg = ModelConfig(**CHECK_MODEL, tie_embeddings=False, compute_dtype=dtype, remat=remat)
        model, tx = build_model(cfg), make_inner_optimizer(InnerConfig(), 100)
        if lora:  # the frozen base is an argument of the step (islands/inner.py `WithFrozen`): XLA counts it
            base = jax.jit(model.init)(jax.random.key(0))
            c = CHECK_LORA
            model = adapt(model, Lora.over(base, c.rank, c.alpha, c.targets, c.base_dtype))
        layout = Layout(build_mesh(data * tensor, tensor=tensor), shard, model.axis_units)
        params = jax.eval_shape(model.init, jax.random.key(0))
        opt = jax.eval_shape(tx.init, params)
        shape = (1, CHECK_ROWS * data, cfg.seq_len + 1)
        batch = jax.ShapeDtypeStruct(shape, jnp.int32, sharding=batch_sharding(layout.mesh))
        step = make_train_step(model.loss, tx, layout)
        compiled = step.lower(layout.shapes(params), layout.shapes(opt), batch).compile()
        footprint = Footprint.of(compiled)
        if footprint is None:
            raise BenchError("bench plan: XLA gives no memory analysis on this backend")
        case = {"data": data, "tensor": tensor, "shard_params": shard, "dtype": dtype, "remat": remat, "lora": lora}
        out.append({**case, "xla": footprint.total, "gflops": round(xla_flops(compiled) / 1e9, 3)})
    return out


def compare(measured: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each measured case beside its plan: MiB and plan / measured."""
    rows = []
    for m in measured:
        cfg = ModelConfig(**CHECK_MODEL, tie_embeddings=False, compute_dtype=m["dtype"], remat=m["remat"])
        lora = CHECK_LORA if m["lora"] else None
        plan = step_memory(cfg, CHECK_ROWS * m["data"], 0, m["data"], m["tensor"], m["shard_params"], lora)
        ratio = round((plan.state + plan.step) / m["xla"], 3)
        rows.append(
            {
                **{k: m[k] for k in ("data", "tensor", "shard_params", "dtype", "remat", "lora")},
                "plan_mib": round((plan.state + plan.step) / MIB, 1),
                "xla_mib": round(m["xla"] / MIB, 1),
                "xla_gflops": m["gflops"],
                "plan_over_xla": ratio,
                "within_1_5x": 1 / RATIO_BOUND <= ratio <= RATIO_BOUND,
            }
        )
    return rows


def run_plan_bench(with_table: bool = False) -> dict[str, Any]:
    """The check in a child process of max(devices) forced host devices; with `with_table`, the table too."""
    devices = max(data * tensor for data, tensor, *_ in CHECK_CASES)
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}".strip()
    code = "import json; from diloco.bench.plan import measure; print(json.dumps(measure()))"
    child = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False)
    if child.returncode:
        raise BenchError(f"bench plan: the measuring child failed: {child.stderr.strip().splitlines()[-1:]}")
    cases = compare(json.loads(child.stdout.strip().splitlines()[-1]))
    result: dict[str, Any] = {
        "bench": "plan",
        "model": CHECK_MODEL,
        "rows_per_device": CHECK_ROWS,
        "cases": cases,
        "all_within_1_5x": all(c["within_1_5x"] for c in cases if not c["remat"]),
        "remat_within_1_5x": all(c["within_1_5x"] for c in cases if c["remat"]),
    }
    if with_table:
        result["table"] = table()
    return result
