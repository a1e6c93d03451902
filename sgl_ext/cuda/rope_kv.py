"""Launcher of the CUDA C++ fused RoPE + KV-write kernel (`sgl_ext/csrc/rope_kv.cu`).

`supports` says whether a call fits the kernel (16-bit inputs, 16-byte aligned rows and strides,
rotary dims a multiple of 16, head dims a multiple of 8, fp32 tensor scales); otherwise the
dispatcher keeps the Triton kernel. `launch` fills the kernel's parameter struct and launches on
the current stream with programmatic dependent launch (CUDA-graph capture records it as is).

The kernel is opt-in (`preferred`): `SGL_EXT_BACKEND=cuda` forces it, `SGL_EXT_CUDA_TOKENS=lo,hi`
makes it the default for that token range, `SGL_EXT_DISABLE_CUDA=1` never builds it.
"""

from __future__ import annotations

import ctypes
import functools
import subprocess
import warnings
from typing import Any, NamedTuple

import torch

from sgl_ext import settings
from sgl_ext._backend import pdl_capable
from sgl_ext._common import RopeCall, scale_args
from sgl_ext.cuda import jit

# Token counts where the CUDA kernel is the default: none. Measured on the H100 (RESULTS.md,
# docs/performance.md) it is slower than the Triton kernel at nearly every T (equal or 3% faster
# at two points), so it runs only when forced or opted into.
_PREFERRED_TOKENS = (1, 0)
_CACHE_KIND = {torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}  # else 0: the input dtype


class _Params(ctypes.Structure):
    """Mirror of `RopeKVParams` in rope_kv.cu (same order, native alignment)."""

    _fields_ = [
        *(
            (n, ctypes.c_void_p)
            for n in (
                "q",
                "k",
                "v",
                "k_buf",
                "v_buf",
                "positions",
                "cache_loc",
                "cos_sin",
                "k_scale",
                "v_scale",
            )
        ),
        *(
            (n, ctypes.c_int64)
            for n in (
                "q_tok",
                "q_head",
                "k_tok",
                "k_head",
                "v_tok",
                "v_head",
                "kb_page",
                "kb_off",
                "kb_head",
                "vb_page",
                "vb_off",
                "vb_head",
                "cs_stride",
            )
        ),
        *(
            (n, ctypes.c_int32)
            for n in (
                "num_tokens",
                "num_q_heads",
                "num_kv_heads",
                "rot_dim",
                "head_dim",
                "v_head_dim",
                "max_pos",
                "num_slots",
                "page_size",
                "page_shift",
                "pos_is64",
                "loc_is64",
                "write_kv",
                "k_scale_mode",
                "v_scale_mode",
            )
        ),
        ("k_inv", ctypes.c_float),
        ("v_inv", ctypes.c_float),
    ]


def _library(device_index: int) -> ctypes.CDLL | None:
    """The built library with every kernel loaded on this device, or None (warned once).
    `SGL_EXT_NVCC_FLAGS` adds nvcc flags (experiments); each set of flags is its own build."""
    return _library_for(device_index, settings.get().nvcc_flags)


@functools.cache
def _library_for(device_index: int, extra_flags: str) -> ctypes.CDLL | None:
    capability = torch.cuda.get_device_capability(device_index)
    try:
        lib = jit.load("rope_kv", capability, extra_flags)
    except (jit.BuildError, OSError, subprocess.SubprocessError) as err:
        warnings.warn(f"sgl_ext: CUDA kernel unavailable, using Triton ({err})", stacklevel=3)
        return None
    lib.sgl_ext_rope_kv_launch.argtypes = [
        ctypes.POINTER(_Params),
        *[ctypes.c_int] * 8,
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_int,
    ]
    lib.sgl_ext_rope_kv_launch.restype = ctypes.c_int
    lib.sgl_ext_error_string.restype = ctypes.c_char_p
    if lib.sgl_ext_rope_kv_struct_size() != ctypes.sizeof(_Params):
        raise RuntimeError("sgl_ext: RopeKVParams layout differs between rope_kv.cu and Python")
    code = lib.sgl_ext_rope_kv_preload(device_index)  # load the module outside any graph capture
    if code:
        raise RuntimeError(f"sgl_ext: loading the CUDA kernels failed: {_error(lib, code)}")
    return lib


