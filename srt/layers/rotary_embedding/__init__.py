"""Rotary position embeddings (SGLang's `srt/layers/rotary_embedding.py`, split by concept)."""

from srt.layers.rotary_embedding.base import RotaryEmbedding
from srt.layers.rotary_embedding.factory import SUPPORTED_ROPE_TYPES, get_rope
from srt.layers.rotary_embedding.scaling import (
    DeepseekScalingRotaryEmbedding,
    DynamicNTKScalingRotaryEmbedding,
    LinearScalingRotaryEmbedding,
    Llama3RotaryEmbedding,
    YaRNScalingRotaryEmbedding,
    yarn_get_mscale,
)

__all__ = [
    "SUPPORTED_ROPE_TYPES",
    "DeepseekScalingRotaryEmbedding",
    "DynamicNTKScalingRotaryEmbedding",
    "LinearScalingRotaryEmbedding",
    "Llama3RotaryEmbedding",
    "RotaryEmbedding",
    "YaRNScalingRotaryEmbedding",
    "get_rope",
    "yarn_get_mscale",
]
