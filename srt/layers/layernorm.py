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

    Parameters (SGLang's order)
    ----------
    hidden_size : size of the normalised (last) dim.
    eps : variance epsilon.
    var_hidden_size : SGLang's partial-variance option; only None (or hidden_size).
    cast_x_before_out_mul : cast the normalised x to the input dtype, then multiply by the weight
        (HF Llama / Qwen); False (SGLang's default, HF gpt-oss) multiplies in float32 first. The
        two differ only in rounding for low-precision dtypes.
    fp32_residual, has_weight, override_orig_dtype : SGLang's options for its deterministic
        RL mode; only the defaults (False, True, None) are served, others raise.
    weight_dtype : the weight's dtype (default: torch's default dtype).
    x_pad_to_multiple : SGLang pads the output only on ROCm's aiter path; here, as on CUDA, the
        output is never padded.
    force_native : always run the torch-native reference.
    weight_in_fp32 : (keyword) srt's name, `not cast_x_before_out_mul`; wins when given.
    """

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        var_hidden_size: int | None = None,
        cast_x_before_out_mul: bool = False,
        fp32_residual: bool = False,
        has_weight: bool = True,
        weight_dtype: torch.dtype | None = None,
        override_orig_dtype: torch.dtype | None = None,
        x_pad_to_multiple: int = 0,
        force_native: bool = False,
        *,
        weight_in_fp32: bool | None = None,
    ) -> None:
        super().__init__()
        unsupported = {
            "var_hidden_size": var_hidden_size not in (None, hidden_size),
            "fp32_residual": fp32_residual,
            "has_weight": not has_weight,
            "override_orig_dtype": override_orig_dtype is not None,
        }
        for name, asked in unsupported.items():
            if asked:
                raise NotImplementedError(f"RMSNorm({name}=...) other than the default")
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=weight_dtype), requires_grad=False)
        self.variance_epsilon = eps
        self.hidden_size = hidden_size
        self.weight_in_fp32 = (
            not cast_x_before_out_mul if weight_in_fp32 is None else bool(weight_in_fp32)
        )
        self.x_pad_to_multiple = x_pad_to_multiple
        self.force_native = force_native
        # The projection reading this norm's output (SGLang's fuse_input_quant); see there.
        self.__dict__["_quant_linear"] = None

    def fuse_input_quant(self, linear: nn.Module) -> None:
        """SGLang's hook to fuse the static fp8 input quantisation of `linear`, the projection
        that consumes this norm's output. srt's linear layers are unquantized (a quantized one
        raises when built), so there is nothing to fuse: the projection is only remembered
        (outside this module's children)."""
        self.__dict__["_quant_linear"] = linear

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
        if (not self.weight_in_fp32 and x.dtype != w.dtype) or self.force_native:
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
