"""Top-k routing: router logits -> (routing weights, expert ids) per token.

On CUDA, gpt-oss's routing (softmax over the k selected logits) runs as one Triton kernel, one
program per token: at decode sizes torch's `topk` + `softmax` + cast were 4-5 launches and ~10
µs of device time per layer (H100 profile of a gpt-oss-20b bs-1 step), the kernel one launch.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl
from torch import nn

from sgl_ext.launch import cached_launcher, pdl_enter
from srt.layers.moe.fused_moe_triton.moe_x_f16 import XF16, row_to_f16

# The fused kernel covers these (gpt-oss: 32 experts, k = 4; Mixtral 8 / 2).
_MAX_EXPERTS = 1024
_MAX_TOP_K = 16


@triton.jit
def topk_softmax_row(
    x,
    valid,
    weights_row,
    ids_row,
    TOP_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One token's routing from its logits x float32 [BLOCK_E] (valid: the real experts): the
    TOP_K largest (ties: the lowest expert id first) in descending order, their softmax
    (float32, stored in the weights' dtype) and their expert ids (int64)."""
    e = tl.arange(0, BLOCK_E)
    kk = tl.arange(0, BLOCK_K)
    vals = tl.full([BLOCK_K], float("-inf"), tl.float32)
    ids = tl.zeros([BLOCK_K], tl.int32)
    free = valid
    for j in tl.static_range(TOP_K):
        m = tl.max(tl.where(free, x, float("-inf")), axis=0)
        # the lowest free expert holding the maximum; a free one even if every logit left is
        # NaN (no match): ids stay distinct and in range
        first = tl.min(tl.where(free & (x == m), e, BLOCK_E), axis=0)
        first = tl.where(first < BLOCK_E, first, tl.min(tl.where(free, e, BLOCK_E), axis=0))
        vals = tl.where(kk == j, tl.max(tl.where(e == first, x, float("-inf")), axis=0), vals)
        ids = tl.where(kk == j, first, ids)
        free = free & (e != first)
    in_k = kk < TOP_K
    p = tl.where(in_k, tl.exp(vals - tl.max(vals, axis=0)), 0.0)
    p = p / tl.sum(p, axis=0)
    tl.store(weights_row + kk, p.to(weights_row.dtype.element_ty), mask=in_k)
    tl.store(ids_row + kk, ids.to(tl.int64), mask=in_k)


# The kernel's runtime parameters in call order: pointers first (CachedLauncher's direct launch)
_TOPK_CALL = tuple(
    "logits_ptr weights_ptr ids_ptr x_ptr x16_ptr inv_ptr stride_t num_experts K stride_xm "
    "stride_hm".split()
)


