"""`is_arch_support_pdl` (SGLang's `sglang.kernels.jit.utils`)."""

from __future__ import annotations

import torch


def is_arch_support_pdl() -> bool:
    """Whether the current CUDA device supports programmatic dependent launch (sm_90+)."""
    if not torch.cuda.is_available():
        return False
    from sgl_ext._backend import pdl_capable

    return pdl_capable(torch.cuda.current_device())
