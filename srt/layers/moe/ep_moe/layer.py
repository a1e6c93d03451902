"""`get_moe_impl_class` (SGLang's `ep_moe/layer.py`): which expert layer a model builds."""

from __future__ import annotations

from srt.layers.moe.fused_moe_triton.layer import FusedMoE
from srt.layers.quantization.base_config import QuantizationConfig


def get_moe_impl_class(quant_config: QuantizationConfig | None = None) -> type[FusedMoE]:
    """FusedMoE: srt has no expert-parallel (DeepEP / EP) layers; the quant config is checked
    when the layer is built."""
    return FusedMoE