def _error(lib: ctypes.CDLL, err: int) -> str:
    return f"{lib.sgl_ext_error_string(err).decode()} (cudaError {err})"


def available(device: torch.device) -> bool:
    """The kernel is built (nvcc ran once, cached) and loaded for this CUDA device."""
    if settings.get().disable_cuda:
        return False
    return _library(_index(device)) is not None


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _aligned(t: torch.Tensor, *strides: int, elems: int = 8) -> bool:
    """Rows of t start on 16-byte boundaries: pointer % 16 and every stride % elems."""
    return t.data_ptr() % 16 == 0 and all(s % elems == 0 for s in strides)


def supports(
    call: RopeCall,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    arg: Any,
) -> bool:
    """Whether this (already checked) call fits the CUDA kernel. arg: the FusedSetKVBufferArg
    or None."""
    if not query.is_cuda or query.dtype not in (torch.bfloat16, torch.float16):
        return False
    rot, q, k = call.rot_dim, call.query, call.key
    assert q is not None
    if rot % 16 or call.head_size % 8 or call.max_pos >= 2**31:
        return False
    if not (_aligned(query, q.token_stride, q.head_stride)):
        return False
    if not _aligned(key, k.token_stride, k.head_stride):
        return False
    if not _aligned(cos_sin_cache, call.cs_stride, elems=4):
        return False
    kv = call.kv
    if kv is not None:
        v = kv.value
        if kv.v_head_dim % 8 or not _aligned(arg.value, v.token_stride, v.head_stride):
            return False
        if kv.k_layout.num_slots >= 2**31 or kv.k_dtype != kv.v_dtype:  # one cache kind
            return False
        for buf, lay in ((arg.k_buffer, kv.k_layout), (arg.v_buffer, kv.v_layout)):
            if not _aligned(buf, *lay.strides):
                return False
        for s in (arg.k_scale, arg.v_scale):
            if isinstance(s, torch.Tensor) and s.dtype != torch.float32:
                return False
    return call.num_tokens < 2**31


def preferred(num_tokens: int) -> bool:
    """Where the CUDA kernel is chosen over Triton when both can run (measured, RESULTS.md).
    `SGL_EXT_CUDA_TOKENS="lo,hi"` overrides the token range (tuning)."""
    lo, hi = settings.get().cuda_tokens or _PREFERRED_TOKENS
    return lo <= num_tokens <= hi


class CudaConfig(NamedTuple):
    block_x: int  # lanes of a token per block (multiple of 32)
    tokens_per_block: int
    heads: int = 1  # heads per rotation lane, pieces per copy lane (1 or 4)


