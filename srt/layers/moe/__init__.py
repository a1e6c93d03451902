"""Mixture of experts: top-k routing (`topk.py`) and the routed-expert layer with its torch
reference paths and Triton kernels (`fused_moe_triton/`); `get_moe_a2a_backend` (`utils.py`)
for SGLang's model files."""

from srt.layers.moe.fused_moe_triton.topk_experts import TopKExperts
from srt.layers.moe.topk import select_experts
from srt.layers.moe.utils import get_moe_a2a_backend

__all__ = ["TopKExperts", "get_moe_a2a_backend", "select_experts"]
