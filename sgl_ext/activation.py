"""SiLU-and-mul, source-compatible with sgl_kernel's `silu_and_mul`: one Triton launch on CUDA.

out = silu(x[..., :d]) * x[..., d:]; the torch-native function below is the CPU path and the
test oracle and rounds in the same order (silu rounded to the input dtype, then the product).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from sgl_ext import _common as C
from sgl_ext._backend import select_backend
from sgl_ext.fast_launch import OpTable
from sgl_ext.plan_cache import KEY_ERRORS, PlanCache, optional_key, tensor_key

if TYPE_CHECKING:
    from sgl_ext.triton.launcher import KernelLauncher

_is_compiling = torch.compiler.is_compiling


def silu_and_mul_native(x: torch.Tensor) -> torch.Tensor:
    """Reference: x [..., 2 * d] -> silu(x[..., :d]) * x[..., d:], [..., d] (new tensor)."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


@dataclass(frozen=True)
class ActPlan:
    """A checked silu_and_mul call: its backend and (Triton, work to do) its kernel launch,
    whose per-call tensors are input and out."""

    backend: str
    launcher: KernelLauncher | None


_PLANS = PlanCache()
# The C fast path: arguments input, out (a new output is made before the call and keyed with
# it); leaves 0 and 1 are the kernel's two pointers.
_FAST = OpTable()


def _plan(input: object, out: object) -> ActPlan:
    """Check a call (metadata only) and choose its backend and launch."""
    C.check_tensor("input", input, C.INPUT_DTYPES)
    assert isinstance(input, torch.Tensor)
    if input.ndim < 1 or input.shape[-1] % 2:
        raise ValueError(f"input must be [..., 2 * d], got shape {tuple(input.shape)}")
    d = input.shape[-1] // 2
    shape = (*input.shape[:-1], d)
    if out is not None:
        C.check_tensor("out", out, (input.dtype,))
        assert isinstance(out, torch.Tensor)
        if tuple(out.shape) != shape:
            raise ValueError(f"out must be {shape}, got {tuple(out.shape)}")
        C.check_device("out", out, input.device)
    x2 = _rows("input", input, 2 * d)  # [rows, 2 * d]
    o_stride = d if out is None else _rows("out", out, d).stride(0)  # a new out is contiguous
    backend = select_backend(input.device)
    if backend != "triton":
        return ActPlan(backend, None)
    from sgl_ext.triton.activation import plan_silu_and_mul

    launcher = plan_silu_and_mul(x2.shape[0], d, x2.stride(0), o_stride, input.device)
    return ActPlan(backend, launcher)


def silu_and_mul(
    input: torch.Tensor, out: torch.Tensor | None = None, enable_pdl: bool | None = None
) -> torch.Tensor:
    """silu(gate) * up for input = [gate | up] (sgl_kernel's `silu_and_mul`).

    Checked once per distinct metadata (input, out); the Triton kernel of a plan is then
    launched directly (`_plans.py`).

    Parameters
    ----------
    input : [..., 2 * d] bf16/fp16/fp32, last dim contiguous, leading dims one strided dim.
    out : optional [..., d] of input's dtype, last dim contiguous; new tensor if None.
    enable_pdl : accepted for sgl_kernel compatibility; no effect.

    Returns
    -------
    out : [..., d], input's dtype.
    """
    key = plan = None
    compiling = _is_compiling()
    fast = -1
    made = None  # a new output made for the C fast path: the call below reuses it on a miss
    if not compiling and _FAST.available():
        try:  # (a new output is 16-byte aligned, as the plans assume)
            d = input.shape[-1] // 2
            o = out if out is not None else input.new_empty((*input.shape[:-1], d))
        except (AttributeError, IndexError, TypeError):  # the checks below will say
            o = None
        if o is not None:
            fast = _FAST.launch(input, o)
            if fast == 1:
                return o
            if out is None:
                made = o
    if not compiling:
        try:
            key = (tensor_key(input), optional_key(out))
            plan = _PLANS.get(key)
        except KEY_ERRORS:  # not a (dense) tensor: the checks will say
            key = None
    if plan is None:
        plan = _PLANS.put(key, _plan(input, out))
    if plan.backend != "triton":
        y = silu_and_mul_native(input)
        if out is None:
            return y
        out.copy_(y)
        return out
    new = out is None
    if out is None:
        out = made
    if out is None:
        out = torch.empty(
            (*input.shape[:-1], input.shape[-1] // 2), dtype=input.dtype, device=input.device
        )
    lau = plan.launcher
    if lau is None:  # nothing to do
        return out
    if compiling:
        lau.launch_jit(input, out)
        return out
    op = out.data_ptr()
    if lau.compiled is not None and not (new and op & 15):  # a new out is 16-byte aligned
        lau.direct(input.data_ptr(), op)
        if fast == 0:
            _FAST.register(lau, (0, 1), input, out)  # the next such call launches from C
    else:
        lau.launch(input, out)
    return out


def _rows(name: str, t: torch.Tensor, n: int) -> torch.Tensor:
    """[rows, n] view of t; a ValueError naming t if that needs a copy."""
    if t.stride(-1) != 1 and n > 1:
        raise ValueError(f"{name} must be contiguous in its last dim")
    try:
        return t.view(-1, n)  # [rows, n]
    except RuntimeError:
        raise ValueError(
            f"{name} of shape {tuple(t.shape)} and strides {t.stride()} cannot be seen as "
            "[rows, n] without a copy"
        ) from None
