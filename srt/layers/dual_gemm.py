"""DualGemm (SGLang's fused gate/up + activation GEMM for small batches).

srt has no such kernel: `can_run` is always False, so a model file takes its ordinary
gate_up_proj -> activation path (on CUDA srt's skinny GEMM and SiluAndMul kernels).
"""

from __future__ import annotations

from typing import Any

import torch


class DualGemm:
    """gate_up_proj, down_proj and hidden_size as SGLang passes them; never runs."""

    def __init__(self, gate_up_proj: Any, down_proj: Any, hidden_size: int) -> None:
        self.down_proj = down_proj
        self.hidden_size = hidden_size
        self.mode = None
        self.max_tokens = 0

    def can_run(self, x: Any, gate_up_proj: Any) -> bool:
        return False

    def __call__(self, x: Any, gate_up_proj: Any) -> torch.Tensor:
        raise RuntimeError("DualGemm has no kernel in srt (can_run() is always False)")
