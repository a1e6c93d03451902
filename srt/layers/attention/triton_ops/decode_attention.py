"""Triton decode attention over the paged KV cache: one query token per request.

One program per (request, query head) streams the request's keys in blocks with an online
softmax. GQA, sliding window, logit cap, attention sinks, page_size >= 1 and fp8 caches. The
launch reads only device tensors and fixed shapes, so it captures in a CUDA graph.
"""

from __future__ import annotations

import triton
import triton.language as tl

from srt.layers.attention.triton_ops.kv_load import load_kv_tile


@triton.jit
def _decode_kernel(
    Q, K, V, Out, Sinks, ReqToToken, ReqPoolIdx, SeqLens, KScale, VScale,
    k_scale_f, v_scale_f, sm_scale, logit_cap, window,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_r2t,
    k_page_stride, k_off_stride, k_head_stride, v_page_stride, v_off_stride, v_head_stride,
    GROUP: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
    KV_FP8: tl.constexpr, K_SCALE_MODE: tl.constexpr, V_SCALE_MODE: tl.constexpr,
    HAS_SINKS: tl.constexpr, USE_WINDOW: tl.constexpr, USE_CAP: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // GROUP
    req = tl.load(ReqPoolIdx + b).to(tl.int64)
    seq_len = tl.load(SeqLens + b).to(tl.int32)
    qpos = seq_len - 1
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    q = tl.load(Q + b * stride_qt + h * stride_qh + d, mask=d < D, other=0).to(tl.float32)
    m_i = tl.zeros([], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([], dtype=tl.float32)
    if HAS_SINKS:
        m_i = tl.load(Sinks + h).to(tl.float32)
        l_i = l_i + 1.0
    acc = tl.zeros([BLOCK_DV], dtype=tl.float32)
    start = tl.zeros([], dtype=tl.int32)  # a tensor: the loop counter's type is fixed
    if USE_WINDOW:
        start = tl.maximum(qpos - window, start)
    n0 = start
    # a while loop: dynamic bounds also work under TRITON_INTERPRET (numpy 2.4 scalars)
    while n0 < seq_len:
        j = n0 + tl.arange(0, BLOCK_N)
        jm = j < seq_len
        slot = tl.load(ReqToToken + req * stride_r2t + j, mask=jm, other=0).to(tl.int64)
        k = load_kv_tile(K, slot, jm[:, None] & (d[None, :] < D), kvh, d, k_page_stride,
                         k_off_stride, k_head_stride, KScale, k_scale_f, PAGE_SIZE, KV_FP8,
                         K_SCALE_MODE)  # fmt: skip
        s = tl.sum(q[None, :] * k, axis=1) * sm_scale  # [BLOCK_N]
        if USE_CAP:
            s = logit_cap * (2.0 * tl.sigmoid(2.0 * s / logit_cap) - 1.0)  # cap * tanh(s / cap)
        s = tl.where(jm, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe)
        v = load_kv_tile(V, slot, jm[:, None] & (dv[None, :] < DV), kvh, dv, v_page_stride,
                         v_off_stride, v_head_stride, VScale, v_scale_f, PAGE_SIZE, KV_FP8,
                         V_SCALE_MODE)  # fmt: skip
        l_i = l_i * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        m_i = m_new
        n0 += BLOCK_N
    out = acc / l_i
    tl.store(Out + b * stride_ot + h * stride_oh + dv, out.to(Out.dtype.element_ty), mask=dv < DV)


def decode_attention_fwd(q, o, req_to_token, req_pool_indices, seq_lens,
                         sm_scale, kv, sinks=None, window=-1, logit_cap=0.0):  # fmt: skip
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
    BLOCK_N = 32
    grid = (B, Hq)
    _decode_kernel[grid](
        q, kv.k_buffer, kv.v_buffer, o, sinks if sinks is not None else q, req_to_token,
        req_pool_indices, seq_lens, kv.k_scale_ptr, kv.v_scale_ptr, kv.k_scale_f, kv.v_scale_f,
        float(sm_scale), float(logit_cap), int(window),
        q.stride(0), q.stride(1), o.stride(0), o.stride(1), req_to_token.stride(0),
        *kv.k_strides, *kv.v_strides,
        GROUP=Hq // Hkv, D=D, DV=DV, BLOCK_D=triton.next_power_of_2(D),
        BLOCK_DV=triton.next_power_of_2(DV), BLOCK_N=BLOCK_N, PAGE_SIZE=kv.page_size,
        KV_FP8=kv.fp8, K_SCALE_MODE=kv.k_scale_mode, V_SCALE_MODE=kv.v_scale_mode,
        HAS_SINKS=sinks is not None, USE_WINDOW=window >= 0, USE_CAP=logit_cap > 0,
    )  # fmt: skip
    return o
