"""gpt-oss's router in one launch: logits = x @ W^T + b, the top-k softmax routing and x's fp16
words for the MXFP4 expert GEMVs.

At decode the router GEMM (32 x 2880) and the routing kernel were two launches of ~1.5-2 µs each
in the gpt-oss-20b bs-1 decode graph, for ~0.2 MB of weight. Here program (t, j) computes token
t's logits of experts [j * EPB, (j + 1) * EPB) (float32 sums, rounded once to x's dtype as the
router GEMM's output is; the weight rows are loaded before the wait for the previous kernel),
stores them and converts its share of row t to fp16 words
(moe_x_f16.row_to_f16's order and scale), then takes a ticket from token t's counter. The
program that draws the last ticket has every logit of the token visible (acquire after the
others' release), runs the routing (topk.topk_softmax_row) and resets the counter for the next
launch. Which program finishes last changes nothing in the results: the logits are computed and
read the same way whatever the order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sgl_ext.launch import cached_launcher, cast_rne, interpreting, next_pow2, pdl_enter
from srt.layers.moe.fused_moe_triton.moe_x_f16 import XF16, pair_position, row_f16_scale
from srt.layers.moe.topk import topk_softmax_row

MAX_TOKENS = 32  # more: router GEMM + routing kernel (bench_router: 9.5 vs 11.0 µs at 64)
MAX_EXPERTS = 256
MAX_TOP_K = 16
MAX_HIDDEN = 8192  # one tile of x a program


# The kernel's runtime parameters in call order: pointers first (CachedLauncher's direct launch;
# the kernel keeps the norm's pointers beside their strides)
_ROUTER_CALL = tuple(
    "X W Bias Logits Count Weights Ids X16 Inv R NW XN K E stride_xm stride_wn stride_hm "
    "stride_rm stride_nm eps".split()
)


@triton.jit
def _router_topk_kernel(
    X,  # [T, K] bf16
    W,  # [E, K] router weight
    Bias,  # [E] (a dummy without HAS_BIAS)
    Logits,  # [T, E] x's dtype (scratch)
    Count,  # int32 [T], zero between launches
    Weights,  # [T, TOP_K]
    Ids,  # int64 [T, TOP_K]
    X16,  # fp16 [T, K], pair order
    Inv,  # float32 [T]
    K,
    E,
    stride_xm,
    stride_wn,
    stride_hm,
    R,  # ADD_NORM: [T, K] residual (read; the token's last program writes X + R into it)
    NW,  # ADD_NORM: [K] the norm's weight (applied in float32)
    XN,  # ADD_NORM: [T, K] x's dtype: the normalised row
    stride_rm,
    stride_nm,
    eps,
    TOP_K: tl.constexpr,
    EPB: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_TOPK: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EMULATE: tl.constexpr,
    ADD_NORM: tl.constexpr = False,
    USE_PDL: tl.constexpr = False,
):
    t = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    progs = tl.num_programs(1)
    k = tl.arange(0, BLOCK_K)
    km = k < K
    e = j * EPB + tl.arange(0, EPB)  # [EPB] this program's experts
    em = e < E
    # the weights are no kernel's output: read while the previous kernel still runs
    w_ptrs = W + e[:, None].to(tl.int64) * stride_wn + k[None, :]
    w = tl.load(w_ptrs, mask=em[:, None] & km[None, :], other=0.0)
    if HAS_BIAS:
        b = tl.load(Bias + e, mask=em, other=0.0)
    if ADD_NORM:
        nw = tl.load(NW + k, mask=km, other=0.0).to(tl.float32)
    pdl_enter(USE_PDL)
    x = tl.load(X + t * stride_xm + k, mask=km, other=0.0).to(tl.float32)  # [BLOCK_K]
    share = tl.cdiv(K, progs)
    mine = km & (k >= j * share) & (k < (j + 1) * share)
    if ADD_NORM:  # fused_add_rmsnorm's arithmetic (weight in float32), row t in every program
        res = tl.load(R + t * stride_rm + k, mask=km, other=0.0).to(tl.float32)
        xs = cast_rne(x + res, Logits.dtype.element_ty, EMULATE)  # the residual stream
        x = xs.to(tl.float32)
        var = tl.sum(x * x, axis=0) / K
        x = cast_rne(x * tl.rsqrt(var + eps) * nw, Logits.dtype.element_ty, EMULATE)
        tl.store(XN + t * stride_nm + k, x, mask=mine)
        x = x.to(tl.float32)
    logit = tl.sum(w.to(tl.float32) * x[None, :], axis=1)  # [EPB]
    if HAS_BIAS:
        logit += b.to(tl.float32)
    tl.store(Logits + t * E + e, cast_rne(logit, Logits.dtype.element_ty, EMULATE), mask=em)
    # this program's share of row t's fp16 words (the scale needs the whole row's max)
    up, inv = row_f16_scale(x)
    tl.store(X16 + t * stride_hm + pair_position(k), (x * up).to(tl.float16), mask=mine)
    if j == 0:
        tl.store(Inv + t, inv)
    # every thread's stores are issued, then one release + acquire ticket for the program
    tl.debug_barrier()
    ticket = tl.atomic_add(Count + t, 1, sem="acq_rel", scope="gpu")
    if ticket == progs - 1:  # the token's last program: all its logits are in
        tl.store(Count + t, 0)  # no other program of this launch touches it again
        if ADD_NORM:  # every program has read row t of R: the sum may replace it
            tl.store(R + t * stride_rm + k, xs, mask=km)
        ee = tl.arange(0, BLOCK_E)
        valid = ee < E
        row = tl.load(
            Logits + t * E + ee, mask=valid, other=float("-inf"), cache_modifier=".cg"
        ).to(tl.float32)
        topk_softmax_row(
            row, valid, Weights + t * TOP_K, Ids + t * TOP_K, TOP_K, BLOCK_E, BLOCK_TOPK
        )


class TicketCounts:
    """int32 zeros for `router_select_experts_x_f16`, one per token, kept for the owner's life
    (captured graphs hold their pointers): buffers per power-of-two row count, views per T."""

    def __init__(self) -> None:
        self._bufs: dict[tuple[int, torch.device], torch.Tensor] = {}

    def get(self, T: int, device: torch.device) -> torch.Tensor:
        key = (next_pow2(max(T, 1)), device)
        buf = self._bufs.get(key)
        if buf is None:
            buf = self._bufs[key] = torch.zeros(key[0], dtype=torch.int32, device=device)
        return buf[:T]


def fused_route_fits(x: torch.Tensor, weight: torch.Tensor, top_k: int) -> bool:
    """Whether `router_select_experts_x_f16` covers this call (else: router GEMM + routing)."""
    T, H = x.shape
    E = weight.shape[0]
    return (
        1 <= T <= MAX_TOKENS
        and H <= MAX_HIDDEN
        and H % 32 == 0
        and E <= MAX_EXPERTS
        and 1 <= top_k <= min(E, MAX_TOP_K)
        and x.dtype == torch.bfloat16
        and x.stride(1) == 1
        and weight.shape[1] == H
        and weight.stride(1) == 1
    )


def add_norm_fits(hidden: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor) -> bool:
    """Whether `add_rmsnorm_router_select_experts_x_f16` takes this residual and norm weight
    (with `fused_route_fits` for the rest)."""
    return _add_norm_problem(hidden, residual, norm_weight) is None


def _add_norm_problem(
    hidden: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor
) -> str | None:
    """What is wrong with the add-norm operands (None: nothing)."""
    H = hidden.shape[-1]
    if residual.shape != hidden.shape or residual.dtype != hidden.dtype:
        return (
            f"residual must be {hidden.dtype} {tuple(hidden.shape)}, got {residual.dtype} "
            f"{tuple(residual.shape)}"
        )
    if residual.stride(-1) != 1 or residual.device != hidden.device:
        return "residual must have contiguous rows on hidden's device"
    if tuple(norm_weight.shape) != (H,) or norm_weight.stride(0) != 1:
        return f"norm_weight must be contiguous [{H}], got {tuple(norm_weight.shape)}"
    if not norm_weight.is_floating_point() or norm_weight.device != hidden.device:
        return "norm_weight must be a float tensor on hidden's device"
    return None


def router_select_experts_x_f16(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    top_k: int,
    counts: torch.Tensor,
    *,
    weights_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, XF16]:
    """Router logits, top-k softmax routing and x's fp16 words in one launch.

    Parameters
    ----------
    x : bf16 [T, H], rows contiguous, H % 32 == 0, T <= MAX_TOKENS (`fused_route_fits`).
    weight : [E, H] router weight (rows contiguous); bias : [E] or None.
    top_k : experts per token.
    counts : int32 [T], zero (`TicketCounts.get`); the launch leaves it zero. One launch may use
        it at a time.
    weights_dtype : the routing weights' dtype.

    Returns
    -------
    (weights weights_dtype [T, k], expert ids int64 [T, k], XF16 of x): what
    `select_experts_x_f16(x @ weight.T + bias, top_k, x)` returns for the same logits (the
    logits rounded to x's dtype, ties to the lowest expert id).
    """
    _check(x, weight, bias, top_k, counts)
    r = _launch(x, weight, bias, top_k, counts, weights_dtype, None)
    return r.weights, r.ids, r.x_f16


@dataclass(frozen=True)
class FusedRoute:
    """What `add_rmsnorm_router_select_experts_x_f16` returns: the normalised input x [T, H]
    (x's dtype), the routing (weights [T, k], int64 ids [T, k]) and x's fp16 words."""

    x: torch.Tensor
    weights: torch.Tensor
    ids: torch.Tensor
    x_f16: XF16


def add_rmsnorm_router_select_experts_x_f16(
    hidden: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    top_k: int,
    counts: torch.Tensor,
    *,
    weights_dtype: torch.dtype,
) -> FusedRoute:
    """The residual add + RMSNorm before the router (weight applied in float32, gpt-oss's
    order: `fused_add_rmsnorm(..., weight_in_fp32=True)`'s arithmetic) and
    `router_select_experts_x_f16` of its output, in one launch.

    Parameters
    ----------
    hidden : bf16 [T, H] (the attention block's output), as x of `router_select_experts_x_f16`.
    residual : bf16 [T, H], rows contiguous: receives hidden + residual (rounded to bf16), as
        the in-place fused_add_rmsnorm leaves it.
    norm_weight : [H] contiguous, any float dtype (applied in float32); eps : the norm's epsilon.
    weight, bias, top_k, counts, weights_dtype : as in `router_select_experts_x_f16`.

    Returns
    -------
    FusedRoute: the normalised row (a new tensor; hidden is not written), the routing of its
    logits and its fp16 words.
    """
    _check(hidden, weight, bias, top_k, counts)
    problem = _add_norm_problem(hidden, residual, norm_weight)
    if problem is not None:
        raise ValueError(problem)
    norm = _AddNorm(residual, norm_weight, float(eps))
    return _launch(hidden, weight, bias, top_k, counts, weights_dtype, norm)


@dataclass(frozen=True)
class _AddNorm:
    """The ADD_NORM variant's operands: the residual (written), the norm's weight, eps."""

    residual: torch.Tensor
    weight: torch.Tensor
    eps: float


def _check(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, top_k: int, counts
) -> None:
    if not fused_route_fits(x, weight, top_k):
        raise ValueError("router_select_experts_x_f16: shapes outside fused_route_fits")
    T = x.shape[0]
    E = weight.shape[0]
    if counts.dtype != torch.int32 or tuple(counts.shape) != (T,) or counts.stride(0) != 1:
        raise ValueError(f"counts must be contiguous int32 [{T}] (TicketCounts.get)")
    if bias is not None and tuple(bias.shape) != (E,):
        raise ValueError(f"bias must be [{E}], got {tuple(bias.shape)}")


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    top_k: int,
    counts: torch.Tensor,
    weights_dtype: torch.dtype,
    norm: _AddNorm | None,
) -> FusedRoute:
    """One launch on checked arguments (norm: the ADD_NORM variant's operands)."""
    T, H = x.shape
    E = weight.shape[0]
    dev = x.device
    logits = torch.empty(T, E, dtype=x.dtype, device=dev)
    weights = torch.empty(T, top_k, dtype=weights_dtype, device=dev)
    ids = torch.empty(T, top_k, dtype=torch.int64, device=dev)
    xf = XF16.empty(T, H, dev)
    if norm is not None:
        residual, norm_weight, eps = norm.residual, norm.weight, norm.eps
        xn = torch.empty_like(x, memory_format=torch.contiguous_format)
    else:  # dummies, never read or written without ADD_NORM
        residual, norm_weight, eps, xn = x, x, 0.0, x
    epb = 1
    block_k = triton.next_power_of_2(H)
    cached_launcher(_router_topk_kernel, _ROUTER_CALL)[(T, triton.cdiv(E, epb))](
        x,
        weight,
        bias if bias is not None else weight,
        logits,
        counts,
        weights,
        ids,
        xf.words,
        xf.inv,
        residual,
        norm_weight,
        xn,
        H,
        E,
        x.stride(0),
        weight.stride(0),
        xf.words.stride(0),
        residual.stride(0),
        xn.stride(0),
        eps,
        TOP_K=top_k,
        EPB=epb,
        BLOCK_E=triton.next_power_of_2(E),
        BLOCK_TOPK=triton.next_power_of_2(top_k),
        BLOCK_K=block_k,
        HAS_BIAS=bias is not None,
        EMULATE=interpreting(),
        ADD_NORM=norm is not None,
        num_warps=4 if block_k > 512 else 1,
    )
    return FusedRoute(xn, weights, ids, xf)
