"""TopKPairs: a routed-expert layer's output before its top-k combine.

At decode sizes the combine (`moe_sum`) is a kernel launch of its own on the critical path. A
layer that returns its pair rows instead lets the next RMSNorm add them up on its way
(`sgl_ext.moe_sum_add_rmsnorm`: moe_sum's bits, one launch fewer); anything else that needs the
[T, H] tensor calls `combine()`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sgl_ext.launch import select_backend


@dataclass(frozen=True)
class TopKPairs:
    """rows: [T * top_k, H], token t's routed experts at rows t*top_k .. t*top_k + top_k - 1,
    each its expert's output times its routing weight; top_k: rows per token."""

    rows: torch.Tensor
    top_k: int

    def combine(self) -> torch.Tensor:
        """[T, H]: each token's rows summed in float32 in order, rounded once (moe_sum where
        sgl_ext's backend is Triton, else the same arithmetic in torch)."""
        T, k = self.rows.shape[0] // self.top_k, self.top_k
        if select_backend(self.rows.device) == "triton":
            # the kernel module on the first Triton call (fused_moe_triton/__init__.py)
            from srt.layers.moe.fused_moe_triton.moe_sum import moe_sum

            return moe_sum(self.rows, T, k)
        p = self.rows.view(T, k, self.rows.shape[1])  # [T, k, H]
        acc = p[:, 0].float()
        for j in range(1, k):
            acc = acc + p[:, j].float()
        return acc.to(self.rows.dtype)
