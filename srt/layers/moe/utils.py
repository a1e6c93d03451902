"""MoE helpers SGLang's model files import (`sglang.srt.layers.moe.utils` / `moe`)."""

from __future__ import annotations

import enum

import torch


class MoeA2ABackend(enum.Enum):
    """How tokens reach their experts across ranks. srt keeps every expert on every rank (no
    expert parallelism), so there is no all-to-all."""

    NONE = "none"

    def is_none(self) -> bool:
        return self is MoeA2ABackend.NONE

    def is_deepep(self) -> bool:
        return False


def get_moe_a2a_backend() -> MoeA2ABackend:
    return MoeA2ABackend.NONE


def filter_moe_weight_param_global_expert(
    name: str, x: torch.Tensor, num_local_experts: int
) -> bool:
    """Whether an experts' parameter holds one slice per local expert (dim 0 = experts)."""
    return not name.endswith("_scale_2") and x.dim() > 0 and x.shape[0] == num_local_experts
