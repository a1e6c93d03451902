"""MRotaryEmbedding (SGLang's multimodal 3-D RoPE): not supported by srt.

Text models' files name it in isinstance checks only; building one raises.
"""

from __future__ import annotations

from typing import Any

from srt.layers.rotary_embedding.base import RotaryEmbedding


class MRotaryEmbedding(RotaryEmbedding):
    """Multimodal (3-D) rotary embedding; constructing it raises NotImplementedError."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("multimodal RoPE (MRotaryEmbedding) is not supported")
