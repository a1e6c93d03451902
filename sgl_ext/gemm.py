"""Skinny GEMM for decode (M <= 64 tokens): y = x W^T (+ b), F.linear's semantics.

`linear_small_m` runs the Triton kernel of `triton/gemm.py` on CUDA (or under
`SGL_EXT_BACKEND=triton` with `TRITON_INTERPRET=1`) and `F.linear` elsewhere, and for more than
`MAX_M` rows, where cuBLAS's tiles are the right tool. The launch configuration (`GemmConfig`)
is chosen by the caller from measurements (`benchmarks/bench_gemm.py`; srt's table is
`srt/layers/gemm_choice.py`); `default_config` is a plain fallback. The torch-native reference
is `linear_small_m_native` (= F.linear).

Results are deterministic (no atomics): the same configuration and BLOCK_M (`GemmConfig.block_m`:
pow2(M), at least 16 for tensor-core dots) give the same bits for a row whatever the other rows
are, in a CUDA graph or eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from sgl_ext import _common as C
from sgl_ext._backend import select_backend
from sgl_ext.fast_launch import OpTable
from sgl_ext.gemm_config import GemmConfig
from sgl_ext.plan_cache import KEY_ERRORS, PlanCache, optional_key, tensor_key

MAX_M = 64  # more rows: F.linear
_is_compiling = torch.compiler.is_compiling


def default_config(m: int) -> GemmConfig:
    """A reasonable configuration for m rows when the caller has no measured one."""
    if m <= 2:
        return GemmConfig(block_n=16, block_k=512, num_warps=4, num_stages=3)
    if m <= 8:
        return GemmConfig(block_n=16, block_k=128, num_warps=4, num_stages=3)
    return GemmConfig(block_n=64, block_k=128, num_warps=4, num_stages=4, dot=True)


def linear_small_m_native(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Reference: F.linear(x, weight, bias), widened to out_dtype if given."""
    y = F.linear(x, weight, bias)
    return y if out_dtype is None else y.to(out_dtype)


@dataclass(frozen=True)
class GemmPlan:
    """A checked call: rows M, out shape, backend; `launch` (Triton) or None (F.linear)."""

    backend: str
    m: int
    out_shape: tuple[int, ...]
    launch: Any  # sgl_ext.triton.gemm.SkinnyLaunch (Triton) or None


_PLANS = PlanCache()
# The C fast path's table: arguments x, weight, bias, config, out; the config keyed by class and
# fields (leaves 4-9), requires_grad keyed for x, weight and bias (a call that needs autograd
# takes F.linear and is never registered).
_CONFIG_FIELDS = ("block_n", "block_k", "num_warps", "num_stages", "split_k", "dot")
_FAST = OpTable(expand=((3, _CONFIG_FIELDS),), grad=(0, 1, 2))


def _check(x: object, weight: object, bias: object) -> tuple[int, int, int]:
    """Metadata checks; returns (M, N, K)."""
    C.check_tensor("x", x, C.INPUT_DTYPES)
    assert isinstance(x, torch.Tensor)
    C.check_tensor("weight", weight, (x.dtype,))
    assert isinstance(weight, torch.Tensor)
    C.check_device("weight", weight, x.device)
    if x.ndim < 1:
        raise ValueError("x must be [..., K], got a 0-d tensor")
    if weight.ndim != 2 or weight.shape[1] != x.shape[-1]:
        raise ValueError(
            f"weight must be [N, K] with K = x.shape[-1] = {x.shape[-1]}, got {tuple(weight.shape)}"
        )
    n, k = weight.shape
    if k > 1 and weight.stride(1) != 1:
        raise ValueError("weight must be contiguous in its last dim")
    if bias is not None:
        C.check_tensor("bias", bias, (x.dtype,))
        assert isinstance(bias, torch.Tensor)
        C.check_device("bias", bias, x.device)
        if tuple(bias.shape) != (n,) or (n > 1 and bias.stride(0) != 1):
            raise ValueError(f"bias must be a contiguous [{n}], got {tuple(bias.shape)}")
    m = x.numel() // k if k else 0
    if k > 1 and x.stride(-1) != 1:
        raise ValueError("x must be contiguous in its last dim")
    return m, n, k


