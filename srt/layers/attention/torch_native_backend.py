"""TorchNativeAttnBackend: attention in plain torch over the paged KV pool (CPU and GPU).

The reference backend: float32 math, GQA, sliding window, logit cap, attention sinks, any page
size, fp8 KV (dequantised with the layer's scales). K/V are gathered through
req_to_token -> slot -> (page, offset), so the pool's buffers are never copied whole.

Decode is batched and sync-free (a gather of the full req_to_token row width + mask), so it
captures in a CUDA graph and eager decode gives the same bits as a replay; extend loops over
requests using host-side lengths.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from srt.layers.attention.base_attn_backend import AttentionBackend, DecodeGraphMixin
from srt.layers.attention.kv_utils import gather_kv, layer_buffers, req_to_token_for_layer
from srt.layers.attention.kv_utils import save_kv_cache as save_kv

if TYPE_CHECKING:
    from srt.layers.radix_attention import RadixAttention
    from srt.model_executor.forward_batch_info import ForwardBatch

_NEG = torch.finfo(torch.float32).min


@dataclass
class _DecodeMetadata:
    req_pool_indices: torch.Tensor  # int64 [B], device
    seq_lens: torch.Tensor  # int64 [B], device
    max_len: int  # number of req_to_token columns gathered per request (host int)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    kv_len: torch.Tensor,
    layer: RadixAttention,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Masked attention in float32.

    Parameters
    ----------
    q : float32 [B, Nq, Hq, D]; k : float32 [B, L, Hkv, D]; v : float32 [B, L, Hkv, Dv]
        Key j of request b is the token at position j.
    q_pos : int64 [B, Nq], position of each query; kv_len : int64 [B], valid keys per request.
    layer : scaling, logit_cap and sliding_window_size come from it.
    sinks : optional [Hq] sink logits (an extra softmax column with no value).

    Returns
    -------
    float32 [B, Nq, Hq, Dv]
    """
    B, Nq, Hq, D = q.shape
    L, Hkv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    qg = q.view(B, Nq, Hkv, G, D)  # [B, Nq, Hkv, G, D]
    s = torch.einsum("bqhgd,blhd->bhgql", qg, k) * layer.scaling  # [B, Hkv, G, Nq, L]
    if layer.logit_cap > 0:
        s = layer.logit_cap * torch.tanh(s / layer.logit_cap)
    j = torch.arange(L, device=q.device)  # [L]
    qp = q_pos[:, :, None]  # [B, Nq, 1]
    mask = (j[None, None, :] <= qp) & (j[None, None, :] < kv_len[:, None, None])  # [B, Nq, L]
    if layer.sliding_window_size >= 0:
        mask &= j[None, None, :] >= qp - layer.sliding_window_size
    s = s.masked_fill(~mask[:, None, None], _NEG)
    m = s.amax(dim=-1, keepdim=True)  # [B, Hkv, G, Nq, 1]
    if sinks is not None:
        sk = sinks.float().view(1, Hkv, G, 1, 1)
        m = torch.maximum(m, sk)
    p = torch.exp(s - m)
    denom = p.sum(dim=-1, keepdim=True)
    if sinks is not None:
        denom = denom + torch.exp(sk - m)
    p = p / denom
    vz = torch.where(mask.any(1)[:, :, None, None], v, 0.0)  # zero unused rows (no NaN leak)
    out = torch.einsum("bhgql,blhe->bqhge", p, vz)  # [B, Nq, Hkv, G, Dv]
    return out.reshape(B, Nq, Hq, v.shape[-1])