def launch_config(num_tokens: int, num_heads: int, pieces: int, rot_chunks: int) -> CudaConfig:
    """Lanes per block (at most 128: more blocks, more SMs at small T), heads per lane.
    `SGL_EXT_CUDA_CONFIG="block_x,tokens[,heads]"` overrides (tuning)."""
    override = settings.get().cuda_config
    if override:
        return CudaConfig(*override)
    heads = 4 if num_tokens > 4096 else 1  # sweep of 2026-11-22: 4 heads won only at 8192
    lanes = num_lanes(num_heads, pieces, rot_chunks, heads)
    padded = -(-lanes // 32) * 32
    chunks = -(-padded // 128)
    return CudaConfig(-(-padded // (chunks * 32)) * 32, 1, heads)


def num_lanes(num_heads: int, pieces: int, rot_chunks: int, heads: int) -> int:
    """Threads per token: rotation lanes (chunks x head groups), then copy lanes."""
    return -(-num_heads // heads) * rot_chunks + -(-pieces // heads)


def _scale(scale: float | torch.Tensor | None) -> tuple[int, int, float]:
    """scale_args with the device tensor as its address (0 without one)."""
    mode, t, inv = scale_args(scale)
    return mode, t.data_ptr() if t is not None else 0, inv


def launch(
    call: RopeCall,
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    arg: Any,
    enable_pdl: bool | None = None,
) -> None:
    """Launch the kernel for a call `supports` accepted (arg: FusedSetKVBufferArg or None)."""
    num_tokens = call.num_tokens
    if num_tokens == 0:
        return
    index = _index(query.device)
    lib = _library(index)
    if lib is None:
        raise RuntimeError("sgl_ext: the CUDA kernel is not available on this machine")
    q, k = call.query, call.key
    assert q is not None
    num_q_heads, q_tok, q_head = q.num_heads, q.token_stride, q.head_stride
    num_kv_heads, k_tok, k_head = k.num_heads, k.token_stride, k.head_stride
    head_size, rot, is_neox = call.head_size, call.rot_dim, call.is_neox
    kv = call.kv
    if kv is not None:
        k_lay, v_lay, v_dim = kv.k_layout, kv.v_layout, kv.v_head_dim
        v_tok, v_head = kv.value.token_stride, kv.value.head_stride
        k_mode, k_ptr, k_inv = _scale(arg.k_scale)
        v_mode, v_ptr, v_inv = _scale(arg.v_scale)
        cache = _CACHE_KIND.get(kv.k_dtype, 0)
        ps = k_lay.page_size
        shift = ps.bit_length() - 1 if ps & (ps - 1) == 0 else -1
        pieces = num_kv_heads * ((head_size - rot) // 8 + v_dim // 8)
        ptrs = (arg.value.data_ptr(), arg.k_buffer.data_ptr(), arg.v_buffer.data_ptr())
        kv_ints = (*k_lay.strides, *v_lay.strides)
        loc = arg.cache_loc
        loc_ptr, loc64, slots = loc.data_ptr(), loc.dtype == torch.int64, k_lay.num_slots
    else:
        k_mode = v_mode = k_ptr = v_ptr = cache = shift = v_tok = v_head = v_dim = slots = 0
        k_inv = v_inv = 1.0
        ps, loc_ptr, loc64 = 1, 0, False
        pieces = 0
        ptrs = (0, 0, 0)
        kv_ints = (0,) * 6
    params = _Params(
        query.data_ptr(),
        key.data_ptr(),
        *ptrs,
        positions.data_ptr(),
        loc_ptr,
        cos_sin_cache.data_ptr(),
        k_ptr,
        v_ptr,
        q_tok,
        q_head,
        k_tok,
        k_head,
        v_tok,
        v_head,
        *kv_ints,
        cos_sin_cache.stride(0),
        num_tokens,
        num_q_heads,
        num_kv_heads,
        rot,
        head_size,
        v_dim,
        cos_sin_cache.shape[0],
        slots,
        ps,
        shift,
        positions.dtype == torch.int64,
        loc64,
        kv is not None,
        k_mode,
        v_mode,
        k_inv,
        v_inv,
    )
    num_heads = num_q_heads + num_kv_heads
    cfg = launch_config(num_tokens, num_heads, pieces, rot // 16)
    if cfg.heads not in (1, 4) or cfg.block_x * cfg.tokens_per_block > 512:
        raise ValueError(f"invalid CUDA launch config {cfg} (heads 1 or 4, at most 512 threads)")
    grid_x = -(-num_tokens // cfg.tokens_per_block)
    grid_y = -(-num_lanes(num_heads, pieces, rot // 16, cfg.heads) // cfg.block_x)
    if enable_pdl is None:
        enable_pdl = pdl_capable(index)
    stream = torch.cuda.current_stream(query.device).cuda_stream
    err = lib.sgl_ext_rope_kv_launch(
        ctypes.byref(params),
        key.dtype == torch.bfloat16,
        cache,
        bool(is_neox),
        cfg.heads,
        grid_x,
        grid_y,
        cfg.block_x,
        cfg.tokens_per_block,
        stream,
        index,
        bool(enable_pdl),
    )
    if err:
        raise RuntimeError(f"sgl_ext: CUDA rope_kv launch failed: {_error(lib, err)}")
