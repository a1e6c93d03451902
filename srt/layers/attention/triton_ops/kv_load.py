"""Triton helpers shared by the attention kernels: tiles of cached K and V, and one step of the
online softmax over a tile.

A KV buffer is addressed through its strides: slot s lives at
(s // PAGE_SIZE) * page_stride + (s % PAGE_SIZE) * off_stride + head * head_stride + d.
fp8 caches are passed as their uint8 bytes and decoded exactly with integer ops (the same code on
the GPU and under TRITON_INTERPRET, whose fp8 support is incomplete), then multiplied by the
layer's scale.
"""

from __future__ import annotations

from collections import namedtuple

import torch
import triton
import triton.language as tl

KV_FP8_NONE, KV_FP8_E4M3, KV_FP8_E5M2 = 0, 1, 2
SCALE_NONE, SCALE_FLOAT, SCALE_PTR = 0, 1, 2

# The kernels pass these bundles to the helpers below (Triton tuples: no IR of their own, the
# compiled code is that of the values passed one by one). AttnFlags, the constexpr
# configuration, is bound as `cfg: tl.constexpr = AttnFlags(...)` and read as `cfg.NAME` (a
# plain assignment would turn its values into tensors).
# A KV-cache buffer: pointer, element strides (module docstring) and its scale (pointer, float).
KVBuffer = namedtuple("KVBuffer", "ptr page_stride off_stride head_stride scale_ptr scale_f")
KVBuffers = namedtuple("KVBuffers", "k v")
# The KV head a program reads and its key / value dims ([BLOCK_D], [BLOCK_DV]).
KVHead = namedtuple("KVHead", "kvh d dv")
AttnFlags = namedtuple(
    "AttnFlags",
    "D DV BLOCK_N PAGE_SIZE KV_FP8 K_SCALE_MODE V_SCALE_MODE TILE_F32 USE_CAP DOT_PRECISION P_LOW",
)


def sm_count(device: torch.device) -> int:
    """The GPU's SM count, which the split counts aim their programs at; 1 off the GPU."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def pow2(n: int) -> int:
    """The smallest power of two >= n (host ints; triton.next_power_of_2 is a slower
    constexpr function)."""
    return 1 << (int(n) - 1).bit_length() if n > 1 else 1


@triton.jit
def fp8_bytes_to_f32(b, KV_FP8: tl.constexpr):
    """uint8 fp8 codes -> float32 (exact; e4m3fn or e5m2, finite codes)."""
    x = b.to(tl.int32)
    sign = (x & 0x80) << 24
    if KV_FP8 == 1:  # e4m3fn: 4 exponent bits (bias 7), 3 mantissa bits
        e = (x >> 3) & 0xF
        m = x & 0x7
        normal = (sign | ((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
        sub = m.to(tl.float32) * 0.001953125  # m * 2^-9
    else:  # e5m2: 5 exponent bits (bias 15), 2 mantissa bits
        e = (x >> 2) & 0x1F
        m = x & 0x3
        normal = (sign | ((e + 112) << 23) | (m << 21)).to(tl.float32, bitcast=True)
        sub = m.to(tl.float32) * 0.0000152587890625  # m * 2^-16
    sub = tl.where((x & 0x80) != 0, -sub, sub)
    return tl.where(e == 0, sub, normal)


@triton.jit
def load_kv_tile(
    buf,
    slot,
    mask,
    head,
    dims,
    PAGE_SIZE: tl.constexpr,
    KV_FP8: tl.constexpr,
    SCALE_MODE: tl.constexpr,
    OUT_F32: tl.constexpr = True,
):
    """[len(slot), len(dims)]: the cached rows `slot` (int64) of one head of buf (a KVBuffer),
    float32 (fp8 caches: always; 16-bit caches keep their dtype when OUT_F32 is False, for 16-bit
    tensor-core dots)."""
    page = slot // PAGE_SIZE
    off = slot % PAGE_SIZE
    ptr = buf.ptr + page[:, None] * buf.page_stride + off[:, None] * buf.off_stride
    ptr = ptr + head * buf.head_stride + dims[None, :]
    x = tl.load(ptr, mask=mask, other=0)
    if KV_FP8 != 0:
        x = fp8_bytes_to_f32(x, KV_FP8)
        if SCALE_MODE == 1:
            x = x * buf.scale_f
        elif SCALE_MODE == 2:
            x = x * tl.load(buf.scale_ptr).to(tl.float32)
    if OUT_F32:
        x = x.to(tl.float32)
    return x


@triton.jit
def load_kv_tiles(kv, slot, rows, head, cfg):
    """(K [BLOCK_N, BLOCK_D], V [BLOCK_N, BLOCK_DV]): the cached rows `slot` (int64 [BLOCK_N])
    of head = KVHead(kvh, d, dv) in kv (KVBuffers; load_kv_tile); rows outside `rows` are
    zero. cfg: the kernel's AttnFlags."""
    kvh, d, dv = head
    k_mask = rows[:, None] & (d[None, :] < cfg.D)
    k = load_kv_tile(
        kv.k, slot, k_mask, kvh, d, cfg.PAGE_SIZE, cfg.KV_FP8, cfg.K_SCALE_MODE, cfg.TILE_F32
    )
    v_mask = rows[:, None] & (dv[None, :] < cfg.DV)
    v = load_kv_tile(
        kv.v, slot, v_mask, kvh, dv, cfg.PAGE_SIZE, cfg.KV_FP8, cfg.V_SCALE_MODE, cfg.TILE_F32
    )
    return k, v


