"""SiluAndMul: the gated activation of Llama-style MLPs.

On CUDA (or with SGL_EXT_BACKEND=triton) one sgl_ext kernel (`silu_and_mul`); elsewhere the
torch-native reference, which rounds in the same order.
"""

from __future__ import annotations

import torch
from torch import nn

from sgl_ext._backend import select_backend
from sgl_ext.activation import silu_and_mul, silu_and_mul_native


def kernel_backend(device: torch.device) -> bool:
    """Whether the sgl_ext kernel (not the torch-native reference) serves tensors on device."""
    return select_backend(device, has_cuda=False) != "native"


class SiluAndMul(nn.Module):
    """x: [..., 2 * d] (gate | up) -> silu(gate) * up: [..., d], x's dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if kernel_backend(x.device) and x.stride(-1) == 1:
            return self.forward_cuda(x)
        return self.forward_native(x)

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        """The torch-native reference (CPU path)."""
        return silu_and_mul_native(x)

    def forward_cuda(self, x: torch.Tensor) -> torch.Tensor:
        """One sgl_ext kernel launch."""
        x = x if x.ndim == 2 or x.is_contiguous() else x.contiguous()
        return silu_and_mul(x)
