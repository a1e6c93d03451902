"""RMSNorm with the optional fused residual add of SGLang's decoder layers.

Through sgl_ext's `rmsnorm` / `fused_add_rmsnorm`: on CUDA (or with SGL_EXT_BACKEND=triton) one
kernel launch per call, one pass over each row; elsewhere the torch-native reference, which rounds
in the same order.
"""

from __future__ import annotations

import torch
from torch import nn

from sgl_ext.norm import fused_add_rmsnorm, fused_add_rmsnorm_native, rmsnorm, rmsnorm_native


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, computed in float32.

    Parameters
    ----------
    hidden_size : size of the normalised (last) dim.
    eps : variance epsilon.
    weight_in_fp32 : multiply by the weight before casting back (gpt-oss) instead of after
        (Llama / Qwen); the two differ only in rounding for low-precision dtypes.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, weight_in_fp32: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.variance_epsilon = eps
        self.weight_in_fp32 = weight_in_fp32

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None, *, inplace: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x: [..., hidden]. With `residual`, returns (norm(x + residual), x + residual).

        Out of place by default: x and residual are never modified. With `inplace=True` and a
        residual (SGLang's CUDA behaviour, for a caller that owns both tensors: the decoder
        layers), x receives the normalised output and residual the sum, and both are returned:
        no new tensors. Outputs have x's dtype.
        """
        eps, fp32w = self.variance_epsilon, self.weight_in_fp32
        if not self._fits(x, residual):
            out = self.forward_native(x, residual)
            if inplace and residual is not None:
                y, s = out
                residual.copy_(s)
                x.copy_(y)
                return x, residual
            return out
        w: torch.Tensor = self._parameters["weight"]  # type: ignore[assignment]  # no __getattr__
        # sgl_ext picks the kernel (CUDA, or SGL_EXT_BACKEND=triton) or the same native math.
        if residual is None:
            return rmsnorm(x, w, eps, weight_in_fp32=fp32w)
        return fused_add_rmsnorm(x, residual, w, eps, weight_in_fp32=fp32w, inplace=inplace)

    def _fits(self, x: torch.Tensor, residual: torch.Tensor | None) -> bool:
        """Whether the sgl_ext ops take these operands as they are (else: native math)."""
        w: torch.Tensor = self._parameters["weight"]  # type: ignore[assignment]
        if not self.weight_in_fp32 and x.dtype != w.dtype:
            return False
        if x.stride(-1) != 1 or not (x.ndim == 2 or x.is_contiguous()):
            return False
        return residual is None or (
            residual.dtype == x.dtype
            and residual.shape == x.shape
            and residual.stride(-1) == 1
            and (residual.ndim == 2 or residual.is_contiguous())
        )

    def forward_native(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The torch-native reference (any dtypes and layouts)."""
        eps, fp32w = self.variance_epsilon, self.weight_in_fp32
        if residual is None:
            return rmsnorm_native(x, self.weight, eps, fp32w)
        return fused_add_rmsnorm_native(x, residual, self.weight, eps, fp32w)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.variance_epsilon}"