@triton.jit
def _topk_softmax_kernel(
    logits_ptr,
    weights_ptr,
    ids_ptr,
    stride_t,
    num_experts,
    x_ptr,  # X16: the token rows [T, K]; else dummies
    x16_ptr,
    inv_ptr,
    K,
    stride_xm,
    stride_hm,
    TOP_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    X16: tl.constexpr = False,
    BLOCK_X: tl.constexpr = 1,
    USE_PDL: tl.constexpr = False,
):
    """Token t's TOP_K largest logits (ties: the lowest expert id first) in descending order,
    their softmax (float32, stored in the weights' dtype) and their expert ids (int64); with
    X16 also row t of x as the fp16-product GEMVs read it (moe_x_f16.row_to_f16)."""
    pdl_enter(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    valid = e < num_experts
    x = tl.load(logits_ptr + t * stride_t + e, mask=valid, other=float("-inf")).to(tl.float32)
    topk_softmax_row(
        x, valid, weights_ptr + t * TOP_K, ids_ptr + t * TOP_K, TOP_K, BLOCK_E, BLOCK_K
    )
    if X16:
        row_to_f16(x_ptr + t * stride_xm, x16_ptr + t * stride_hm, inv_ptr + t, K, BLOCK_X)


def select_experts(
    router_logits: torch.Tensor,
    top_k: int,
    softmax_after_topk: bool = True,
    *,
    weights_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick each token's top-k experts and their routing weights.

    Parameters
    ----------
    router_logits : float [T, E]
    top_k : k, the experts per token.
    softmax_after_topk : True (gpt-oss, Mixtral): softmax over the k selected logits. False:
        softmax over all experts, then take the top k (not renormalised).
    weights_dtype : the weights' dtype (computed in float32, then cast: one rounding).

    Returns
    -------
    (weights weights_dtype [T, k], expert ids int64 [T, k]), the k in descending logit order.
    On CUDA with softmax_after_topk one Triton kernel; equal logits pick the lowest expert id
    there (torch's order among ties is unspecified).
    """
    if router_logits.dim() != 2:
        raise ValueError(f"router_logits must be [T, E], got shape {tuple(router_logits.shape)}")
    num_experts = router_logits.shape[1]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, {num_experts}] (the experts), got {top_k}")
    if (
        softmax_after_topk
        and router_logits.is_cuda
        and num_experts <= _MAX_EXPERTS
        and top_k <= _MAX_TOP_K
        and router_logits.stride(1) == 1
        and router_logits.shape[0] > 0
    ):
        return _topk_softmax_triton(router_logits, top_k, weights_dtype)
    return select_experts_native(router_logits, top_k, softmax_after_topk, weights_dtype)


def select_experts_native(
    router_logits: torch.Tensor,
    top_k: int,
    softmax_after_topk: bool = True,
    weights_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """select_experts in torch (the CPU path and the reference)."""
    if softmax_after_topk:
        vals, ids = torch.topk(router_logits, top_k, dim=-1)
        return torch.softmax(vals.float(), dim=-1).to(weights_dtype), ids
    probs = torch.softmax(router_logits.float(), dim=-1)
    vals, ids = torch.topk(probs, top_k, dim=-1)
    return vals.to(weights_dtype), ids


def select_experts_x_f16(
    router_logits: torch.Tensor,
    top_k: int,
    hidden_states: torch.Tensor,
    *,
    weights_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor, XF16]:
    """select_experts (softmax after the top k) plus hidden_states' fp16 words for the
    fp16-product expert GEMVs (moe_x_f16.x_to_f16), in the routing's one launch.

    Parameters
    ----------
    router_logits : float [T, E], E <= 1024, rows contiguous; top_k <= 16.
    hidden_states : bf16 [T, H], rows contiguous, H % 32 == 0.

    Returns
    -------
    (weights weights_dtype [T, k], expert ids int64 [T, k], XF16 of hidden_states).
    """
    T, E = router_logits.shape
    H = hidden_states.shape[1]
    if not (E <= _MAX_EXPERTS and 1 <= top_k <= min(E, _MAX_TOP_K)):
        raise ValueError(f"select_experts_x_f16 covers E <= {_MAX_EXPERTS}, k <= {_MAX_TOP_K}")
    if hidden_states.shape[0] != T or H % 32 or hidden_states.stride(1) != 1:
        raise ValueError(f"hidden_states must be [{T}, H] with H % 32 == 0, rows contiguous")
    xf = XF16.empty(T, H, hidden_states.device)
    weights, ids = _topk_softmax_triton(router_logits, top_k, weights_dtype, hidden_states, xf)
    return weights, ids, xf


def _topk_softmax_triton(
    router_logits: torch.Tensor,
    top_k: int,
    weights_dtype: torch.dtype,
    x: torch.Tensor | None = None,
    xf: XF16 | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    T, E = router_logits.shape
    weights = torch.empty(T, top_k, dtype=weights_dtype, device=router_logits.device)
    ids = torch.empty(T, top_k, dtype=torch.int64, device=router_logits.device)
    block_e = triton.next_power_of_2(E)
    if x is not None and xf is not None:
        ptrs, ints = (x, xf.words, xf.inv), (x.shape[1], x.stride(0), xf.words.stride(0))
        block_x = triton.next_power_of_2(x.shape[1])
    else:
        ptrs, ints, block_x = (router_logits,) * 3, (0, 0, 0), 1
    cached_launcher(_topk_softmax_kernel, _TOPK_CALL)[(T,)](
        router_logits,
        weights,
        ids,
        *ptrs,
        router_logits.stride(0),
        E,
        *ints,
        TOP_K=top_k,
        BLOCK_E=block_e,
        BLOCK_K=triton.next_power_of_2(top_k),
        X16=x is not None,
        BLOCK_X=block_x,
        num_warps=4 if max(block_e, block_x) > 128 else 1,
    )
    return weights, ids


class StandardTopKOutput(NamedTuple):
    """SGLang's top-k output: routing weights [T, k], expert ids int64 [T, k], the logits."""

    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    router_logits: torch.Tensor


class TopK(nn.Module):
    """SGLang's routing module: router logits -> each token's top-k experts and weights.

    renormalize=True (gpt-oss, Mixtral): softmax over the k selected logits (= softmax over all,
    renormalised over the k); False: softmax over all experts, the k kept as they are. The
    weights come in the hidden states' dtype, as srt's experts take them. SGLang's other
    routings (grouped top-k, custom functions, sigmoid scoring, correction bias, routed
    scaling, fused shared experts) are not supported and raise at build time.
    """

    def __init__(
        self,
        top_k: int,
        *,
        layer_id: int,
        is_draft: bool | None = None,
        use_grouped_topk: bool = False,
        topk_group: int | None = None,
        num_expert_group: int | None = None,
        renormalize: bool = True,
        custom_routing_function: Any = None,
        scoring_func: str = "softmax",
        correction_bias: torch.Tensor | None = None,
        quant_config: Any = None,
        routed_scaling_factor: float | None = None,
        apply_routed_scaling_factor_on_output: bool | None = False,
        output_format: Any = None,
        fused_shared_experts_scaling_factor: float | None = None,
        is_fp4_experts: bool = False,
        allow_routed_experts_capture: bool = True,
        sqrtsoftplus_log1p: bool = False,
        fused_gate_packed_ids: bool = False,
    ) -> None:
        super().__init__()
        unsupported = {
            "use_grouped_topk": use_grouped_topk,
            "custom_routing_function": custom_routing_function is not None,
            "scoring_func": scoring_func != "softmax",
            "correction_bias": correction_bias is not None,
            "routed_scaling_factor": routed_scaling_factor not in (None, 1.0),
            "fused_shared_experts_scaling_factor": fused_shared_experts_scaling_factor is not None,
            "sqrtsoftplus_log1p": sqrtsoftplus_log1p,
            "fused_gate_packed_ids": fused_gate_packed_ids,
        }
        asked = [name for name, on in unsupported.items() if on]
        if asked:
            raise NotImplementedError(f"TopK routing options not supported: {asked}")
        if top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {top_k}")
        self.top_k, self.layer_id, self.renormalize = top_k, layer_id, renormalize
        self.runner_backend: Any = None

    def bind_runner_backend(self, runner_backend: Any) -> None:
        """The experts' runner backend (SGLang picks the output format from it; srt has one)."""
        self.runner_backend = runner_backend

    def forward(
        self,
        hidden_states: torch.Tensor,
        router_logits: torch.Tensor,
        *,
        num_token_non_padded: torch.Tensor | None = None,
        expert_location_dispatch_info: Any = None,
    ) -> StandardTopKOutput:
        """hidden_states [T, H] (its dtype sets the weights'), router_logits [T, E].

        SGLang's padding count and expert-location hints serve DP attention and EPLB (not in
        srt): only None.
        """
        if num_token_non_padded is not None or expert_location_dispatch_info is not None:
            raise NotImplementedError("TopK: DP-attention padding / EPLB dispatch hints")
        weights, ids = select_experts(
            router_logits, self.top_k, self.renormalize, weights_dtype=hidden_states.dtype
        )
        return StandardTopKOutput(weights, ids, router_logits)