class TorchNativeAttnBackend(DecodeGraphMixin, AttentionBackend):
    """Plain-torch attention backend (the reference; works on any device).

    Parameters
    ----------
    req_to_token_pool : ReqToTokenPool (its `req_to_token` is int32 [max_reqs, max_ctx]).
    device : model device.
    """

    def __init__(self, req_to_token_pool=None, device: torch.device | str = "cpu") -> None:
        self.req_to_token_pool = req_to_token_pool
        self.device = torch.device(device)
        self.forward_metadata: _DecodeMetadata | None = None
        self.cuda_graph_metadata: _DecodeMetadata | None = None

    # ---------------------------------------------------------------- metadata
    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        if self.req_to_token_pool is None:
            self.req_to_token_pool = forward_batch.req_to_token_pool
        if forward_batch.forward_mode.is_decode():
            # Always the full row width, as under a CUDA graph: the reduction then has the same
            # shape eager and replayed, so both give the same bits (and no host sync is needed).
            max_len = self.req_to_token_pool.req_to_token.shape[1]
            self.forward_metadata = _DecodeMetadata(
                forward_batch.req_pool_indices.long(), forward_batch.seq_lens.long(), max_len
            )
        else:
            self.forward_metadata = None

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        dev = self.req_to_token_pool.req_to_token.device
        self.cuda_graph_metadata = _DecodeMetadata(
            torch.zeros(max_bs, dtype=torch.int64, device=dev),
            torch.ones(max_bs, dtype=torch.int64, device=dev),
            self.req_to_token_pool.req_to_token.shape[1],
        )

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, sinks=None, **kw):
        if save_kv_cache:
            save_kv(k, v, layer, forward_batch)
        md = self.forward_metadata
        if md is None:
            raise RuntimeError("init_forward_metadata was not called for this decode batch")
        B = md.seq_lens.shape[0]
        r2t = req_to_token_for_layer(self.req_to_token_pool, layer, forward_batch)
        slots = r2t[md.req_pool_indices, : md.max_len].long()  # [B, L]
        kbuf, vbuf = layer_buffers(layer, forward_batch)
        kk = gather_kv(kbuf, slots, layer.k_scale)  # [B, L, Hkv, D]
        vv = gather_kv(vbuf, slots, layer.v_scale)  # [B, L, Hkv, Dv]
        qf = q.reshape(B, 1, layer.tp_q_head_num, layer.qk_head_dim).float()  # [B, 1, Hq, D]
        q_pos = (md.seq_lens - 1)[:, None]  # [B, 1]
        out = attend(qf, kk, vv, q_pos, md.seq_lens, layer, sinks)  # [B, 1, Hq, Dv]
        return out.reshape(B, layer.tp_q_head_num * layer.v_head_dim).to(q.dtype)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, sinks=None, **kw):
        if save_kv_cache:
            save_kv(k, v, layer, forward_batch)
        fb = forward_batch
        r2t = req_to_token_for_layer(self.req_to_token_pool or fb.req_to_token_pool, layer, fb)
        kbuf, vbuf = layer_buffers(layer, fb)
        T = q.shape[0]
        qf = q.reshape(T, layer.tp_q_head_num, layer.qk_head_dim)  # [T, Hq, D]
        out = q.new_empty(T, layer.tp_q_head_num, layer.v_head_dim)  # [T, Hq, Dv]
        start = 0
        lens = zip(fb.extend_seq_lens_cpu, fb.extend_prefix_lens_cpu, strict=True)
        for i, (n, p) in enumerate(lens):
            L = n + p
            slots = r2t[fb.req_pool_indices[i : i + 1], :L].long()  # [1, L]
            kk = gather_kv(kbuf, slots, layer.k_scale)  # [1, L, Hkv, D]
            vv = gather_kv(vbuf, slots, layer.v_scale)  # [1, L, Hkv, Dv]
            qi = qf[start : start + n].float()[None]  # [1, n, Hq, D]
            q_pos = torch.arange(p, L, device=q.device)[None]  # [1, n]
            kv_len = torch.full((1,), L, device=q.device, dtype=torch.int64)
            out[start : start + n] = attend(qi, kk, vv, q_pos, kv_len, layer, sinks)[0]
            start += n
        return out.view(T, -1)
