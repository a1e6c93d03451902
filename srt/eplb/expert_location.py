"""The expert-location facts a MoE model gives SGLang's EPLB (a plain record here)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelConfigForExpertLocation:
    num_layers: int
    num_logical_experts: int
    num_groups: int | None = None
