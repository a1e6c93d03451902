"""What another package's Triton kernels share with sgl_ext's: launching, PDL, rounding, the
backend probe and the KV-buffer checks (srt's attention, MoE, sampling and memory kernels use
these; it imports nothing else of sgl_ext's private modules). Importing it imports Triton.

Launching
    cached_launcher(kernel)   `cached_launcher(kernel)[grid](...)` launches like
                              `kernel[grid](...)`: after a key's first launch (grid, pointers'
                              alignment, scalar values) the compiled kernel is called directly;
                              a kernel declaring `USE_PDL` gets it set from `pdl_on`
                              (`triton/launcher.py`)
    CachedLauncher            the type `cached_launcher` returns
    pdl_on(device)            whether kernels on `device` launch with programmatic dependent
                              launch (CUDA, Hopper or newer, not interpreted, `SGL_EXT_PDL`)

Inside a @triton.jit kernel
    pdl_enter(USE_PDL)        a PDL kernel's first statement: release the next launch, then wait
                              for the previous kernel's results (`triton/pdl.py`)
    cast_rne(x, DT, EMULATE)  float32 -> DT rounded to nearest even, under the interpreter too
                              (EMULATE: `interpreting()`; `triton/rounding.py`)

Backend
    interpreting()            Triton runs in its interpreter (`TRITON_INTERPRET=1`, read once
                              into `sgl_ext.settings`)
    select_backend(device)    "native" or "triton" for tensors on `device` (`SGL_EXT_BACKEND`)
    next_pow2(n)              smallest power of two >= n, for launch sizes (plain Python)

KV buffers (the ops' own checks, for a pool that lays out the buffers the ops write)
    kv_layout(name, buf, num_heads, head_dim)   a KV buffer's layout (`KVLayout`: 2-D, 3-D or
                              4-D paged), or a ValueError naming `name`
    check_kv_write(key, value, k_buffer, v_buffer, cache_loc, k_scale, v_scale, num_tokens,
                   head_dim)  every check of a K/V write (`set_kv_buffer`'s), -> `KVWrite`
    check_fused_arg(key, arg, head_size)   a `FusedSetKVBufferArg` checked against an already
                              checked key, as the fused op checks it (no launch) -> `KVWrite`
    KVLayout                  the frozen layout `kv_layout` returns
    KVWrite                   the frozen checked write the two checks return
"""

from __future__ import annotations

from sgl_ext._backend import interpreting, select_backend
from sgl_ext._common import (
    KVLayout,
    KVWrite,
    check_fused_arg,
    check_kv_write,
    kv_layout,
    next_pow2,
)
from sgl_ext.triton.launcher import CachedLauncher, cached_launcher, pdl_on
from sgl_ext.triton.pdl import pdl_enter
from sgl_ext.triton.rounding import cast_rne

__all__ = [
    "CachedLauncher",
    "KVLayout",
    "KVWrite",
    "cached_launcher",
    "cast_rne",
    "check_fused_arg",
    "check_kv_write",
    "interpreting",
    "kv_layout",
    "next_pow2",
    "pdl_enter",
    "pdl_on",
    "select_backend",
]
