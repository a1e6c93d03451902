"""Quantization helpers SGLang's model files import (`fp8_utils`): MXFP4 dequantisation."""

from __future__ import annotations

import torch

from srt.layers.mxfp4 import dequantize_mxfp4


def dequant_mxfp4(
    w_block: torch.Tensor, w_scale: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """MXFP4 blocks uint8 [..., G, 16] and E8M0 scales uint8 [..., G] -> out_dtype [..., G * 32]
    (see `srt.layers.mxfp4.dequantize_mxfp4`)."""
    return dequantize_mxfp4(w_block, w_scale, out_dtype)
