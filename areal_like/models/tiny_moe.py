"""Tiny mixture-of-experts models (Qwen3-MoE) on the dense tiny models' tokenizer, offline.

    python -m areal_like.models.tiny --arch qwen3_moe --out DIR --size 1m|10m

Qwen3-MoE is what transformers, SGLang and vLLM all serve: every decoder layer's MLP is a
sparse block of `num_experts` SwiGLU experts behind a softmax router that keeps the top
`num_experts_per_tok` (no shared expert in this architecture). The folder is written in the
per-expert checkpoint layout (`mlp.experts.<e>.{gate,up,down}_proj.weight`) that servers load;
transformers fuses the experts into 3-D tensors on load and splits them again on save.
"""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedTokenizerFast, Qwen3MoeConfig

# name -> (vocab size, hidden, layers, heads, kv heads, head dim, experts, top-k, expert width)
MOE_SIZES: dict[str, tuple[int, int, int, int, int, int, int, int, int]] = {
    "1m": (512, 128, 4, 4, 2, 32, 8, 2, 96),
    "10m": (1024, 256, 8, 4, 2, 64, 8, 2, 160),
}


def build_moe_config(size: str, tokenizer: PreTrainedTokenizerFast,
                     pad_id: int, eos_id: int) -> Qwen3MoeConfig:
    if size not in MOE_SIZES:
        raise ValueError(f"unknown tiny MoE size {size!r}; choose one of {sorted(MOE_SIZES)}")
    _, hidden, layers, heads, kv_heads, head_dim, experts, top_k, width = MOE_SIZES[size]
    # written to config.json under these (pre-5.0 transformers) names, as SGLang reads them
    legacy: dict[str, Any] = {"rope_theta": 10000.0, "torch_dtype": "float32",
                              "head_dim": head_dim}  # (head_dim: not in the stubs' signature)
    return Qwen3MoeConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=4 * width,  # dense MLP width, unused: every layer is sparse
        moe_intermediate_size=width,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        num_experts=experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        router_aux_loss_coef=0.001,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=pad_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        **legacy,
    )
