"""The Llama family of decoders (Llama 3.x, Qwen2 / 2.5 / 3, Mistral-style dense models, SmolLM2; with routed
experts, Qwen3-MoE, Mixtral and Qwen2-MoE) as a config plus a few pure functions over the shared blocks of
`transformer.py`.

What differs from the GPT-2 shape there: RMSNorm in place of LayerNorm (no bias; eps from model.norm_eps), rotary
position embeddings in place of learned ones (Su et al. 2021, arXiv 2104.09864, in Hugging Face's convention: each
head's two halves rotate together, `rotate_half`; base θ model.rope_theta; Llama 3.1's frequency scaling with
model.rope_scaling = "llama3"), a SwiGLU MLP without biases (Shazeer 2020, arXiv 2002.05202), grouped-query attention
(Ainslie et al. 2023, arXiv 2305.13245: model.n_kv_heads key/value heads, each shared by n_heads / n_kv_heads
query heads), heads of model.head_dim, optional q/k/v biases (Qwen2), optional RMSNorm of each head's queries and
keys before the rotation (Qwen3), and an output projection tied to the embedding or its own (model.tie_embeddings).
The numerics are those of transformers' modeling_llama.py / modeling_qwen3.py / modeling_qwen2_moe.py; the mixed
precision rules are transformer.py's (norm statistics, softmax, router and cross-entropy in float32).

Params layout (float32 leaves; weights are [in, out], applied as x @ w; the blocks are a list so Streaming DiLoCo
cuts fragments by layer). D = d_model, V = vocab_size, Hq = n_heads, Hkv = n_kv_heads (or n_heads), Dh = head_dim
(or D / Hq), F = d_ff, E = n_experts, Fs = shared_expert_d_ff:
    {"embed": {"tok": [V, D]},
     "blocks": [{"ln1": {"scale": [D]},
                 "attn": {"wq": [D, Hq*Dh], "wk": [D, Hkv*Dh], "wv": [D, Hkv*Dh], "wo": [Hq*Dh, D],
                          "bq": [Hq*Dh], "bk": [Hkv*Dh], "bv": [Hkv*Dh]     (iff qkv_bias or attn_bias)
                          "bo": [D]                                          (iff attn_bias)
                          "q_norm": {"scale": [Dh]}, "k_norm": {"scale": [Dh]}},  (iff qk_norm)
                 "ln2": {"scale": [D]},
                 "ff": {"w_gate": [D, F], "w_up": [D, F], "w_down": [F, D]}                        (kind llama)
                    or {"router": [D, E], "w_gate": [E, D, F], "w_up": [E, D, F], "w_down": [E, F, D],  (llama_moe)
                        "shared": {"w_gate": [D, Fs], "w_up": [D, Fs], "w_down": [Fs, D], "gate": [D, 1]}}},
                                                                               (iff shared_expert_d_ff > 0)
                ...],
     "final_norm": {"scale": [D]},
     "lm_head": [D, V]}                                                       (iff not tie_embeddings)
The query/key/value columns are head-major: head h of wq is columns h*Dh .. (h+1)*Dh (Hugging Face's q_proj.weight
transposed, no permutation); within a head, the first Dh/2 columns rotate with the last Dh/2 (rotate_half).
"""
