"""The embedded tiny model: an HF-style Llama config used when no checkpoint is given.

Pairs with the 1024-token tokenizer shipped by the runner/tokenizer work; weights come from
`load_format="dummy"`.
"""

from __future__ import annotations

import copy
from typing import Any

TINY_LLAMA_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 1024,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "bfloat16",
}


def tiny_llama_config() -> dict[str, Any]:
    """A fresh copy of the embedded tiny config dict (safe to mutate)."""
    return copy.deepcopy(TINY_LLAMA_CONFIG)
