"""RMSNorm with the optional fused residual add of SGLang's decoder layers."""

from __future__ import annotations

import torch
from torch import nn


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
        """x: [..., hidden]. With `residual`, returns (norm(x + residual), x + residual)."""
        if residual is not None:
            x = x + residual
            residual = x
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        if self.weight_in_fp32:
            out = (self.weight.float() * xf).to(dtype)
        else:
            out = self.weight * xf.to(dtype)
        return out if residual is None else (out, residual)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.variance_epsilon}"