@triton.jit
def load_tile(kv, slots, start, end, qpos, EARLY: tl.constexpr, head, cfg):
    """The tile of keys start .. start + BLOCK_N - 1 (those < end) of a request, whose slot row
    is slots = (req_to_token, req, its row stride): (keys j, mask, slots, K, V). EARLY (loaded
    before the PDL wait): without the newest key qpos, which the kernel before may still be
    writing (`with_newest` adds it after the wait)."""
    j = start + tl.arange(0, cfg.BLOCK_N)
    jm = j < end
    req_to_token, req, stride_r2t = slots
    slot = tl.load(req_to_token + req * stride_r2t + j, mask=jm, other=0).to(tl.int64)
    rows = jm & (j != qpos) if EARLY else jm
    k, v = load_kv_tiles(kv, slot, rows, head, cfg)
    return j, jm, slot, k, v


@triton.jit
def with_newest(k, v, j, start, slot, qpos, head, kv, cfg):
    """An EARLY tile (load_tile from key start) with the newest key / value qpos put in, if the
    tile holds it (after the wait)."""
    if (qpos >= start) & (qpos < start + cfg.BLOCK_N):
        newest = j == qpos
        k_new, v_new = load_kv_tiles(kv, slot, newest, head, cfg)
        k = tl.where(newest[:, None], k_new, k)
        v = tl.where(newest[:, None], v_new, v)
    return k, v


@triton.jit
def softmax_step(q, k, v, vis, m_i, l_i, acc, logits, V, cfg):
    """One tile of the online softmax: (m_i, l_i, acc) of the query rows q [ROWS, BLOCK_D] after
    keys k [BLOCK_N, BLOCK_D] / values v, where vis ([ROWS or 1, BLOCK_N]) marks the visible
    keys; logits = (sm_scale, logit_cap). Products in tensor-core dots with float32
    accumulation (DOT_PRECISION); V: the value cache (its dtype)."""
    sm_scale, logit_cap = logits
    DOT_PRECISION: tl.constexpr = cfg.DOT_PRECISION
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * sm_scale  # [ROWS, BLOCK_N]
    if cfg.USE_CAP:
        s = logit_cap * (2.0 * tl.sigmoid(2.0 * s / logit_cap) - 1.0)  # cap * tanh(s / cap)
    s = tl.where(vis, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if cfg.P_LOW:  # 16-bit caches: the probabilities are rounded to V's dtype for the dot
        p = p.to(V.dtype.element_ty)
        if cfg.TILE_F32:  # interpreter: exact float32 products of the same rounded values
            p = p.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def early_tile_step(q, tile, end, qpos, state, head, kv, logits, cfg):
    """After the wait: an EARLY tile = (k, v, j, jm, start, slot) (load_tile from key start)
    with its newest key put in, through one softmax step from state = (m_i, l_i, acc), if it
    holds any key (start < end). Returns the new state."""
    k, v, j, jm, start, slot = tile
    m_i, l_i, acc = state
    if start < end:
        k, v = with_newest(k, v, j, start, slot, qpos, head, kv, cfg)
        m_i, l_i, acc = softmax_step(q, k, v, jm[None, :], m_i, l_i, acc, logits, kv.v.ptr, cfg)
    return m_i, l_i, acc
