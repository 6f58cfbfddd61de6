"""Flop counts the benchmarks share: a training token's model flops, XLA's count of a compiled program, and the
published peak of the device a run found.

Model flops (`train_flops_per_token`) are the count of PaLM's appendix B (Chowdhery et al. 2022, arXiv 2204.02311),
the basis of its model FLOPs utilization: per training token 6 N for the weights' matrix products (2 N forward, 4 N
backward) plus 12 L H Q T for attention's scores and weighted values (L layers, H query heads of width Q, context T).
N here is every parameter of the model, embedding included: with a tied embedding (the Llama shapes of configs/) the
V x d matrix is the output projection's, a product every token pays like any other weight; an untied input
embedding is a lookup, so for an untied model the count is high by 6 V d. H Q is `n_heads x head_size`, d_model in a
standard shape. Recomputation (remat) is not in it, by definition: MFU counts the flops the model needs, not those
the step spends.

No JAX import here: the bench CLI and the parent of a benchmark's processes read these without starting a backend.
"""

from __future__ import annotations

from typing import Any

from islands.models.config import ModelConfig

MODEL_FLOPS = "6 N + 12 L H Q T (PaLM, arXiv 2204.02311, appendix B); N = all parameters, embedding included"
"""What `train_flops_per_token` counts, in the words a benchmark's JSON gives with the figure."""


def train_flops_per_token(model: ModelConfig, n_params: int) -> int:
    """Model flops of one training token (forward and backward) of `model` with `n_params` parameters (module
    docstring)."""
    return 6 * n_params + 12 * model.n_layers * model.n_heads * model.head_size * model.seq_len


def xla_flops(compiled: Any) -> float:
    """XLA's count of a compiled program's flops per device (its cost analysis; 0 where the backend gives none).

    XLA counts a loop's body once, whatever its trip count: a train step that accumulates over P passes (a
    `lax.scan`, islands/inner.py) is counted as one pass and the optimizer's update."""
    try:
        analysis = compiled.cost_analysis()
    except Exception:  # not implemented on this backend
        return 0.0
    analysis = analysis[0] if isinstance(analysis, list) else analysis
    return float((analysis or {}).get("flops", 0.0))


PEAK_TFLOPS: dict[str, float] = {
    # NVIDIA's datasheets give bf16 tensor-core figures "with sparsity"; dense is half
    # (nvidia.com/en-us/data-center/h100, /h200, /a100).
    "NVIDIA H100 80GB HBM3": 989.0,  # H100 SXM5: 1,979 with sparsity
    "NVIDIA H100 PCIe": 756.0,  # 1,513 with sparsity
    "NVIDIA H200": 989.0,  # H200 SXM: 1,979 with sparsity
    "NVIDIA A100-SXM4-80GB": 312.0,  # every A100: 624 with sparsity
    "NVIDIA A100-SXM4-40GB": 312.0,
    "NVIDIA A100-PCIE-40GB": 312.0,
    "NVIDIA A100 80GB PCIe": 312.0,
    # Google Cloud's TPU pages, "Peak compute per chip (bf16)" (cloud.google.com/tpu/docs/v4, /v5e, /v5p, /v6e);
    # JAX calls v5e "TPU v5 lite", v5p "TPU v5" and v6e "TPU v6 lite".
    "TPU v4": 275.0,
    "TPU v5 lite": 197.0,
    "TPU v5": 459.0,
    "TPU v6 lite": 918.0,
}
"""Dense bfloat16 peak TFLOP/s of one device, by JAX's `device_kind` exactly: a kind not here (a CPU, whose peak
depends on the host; a variant such as an H100 NVL) has no peak, and its MFU is null unless the user gives one."""
