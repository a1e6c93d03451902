"""SiluAndMul: the gated activation of Llama-style MLPs.

Through sgl_ext's `silu_and_mul`: on CUDA (or with SGL_EXT_BACKEND=triton) one kernel launch;
elsewhere the torch-native reference, which rounds in the same order.
"""

from __future__ import annotations

import torch
from torch import nn

from sgl_ext.activation import silu_and_mul, silu_and_mul_native


class SiluAndMul(nn.Module):
    """x: [..., 2 * d] (gate | up) -> silu(gate) * up: [..., d], x's dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.stride(-1) == 1 and (x.ndim == 2 or x.is_contiguous()):
            # sgl_ext picks the kernel (CUDA, or SGL_EXT_BACKEND=triton) or the native math.
            return silu_and_mul(x)
        return self.forward_native(x)

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        """The torch-native reference (any layout)."""
        return silu_and_mul_native(x)
