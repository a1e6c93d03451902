"""DenseSiluAndMulQuant (SGLang: SiluAndMul emitting fp8 for a block-fp8 down_proj).

srt's linear layers are unquantized, so this never quantizes: `forward_decode` is the plain
activation.
"""

from __future__ import annotations

from typing import Any

import torch


class DenseSiluAndMulQuant:
    """Holds down_proj as SGLang does; `enabled` is always False."""

    def __init__(self, down_proj: Any) -> None:
        self.down_proj = down_proj
        self.enabled = False

    def forward_decode(self, x: torch.Tensor, act_fn: Any, down_proj: Any) -> torch.Tensor:
        return act_fn(x)
