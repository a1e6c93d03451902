"""SGLang's LoRA layer wrappers (`sglang.srt.lora.layers`).

srt serves no LoRA adapters, so no layer is ever wrapped: `unwrap_lora_layer` returns its
argument. (No srt entry point accepts adapters; there is nothing to ask for.)
"""

from __future__ import annotations

from typing import TypeVar

T = TypeVar("T")


def unwrap_lora_layer(layer: T) -> T:
    return layer
