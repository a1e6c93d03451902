"""Triton decode attention over the paged KV cache: one query token per request.

One program per (request, KV head) handles the GROUP query heads that share that KV head, so each
cached K/V tile is read once per group (GQA), streaming the request's keys in blocks with an
online softmax. Sliding window, logit cap, attention sinks, page_size >= 1 and fp8 caches. The
launch reads only device tensors and fixed shapes, so it captures in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from srt.layers.attention.triton_ops.kv_load import load_kv_tile


@triton.jit
def _decode_kernel(
    Q,
    K,
    V,
    Out,
    Sinks,
    ReqToToken,
    ReqPoolIdx,
    SeqLens,
    KScale,
    VScale,
    k_scale_f,
    v_scale_f,
    sm_scale,
    logit_cap,
    window,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_r2t,
    k_page_stride,
    k_off_stride,
    k_head_stride,
    v_page_stride,
    v_off_stride,
    v_head_stride,
    GROUP: tl.constexpr,
    D: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    KV_FP8: tl.constexpr,
    K_SCALE_MODE: tl.constexpr,
    V_SCALE_MODE: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_CAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    req = tl.load(ReqPoolIdx + b).to(tl.int64)
    seq_len = tl.load(SeqLens + b).to(tl.int32)
    qpos = seq_len - 1
    g = tl.arange(0, BLOCK_H)
    gm = g < GROUP
    heads = kvh * GROUP + g  # [BLOCK_H] query heads of this KV head
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    q_ptr = Q + b * stride_qt + heads[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr, mask=gm[:, None] & (d[None, :] < D), other=0).to(tl.float32)
    m_i = tl.zeros([BLOCK_H], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    if HAS_SINKS:
        m_i = tl.load(Sinks + heads, mask=gm, other=0).to(tl.float32)
        l_i = l_i + 1.0
    acc = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)
    n0 = tl.zeros([], dtype=tl.int32)  # a tensor: the loop counter's type is fixed
    if USE_WINDOW:
        n0 = tl.maximum(qpos - window, n0)
    # a while loop: dynamic bounds also work under TRITON_INTERPRET (numpy 2.4 scalars)
    while n0 < seq_len:
        j = n0 + tl.arange(0, BLOCK_N)
        jm = j < seq_len
        slot = tl.load(ReqToToken + req * stride_r2t + j, mask=jm, other=0).to(tl.int64)
        k = load_kv_tile(
            K,
            slot,
            jm[:, None] & (d[None, :] < D),
            kvh,
            d,
            k_page_stride,
            k_off_stride,
            k_head_stride,
            KScale,
            k_scale_f,
            PAGE_SIZE,
            KV_FP8,
            K_SCALE_MODE,
        )
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * sm_scale  # [BLOCK_H, N]
        if USE_CAP:
            s = logit_cap * (2.0 * tl.sigmoid(2.0 * s / logit_cap) - 1.0)  # cap * tanh(s / cap)
        s = tl.where(jm[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        v = load_kv_tile(
            V,
            slot,
            jm[:, None] & (dv[None, :] < DV),
            kvh,
            dv,
            v_page_stride,
            v_off_stride,
            v_head_stride,
            VScale,
            v_scale_f,
            PAGE_SIZE,
            KV_FP8,
            V_SCALE_MODE,
        )
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
        m_i = m_new
        n0 += BLOCK_N
    l_i = tl.where(gm, l_i, 1.0)  # padding heads (not stored): avoid 0 / 0
    out = acc / l_i[:, None]
    o_ptr = Out + b * stride_ot + heads[:, None] * stride_oh + dv[None, :]
    tl.store(o_ptr, out.to(Out.dtype.element_ty), mask=gm[:, None] & (dv[None, :] < DV))


def decode_attention_fwd(
    q,
    o,
    req_to_token,
    req_pool_indices,
    seq_lens,
    sm_scale,
    kv,
    sinks=None,
    window=-1,
    logit_cap=0.0,
):
    """o[b, h] = attention of q[b, h] over request b's cached keys 0..seq_lens[b]-1.

    Parameters
    ----------
    q : [B, Hq, D]; o : [B, Hq, Dv] (written), model dtype.
    req_to_token : int32 [max_reqs, max_ctx]; req_pool_indices, seq_lens : int [B].
    kv : KVArgs from triton_backend: the layer's caches ([slots, H, D] or [pages, ps, H, D];
        fp8 caches as uint8 views), page size, fp8 kind, scales.
    sinks : float [Hq] or None; window : -1 or window-left; logit_cap : 0 for none.
    """
    B, Hq, D = q.shape
    Hkv, DV = kv.k_buffer.shape[-2], kv.v_buffer.shape[-1]
    group = Hq // Hkv
    grid = (B, Hkv)
    _decode_kernel[grid](
        q,
        kv.k_buffer,
        kv.v_buffer,
        o,
        sinks if sinks is not None else q,
        req_to_token,
        req_pool_indices,
        seq_lens,
        kv.k_scale_ptr,
        kv.v_scale_ptr,
        kv.k_scale_f,
        kv.v_scale_f,
        float(sm_scale),
        float(logit_cap),
        int(window),
        q.stride(0),
        q.stride(1),
        o.stride(0),
        o.stride(1),
        req_to_token.stride(0),
        *kv.k_strides,
        *kv.v_strides,
        GROUP=group,
        D=D,
        DV=DV,
        BLOCK_H=max(16, triton.next_power_of_2(group)),
        BLOCK_D=max(16, triton.next_power_of_2(D)),
        BLOCK_DV=max(16, triton.next_power_of_2(DV)),
        BLOCK_N=32,
        PAGE_SIZE=kv.page_size,
        KV_FP8=kv.fp8,
        K_SCALE_MODE=kv.k_scale_mode,
        V_SCALE_MODE=kv.v_scale_mode,
        HAS_SINKS=sinks is not None,
        USE_WINDOW=window >= 0,
        USE_CAP=logit_cap > 0,
        # fp32 models: exact IEEE products; bf16/fp16 models: TF32 tensor cores.
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )
    return o
