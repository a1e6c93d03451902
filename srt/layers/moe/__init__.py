"""Mixture of experts: top-k routing (`topk.py`) and the routed-expert layer with its torch
reference paths and Triton kernels (`fused_moe_triton/`)."""

from srt.layers.moe.fused_moe_triton.layer import TopKExperts
from srt.layers.moe.topk import select_experts

__all__ = ["TopKExperts", "select_experts"]
