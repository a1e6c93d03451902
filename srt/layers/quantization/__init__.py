"""Quantization configs (SGLang's `srt/layers/quantization`): which layers of a checkpoint are
quantized, and how. srt serves unquantized models and gpt-oss's MXFP4 experts."""

from __future__ import annotations

from typing import Any

from srt.layers.quantization.base_config import QuantizationConfig, require_unquantized
from srt.layers.quantization.mxfp4 import Mxfp4Config

QUANTIZATION_METHODS: dict[str, type[QuantizationConfig]] = {"mxfp4": Mxfp4Config}

__all__ = [
    "QUANTIZATION_METHODS",
    "Mxfp4Config",
    "QuantizationConfig",
    "get_quantization_config",
    "require_unquantized",
]


def get_quantization_config(
    quantization_config: dict[str, Any] | None,
) -> QuantizationConfig | None:
    """The config for a checkpoint's `quantization_config` dict (None: unquantized).

    Raises ValueError naming the method when srt does not serve it.
    """
    if not quantization_config:
        return None
    if not isinstance(quantization_config, dict):
        raise TypeError(
            f"quantization_config must be a dict, got {type(quantization_config).__name__}"
        )
    method = quantization_config.get("quant_method")
    if method not in QUANTIZATION_METHODS:
        raise ValueError(
            f"quantization method {method!r} is not supported; supported: "
            f"{sorted(QUANTIZATION_METHODS)}"
        )
    return QUANTIZATION_METHODS[method].from_config(quantization_config)