def _plan(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config, out_dtype
) -> GemmPlan:
    m, n, k = _check(x, weight, bias)
    if config is not None and not isinstance(config, GemmConfig):
        raise TypeError(f"config must be a GemmConfig or None, got {type(config).__name__}")
    if out_dtype not in (None, x.dtype, torch.float32):
        raise ValueError(f"out_dtype must be None, x's dtype or torch.float32, got {out_dtype}")
    out_shape = (*x.shape[:-1], n)
    backend = select_backend(x.device)
    if backend != "triton" or not 1 <= m <= MAX_M or n == 0 or k == 0:
        return GemmPlan("native", m, out_shape, None)
    try:
        stride_xm = x.view(m, k).stride(0)  # [M, K]
    except RuntimeError:
        raise ValueError(
            f"x of shape {tuple(x.shape)} and strides {x.stride()} cannot be seen as [M, K] "
            "without a copy"
        ) from None
    from sgl_ext.triton.gemm import plan_skinny_gemm

    cfg = config or default_config(m)
    launch = plan_skinny_gemm(
        m, n, k, stride_xm, weight.stride(0), n, x.dtype, bias is not None, cfg, x.device, out_dtype
    )
    return GemmPlan("triton", m, out_shape, launch)


def linear_small_m(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: GemmConfig | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """y = x weight^T (+ bias) for few rows: the skinny Triton GEMM, else F.linear.

    Checked once per distinct metadata (plan cache); the Triton kernels then launch through
    `cached_launcher`. Under torch.compile tracing, F.linear.

    Parameters
    ----------
    x : [..., K] bf16/fp16/fp32, last dim contiguous, leading dims viewable as [M, K].
    weight : [N, K] of x's dtype and device, last dim contiguous (an nn.Linear weight).
    bias : optional [N] of x's dtype, contiguous.
    config : launch configuration; None: `default_config(M)`.
    out_dtype : None (x's dtype) or torch.float32: the same values (rounded once to x's dtype)
        stored widened, as `F.linear(...).float()` but without a second kernel (an LM head's
        logits).

    Returns
    -------
    out : [..., N], out_dtype (new tensor). F.linear's result within rounding: float32
        accumulation, bias added in float32, one rounding to x's dtype. M > MAX_M or a
        non-Triton backend: F.linear itself (then widened).
    """
    if _is_compiling():
        return linear_small_m_native(x, weight, bias, out_dtype)
    out: torch.Tensor | None = None
    fast = -1
    if _FAST.available():
        # a new output (16-byte aligned, as the plans assume), keyed with the call: one C call
        # keys and launches a single-kernel plan
        try:
            out = x.new_empty((*x.shape[:-1], weight.shape[0]), dtype=out_dtype or x.dtype)
        except (AttributeError, IndexError, TypeError):  # the checks below will say
            out = None
        else:
            fast = _FAST.launch(x, weight, bias, config, out)
            if fast == 1:
                return out
    key = plan = None
    try:
        key = (tensor_key(x), tensor_key(weight), optional_key(bias), config, out_dtype)
        plan = _PLANS.get(key)
    except KEY_ERRORS:  # not a (dense) tensor / unhashable: the checks will say
        key = None
    if plan is None:
        plan = _PLANS.put(key, _plan(x, weight, bias, config, out_dtype))
    grad = x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    if plan.backend != "triton" or grad:  # (no autograd formula for the Triton path)
        return linear_small_m_native(x, weight, bias, out_dtype)
    from sgl_ext.triton.gemm import run_skinny_gemm

    if out is None or tuple(out.shape) != plan.out_shape or out.dtype != (out_dtype or x.dtype):
        out = torch.empty(plan.out_shape, dtype=out_dtype or x.dtype, device=x.device)
    m = plan.m
    run_skinny_gemm(plan.launch, x.view(m, -1), weight, bias, out.view(m, -1))  # [M, K], [M, N]
    main = plan.launch.main
    if fast == 0 and plan.launch.reduce is None and main.compiled is not None:
        # the next call with this metadata launches from C: (x, weight, bias or weight, out, out)
        leaves = (0, 1, 2 if bias is not None else 1, 10, 10)
        _FAST.register(main, leaves, x, weight, bias, config, out)
    return out
