"""TritonAttnBackend: our Triton decode and extend kernels over the paged KV pool.

GQA, sliding window, logit cap, attention sinks, page_size >= 1, fp8 KV with scales. Decode is
CUDA-graph capturable: forward_decode reads only fixed-size metadata buffers (allocated by
init_cuda_graph_state and refreshed in place on replay) and never syncs with the host.
Runs on CPU tensors under TRITON_INTERPRET=1 (tests).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from sgl_ext import FP8_DTYPES
from sgl_ext.launch import interpreting, next_pow2
from srt.layers.attention.base_attn_backend import AttentionBackend, DecodeGraphMixin
from srt.layers.attention.kv_utils import layer_buffers, req_to_token_for_layer
from srt.layers.attention.kv_utils import save_kv_cache as save_kv
from srt.layers.attention.triton_ops.decode_attention import (
    DecodeLaunch,
    decode_scratch_shape,
    launch_decode,
    num_kv_splits,
    plan_decode,
)
from srt.layers.attention.triton_ops.extend_attention import (
    extend_attention_fwd,
    extend_num_splits,
)
from srt.layers.attention.triton_ops.kv_load import (
    KV_FP8_E4M3,
    KV_FP8_E5M2,
    KV_FP8_NONE,
    SCALE_FLOAT,
    SCALE_NONE,
    SCALE_PTR,
    sm_count,
)
from srt.layers.attention.triton_ops.prefix_decode import (
    CASCADE_ROWS_PER_ITEM,
    CascadeArgs,
    cascade_splits,
)
from srt.mem_cache.host_copy import upload

if TYPE_CHECKING:
    from srt.layers.radix_attention import RadixAttention
    from srt.model_executor.forward_batch_info import ForwardBatch


@dataclass
class KVArgs:
    """How the kernels address and dequantise one layer's caches."""

    k_buffer: torch.Tensor  # the cache (uint8 view for fp8), [slots, H, D] or [pages, ps, H, D]
    v_buffer: torch.Tensor
    page_size: int
    k_strides: tuple[int, int, int]  # (page, offset-in-page, head) strides in elements
    v_strides: tuple[int, int, int]
    fp8: int  # KV_FP8_NONE / E4M3 / E5M2
    k_scale_mode: int
    v_scale_mode: int
    k_scale_ptr: torch.Tensor
    v_scale_ptr: torch.Tensor
    k_scale_f: float
    v_scale_f: float


def _strides(buf: torch.Tensor) -> tuple[int, int, int]:
    if buf.ndim == 3:
        return buf.stride(0), 0, buf.stride(1)
    return buf.stride(0), buf.stride(1), buf.stride(2)


def _scale(scale, fp8: int, dummy: torch.Tensor) -> tuple[int, torch.Tensor, float]:
    if fp8 == KV_FP8_NONE or scale is None:  # non-fp8 pools ignore scales
        return SCALE_NONE, dummy, 1.0
    if isinstance(scale, torch.Tensor):
        return SCALE_PTR, scale, 1.0
    return SCALE_FLOAT, dummy, float(scale)


def kv_args(layer: RadixAttention, forward_batch: ForwardBatch) -> KVArgs:
    """Metadata-only inspection of the layer's buffers (no copies, no syncs)."""
    kbuf, vbuf = layer_buffers(layer, forward_batch)
    for name, buf in (("k_buffer", kbuf), ("v_buffer", vbuf)):
        if buf.ndim not in (3, 4) or buf.stride(-1) != 1:
            raise ValueError(f"{name} must be [slots, H, D] or [pages, ps, H, D], last dim dense")
    fp8 = {torch.float8_e4m3fn: KV_FP8_E4M3, torch.float8_e5m2: KV_FP8_E5M2}.get(
        kbuf.dtype, KV_FP8_NONE
    )
    if kbuf.dtype in FP8_DTYPES:
        kbuf, vbuf = kbuf.view(torch.uint8), vbuf.view(torch.uint8)
    ks_mode, ks_ptr, ks_f = _scale(layer.k_scale, fp8, kbuf)
    vs_mode, vs_ptr, vs_f = _scale(layer.v_scale, fp8, vbuf)
    ps = 1 if kbuf.ndim == 3 else kbuf.shape[1]
    return KVArgs(
        kbuf,
        vbuf,
        ps,
        _strides(kbuf),
        _strides(vbuf),
        fp8,
        ks_mode,
        vs_mode,
        ks_ptr,
        vs_ptr,
        ks_f,
        vs_f,
    )


@dataclass(frozen=True)
class _DecodePlan:
    """A layer's decode launch for one call shape, with its scratch (None without splits)."""

    launch: DecodeLaunch
    mid_o: torch.Tensor | None  # float32 [B, Hq, splits, BLOCK_DV]
    mid_lse: torch.Tensor | None  # float32 [B, Hq, splits]


