"""ResidualStream: the residual of one forward pass through the layer stack."""

from __future__ import annotations

import torch


class ResidualStream:
    """The running residual [T, hidden] (None before the first stage's add)."""

    __slots__ = ("residual",)

    def __init__(self) -> None:
        self.residual: torch.Tensor | None = None
