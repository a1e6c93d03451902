"""RMSNorm with the optional fused residual add of SGLang's decoder layers.

On CUDA (or with SGL_EXT_BACKEND=triton) one sgl_ext kernel per call (`rmsnorm` /
`fused_add_rmsnorm`, one pass over each row); elsewhere the torch-native reference, which rounds
in the same order.
"""

from __future__ import annotations

import torch
from torch import nn

from sgl_ext.norm import fused_add_rmsnorm, fused_add_rmsnorm_native, rmsnorm, rmsnorm_native
from srt.layers.activation import kernel_backend


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
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x: [..., hidden]. With `residual`, returns (norm(x + residual), x + residual).

        Out of place: x and residual are never modified. Outputs have x's dtype.
        """
        if kernel_backend(x.device) and self._kernel_ok(x, residual):
            return self.forward_cuda(x, residual)
        return self.forward_native(x, residual)

    def _kernel_ok(self, x: torch.Tensor, residual: torch.Tensor | None) -> bool:
        w = self.weight
        return (
            x.stride(-1) == 1
            and (w.dtype == x.dtype or self.weight_in_fp32)
            and (residual is None or (residual.dtype == x.dtype and residual.stride(-1) == 1))
        )

    def forward_native(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The torch-native reference (CPU path)."""
        eps, fp32w = self.variance_epsilon, self.weight_in_fp32
        if residual is None:
            return rmsnorm_native(x, self.weight, eps, fp32w)
        return fused_add_rmsnorm_native(x, residual, self.weight, eps, fp32w)

    def forward_cuda(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """One sgl_ext kernel launch (rows of x may be strided; [..., hidden] kept)."""
        x = x if x.ndim == 2 or x.is_contiguous() else x.contiguous()
        eps, fp32w = self.variance_epsilon, self.weight_in_fp32
        if residual is None:
            return rmsnorm(x, self.weight, eps, weight_in_fp32=fp32w)
        residual = residual if residual.is_contiguous() else residual.contiguous()
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        res_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        fused_add_rmsnorm(
            x, residual, self.weight, eps, weight_in_fp32=fp32w, out=out, residual_out=res_out
        )
        return out, res_out

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.variance_epsilon}"