@dataclass
class _DecodeMetadata:
    req_pool_indices: torch.Tensor  # int64 [B], device
    seq_lens: torch.Tensor  # int64 [B], device
    cascade: CascadeArgs | None = None  # the batch's shared prefixes (full-attention layers)


def cascade_items_bound(batch_size: int) -> int:
    """Work items a batch of batch_size rows can need: a group has at least two members, so at
    most batch_size // 2 groups, each cut into items of CASCADE_ROWS_PER_ITEM rows."""
    return -(-batch_size // CASCADE_ROWS_PER_ITEM) + batch_size // 2


def cascade_host(shared, batch_size: int, num_items: int | None = None) -> list[int]:
    """The cascade tensors of a batch's `SharedPrefixes` as one flat int32 list: prefix_lens
    [B], rows [B], items [W, 4] (each group cut into work items of at most
    CASCADE_ROWS_PER_ITEM rows; num_items pads W with empty items for a graph's buffers)."""
    B, per = batch_size, CASCADE_ROWS_PER_ITEM
    prefix, rows, items = [0] * B, list[int](), list[int]()
    for members, n, owner in zip(
        shared.rows, shared.prefix_lens, shared.req_pool_indices, strict=True
    ):
        for i in range(0, len(members), per):
            chunk = members[i : i + per]
            items += (len(rows), len(rows) + len(chunk), n, owner)
            rows.extend(chunk)
        for r in members:
            prefix[r] = n
    if num_items is not None:
        if len(items) > 4 * num_items:
            raise ValueError(f"{len(items) // 4} cascade work items > {num_items}")
        items += [0] * (4 * num_items - len(items))
    return prefix + rows + [0] * (B - len(rows)) + items


def cascade_views(flat: torch.Tensor, batch_size: int) -> CascadeArgs:
    """CascadeArgs viewing a flat int32 buffer laid out as `cascade_host`'s list."""
    B = batch_size
    return CascadeArgs(flat[:B], flat[B : 2 * B], flat[2 * B :].view(-1, 4))


def cascade_args(shared, batch_size: int, device: torch.device) -> CascadeArgs:
    """The cascade decode's tensors for a batch's `SharedPrefixes`, in one upload."""
    flat = upload(torch.tensor(cascade_host(shared, batch_size), dtype=torch.int32), device)
    return cascade_views(flat, batch_size)


class TritonAttnBackend(DecodeGraphMixin, AttentionBackend):
    """Attention with our Triton kernels.

    Parameters
    ----------
    req_to_token_pool : ReqToTokenPool (`req_to_token` int32 [max_reqs, max_ctx]); taken from the
        first ForwardBatch when None.
    device : model device.
    num_kv_splits : force the decode KV split count (a power of two <= 16); None picks it from
        the batch size, the KV heads and the GPU's SM count (1 off the GPU).
    """

    supports_cascade = True

    def __init__(
        self,
        req_to_token_pool=None,
        device: torch.device | str = "cuda",
        num_kv_splits: int | None = None,
    ) -> None:
        self.req_to_token_pool = req_to_token_pool
        self.device = torch.device(device)
        self.forward_metadata: _DecodeMetadata | None = None
        self.cuda_graph_metadata: _DecodeMetadata | None = None
        self.max_extend_len = 0
        self.max_extend_keys = 0  # the longest request's prefix + new tokens (split-KV extend)
        self.num_kv_splits = num_kv_splits
        self._num_sms = sm_count(self.device)
        # Decode split scratch, kept for the backend's life (captured graphs hold its pointers):
        # base buffers per (rows rounded up to a power of two, Hq, Dv, splits), views per B.
        self._scratch_base: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self._scratch: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        # KVArgs per layer id, valid while the pool and the layer's scales are the same objects
        # (pools never reallocate their buffers): (pool, k_scale, v_scale, KVArgs).
        self._kv_args: dict[int, tuple] = {}
        # The decode launch per layer id and call shape (_DecodeKey): (KVArgs, _DecodePlan),
        # valid while _layer_kv returns the same KVArgs.
        self._decode_plans: dict[int, dict[tuple, tuple[KVArgs, _DecodePlan]]] = {}
        self._cascade_bufs: dict[int, torch.Tensor] = {}  # per graph batch size (int32, flat)
        # The SharedPrefixes each holds (per graph batch size), and the eager batch's last
        # (SharedPrefixes, batch size, CascadeArgs): the scheduler hands the same object while
        # the groups stay, so their tensors are built and uploaded once, not every step.
        self._cascade_in_buf: dict[int, object] = {}
        self._cascade_eager: tuple[object, int, CascadeArgs] | None = None

    def _layer_kv(self, layer: RadixAttention, forward_batch: ForwardBatch) -> KVArgs:
        pool = forward_batch.token_to_kv_pool
        hit = self._kv_args.get(layer.layer_id)
        # identity only: == on a scale tensor would compare on the device and sync
        if (
            hit is not None
            and hit[0] is pool
            and hit[1] is layer.k_scale
            and hit[2] is layer.v_scale
        ):
            return hit[3]
        kv = kv_args(layer, forward_batch)
        self._kv_args[layer.layer_id] = (pool, layer.k_scale, layer.v_scale, kv)
        return kv

    def _splits(self, batch_size: int, num_kv_heads: int, window: int = -1) -> int:
        if self.num_kv_splits is not None:
            return self.num_kv_splits
        return num_kv_splits(batch_size, num_kv_heads, self._num_sms, window)

    def _decode_scratch(
        self, B: int, Hq: int, Dv: int, splits: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(mid_o [B, Hq, splits, BLOCK_DV], mid_lse [B, Hq, splits]) float32, reused by every
        layer and step (the layers run one after another on one stream)."""
        key = (B, Hq, Dv, splits, device)
        views = self._scratch.get(key)
        if views is None:
            rows = next_pow2(B)
            bkey = (rows, Hq, Dv, splits, device)
            base = self._scratch_base.get(bkey)
            if base is None:
                shape = decode_scratch_shape(rows, Hq, Dv, splits)
                base = (
                    torch.empty(shape, dtype=torch.float32, device=device),
                    torch.empty(shape[:3], dtype=torch.float32, device=device),
                )
                self._scratch_base[bkey] = base
            views = self._scratch[key] = (base[0][:B], base[1][:B])
        return views

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        if self.req_to_token_pool is None:
            self.req_to_token_pool = forward_batch.req_to_token_pool
        dev = forward_batch.seq_lens.device
        if forward_batch.forward_mode.is_decode():
            shared, B = forward_batch.shared_prefixes, forward_batch.batch_size
            cascade = None
            if shared is not None:
                last = self._cascade_eager
                if last is not None and last[0] is shared and last[1] == B:
                    cascade = last[2]
                else:
                    cascade = cascade_args(shared, B, dev)
                    self._cascade_eager = (shared, B, cascade)
            self.forward_metadata = _DecodeMetadata(
                forward_batch.req_pool_indices, forward_batch.seq_lens, cascade
            )
        else:
            self.forward_metadata = None
            ext = forward_batch.extend_seq_lens_cpu or []
            prefix = forward_batch.extend_prefix_lens_cpu or [0] * len(ext)
            self.max_extend_len = max(ext, default=0)
            self.max_extend_keys = max(map(sum, zip(prefix, ext, strict=True)), default=0)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        dev = self.req_to_token_pool.req_to_token.device
        self.cuda_graph_metadata = _DecodeMetadata(
            torch.zeros(max_bs, dtype=torch.int64, device=dev),
            torch.ones(max_bs, dtype=torch.int64, device=dev),
        )
        self._cascade_bufs, self._cascade_in_buf = {}, {}  # new graphs, new buffers

    # ---- cascade decode in CUDA graphs: a second graph per batch size, its tensors refreshed
    # in place (empty work items: their programs exit) ----
    def capture_cascade_cuda_graph(self, bs: int) -> None:
        """After init_forward_metadata_capture_cuda_graph(bs): the capture (and its warm-up)
        that follows records the cascade decode, reading this batch size's fixed buffers."""
        md = self.forward_metadata
        if md is None or md.cascade is not None:
            raise RuntimeError("call init_forward_metadata_capture_cuda_graph first")
        buf = self._cascade_bufs.get(bs)
        if buf is None:
            n = 2 * bs + 4 * cascade_items_bound(bs)
            buf = self._cascade_bufs[bs] = torch.zeros(
                n, dtype=torch.int32, device=md.seq_lens.device
            )
        self.forward_metadata = dataclasses.replace(md, cascade=cascade_views(buf, bs))

    def replay_cascade_cuda_graph(self, bs: int, shared) -> bool:
        """Before the replay of bs's cascade graph: its buffers get the batch's shared prefixes
        (one upload; rows past the batch's are padding, in no group). False, writing nothing,
        when they need more work items than the graph holds (groups of one request: never from
        the scheduler's `find_shared_prefixes`): the plain graph serves that batch."""
        if self._cascade_in_buf.get(bs) is shared:  # the buffers hold these groups already
            return True
        try:
            flat = cascade_host(shared, bs, cascade_items_bound(bs))
        except ValueError:
            return False
        buf = self._cascade_bufs[bs]
        buf.copy_(upload(torch.tensor(flat, dtype=torch.int32), buf.device))
        self._cascade_in_buf[bs] = shared
        return True

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, sinks=None, **kw):
        if save_kv_cache:
            save_kv(k, v, layer, forward_batch)
        md = self.forward_metadata
        if md is None:
            raise RuntimeError("init_forward_metadata was not called for this decode batch")
        B = q.shape[0]
        Hq, Dv = layer.tp_q_head_num, layer.v_head_dim
        q3 = q.view(B, Hq, layer.qk_head_dim)  # [B, Hq, D] (no copy)
        o = q.new_empty(B, Hq, Dv)  # [B, Hq, Dv]
        r2t = req_to_token_for_layer(self.req_to_token_pool, layer, forward_batch)
        kv = self._layer_kv(layer, forward_batch)
        # a shared prefix read once per group: full-attention layers only
        cascade = md.cascade if layer.sliding_window_size < 0 else None
        # Everything the plan reads besides kv (checked by identity below): the layer's
        # scalars, q's shape / strides / dtype, Dv (o is a fresh contiguous [B, Hq, Dv]),
        # the table's row stride, sinks or not, the forced split count and the interpreter.
        key = (
            B,
            q3.shape,
            q3.stride(),
            q3.dtype,
            Dv,
            r2t.stride(0),
            sinks is None,
            layer.scaling,
            layer.sliding_window_size,
            layer.logit_cap,
            self.num_kv_splits,
            interpreting(),
            None if cascade is None else cascade.items.shape[0],
        )
        plans = self._decode_plans.get(layer.layer_id)
        if plans is None:
            plans = self._decode_plans[layer.layer_id] = {}
        hit = plans.get(key)
        if hit is None or hit[0] is not kv:
            hit = plans[key] = (kv, self._plan_decode(q3, o, r2t, layer, kv, sinks, cascade))
        plan = hit[1]
        launch_decode(
            plan.launch,
            q3,
            o,
            r2t,
            md.req_pool_indices,
            md.seq_lens,
            kv,
            sinks,
            plan.mid_o,
            plan.mid_lse,
            cascade=cascade,
        )
        return o.view(B, Hq * Dv)

    def _plan_decode(self, q3, o, r2t, layer, kv: KVArgs, sinks, cascade) -> _DecodePlan:
        """The decode launch of this call shape and the scratch it writes (with a cascade,
        the prefix kernel's chunks take scratch slots after the splits')."""
        B, Hq, _ = q3.shape
        Dv = o.shape[-1]
        splits = self._splits(B, layer.tp_k_head_num, layer.sliding_window_size)
        prefix_splits = 0
        if cascade is not None:
            prefix_splits = cascade_splits(B, layer.tp_k_head_num, self._num_sms)
        slots = splits + prefix_splits
        mid_o, mid_lse = (
            self._decode_scratch(B, Hq, Dv, slots, q3.device) if slots > 1 else (None, None)
        )
        launch = plan_decode(
            q3,
            o,
            r2t,
            layer.scaling,
            kv,
            sinks is not None,
            layer.sliding_window_size,
            layer.logit_cap,
            splits,
            cascade_splits=prefix_splits,
        )
        return _DecodePlan(launch, mid_o, mid_lse)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, sinks=None, **kw):
        if save_kv_cache:
            save_kv(k, v, layer, forward_batch)
        fb = forward_batch
        T = q.shape[0]
        Hq = layer.tp_q_head_num
        q3 = q.view(T, Hq, layer.qk_head_dim)  # [T, Hq, D]
        o = q.new_empty(T, Hq, layer.v_head_dim)  # [T, Hq, Dv]
        r2t = req_to_token_for_layer(self.req_to_token_pool or fb.req_to_token_pool, layer, fb)
        window = layer.sliding_window_size
        keys = self.max_extend_keys
        if window >= 0:  # a token sees at most window + 1 keys (RadixAttention: -1 or W)
            keys = min(keys, window + self.max_extend_len + 1)
        splits = extend_num_splits(
            fb.batch_size,
            layer.tp_k_head_num,
            Hq // layer.tp_k_head_num,
            self.max_extend_len,
            keys,
            self._num_sms,
        )
        extend_attention_fwd(
            q3,
            o,
            r2t,
            fb.req_pool_indices,
            fb.extend_seq_lens,
            fb.extend_prefix_lens,
            fb.extend_start_loc,
            self.max_extend_len,
            layer.scaling,
            self._layer_kv(layer, fb),
            sinks,
            window,
            layer.logit_cap,
            num_splits=splits,
        )
        return o.view(T, Hq * layer.v_head_dim)
