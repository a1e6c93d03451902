"""RMSNorm with the optional fused residual add of SGLang's decoder layers.

Through sgl_ext's `rmsnorm` / `fused_add_rmsnorm`: on CUDA (or with SGL_EXT_BACKEND=triton) one
kernel launch per call, one pass over each row; elsewhere the torch-native reference, which rounds
in the same order.
"""

from __future__ import annotations

import torch
from torch import nn

from sgl_ext.norm import (
    fused_add_rmsnorm,
    fused_add_rmsnorm_native,
    moe_sum_add_rmsnorm,
    rmsnorm,
    rmsnorm_native,
)
from srt.layers.moe.topk_pairs import TopKPairs


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
        self,
        x: torch.Tensor | TopKPairs,
        residual: torch.Tensor | None = None,
        *,
        inplace: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x: [..., hidden]. With `residual`, returns (norm(x + residual), x + residual).

        Out of place by default: x and residual are never modified. With `inplace=True` and a
        residual (SGLang's CUDA behaviour, for a caller that owns both tensors: the decoder
        layers), x receives the normalised output and residual the sum, and both are returned:
        no new tensors. Outputs have x's dtype.

        x may be a MoE layer's TopKPairs (rows [T * k, hidden]): its top-k combine then happens
        here, in the same kernel as the residual add (`moe_sum_add_rmsnorm`; residual [T,
        hidden] takes the sum in place, the normalised output is a new tensor).
        """
        if x.__class__ is TopKPairs:
            return self._forward_pairs(x, residual)  # type: ignore[arg-type]
        assert isinstance(x, torch.Tensor)
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

    def _forward_pairs(
        self, x: TopKPairs, residual: torch.Tensor | None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """TopKPairs x: the combine fused into the residual add where the op takes the operands,
        else moe_sum first (the result is the caller's: in place)."""
        rows = x.rows
        if residual is not None and residual.ndim == 2 and self._fits(rows, None):
            if residual.dtype == rows.dtype and residual.stride(-1) == 1:
                w: torch.Tensor = self._parameters["weight"]  # type: ignore[assignment]
                eps, fp32w = self.variance_epsilon, self.weight_in_fp32
                return moe_sum_add_rmsnorm(
                    rows, residual, w, eps, top_k=x.top_k, weight_in_fp32=fp32w
                )
        return self.forward(x.combine(), residual, inplace=True)

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
