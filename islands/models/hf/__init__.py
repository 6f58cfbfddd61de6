"""Hugging Face checkpoints in and out (`init.from` a `save_pretrained` directory, `diloco export --format hf`).

`checkpoint` reads and writes the directory (config.json, model.safetensors or its shards and index, the tokenizer's
files), `tensors` moves tensors between Hugging Face's names and layouts and this project's pytree, one `Rule` per
tensor, and each family module (`llama`: Llama, Qwen2, Qwen3, Mistral, SmolLM2 and their mixtures of experts Qwen3-MoE,
Qwen2-MoE, Mixtral; `gpt2`) says how its config.json maps onto `[model]` and its tensors onto the params layout.
`families` picks the module for an `architectures` entry or a `[model]` section. All of it is JAX-free: the config
loader reads config.json through it (tests/test_layering.py).

Empty of imports, like islands/models/__init__.py.
"""
