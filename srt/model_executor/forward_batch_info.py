"""ForwardMode and ForwardBatch: everything one forward pass needs, passed explicitly.

Follows SGLang's `sglang/srt/model_executor/forward_batch_info.py` names. There is no global
batch state: the model runner builds a `ForwardBatch`, the attention backend fills its own
metadata from it (`attn_backend.init_forward_metadata(forward_batch)`), and the model's
`forward(input_ids, positions, forward_batch)` hands it down to every layer.

Token-level tensors are laid out request after request (request 0's new tokens, then request
1's, ...). In DECODE mode every request has exactly one new token, so num_tokens == batch_size.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


class ForwardMode(enum.IntEnum):
    """What kind of forward pass a batch runs."""

    # Prefill, or the continuation of a prefix-cached prompt: several new tokens per request.
    EXTEND = enum.auto()
    # One new token per request.
    DECODE = enum.auto()
    # No tokens on this rank (kept for data-parallel attention compatibility).
    IDLE = enum.auto()

    def is_extend(self) -> bool:
        return self == ForwardMode.EXTEND

    def is_decode(self) -> bool:
        return self == ForwardMode.DECODE

    def is_idle(self) -> bool:
        return self == ForwardMode.IDLE

    def is_cuda_graph(self) -> bool:
        """Modes the CUDA-graph runner captures (decode only here)."""
        return self == ForwardMode.DECODE


@dataclass(frozen=True)
class SharedPrefixes:
    """Groups of a decode batch's requests that hold the same leading KV slots (the prefix
    cache's pages), so attention may read each group's shared prefix once per step (the Triton
    backend's cascade decode) instead of once per request. Host data, built by the scheduler
    (`srt/managers/shared_prefix.py`); a backend may ignore it.

    Group g is the batch rows `rows[g]`, whose first `prefix_lens[g]` tokens (whole pages)
    sit in the same slots: those of req_to_token row `req_pool_indices[g]`. A row is in at most
    one group, and prefix_lens[g] <= seq_len - 1 of each member (never the new token).
    """

    rows: tuple[tuple[int, ...], ...]
    prefix_lens: tuple[int, ...]
    req_pool_indices: tuple[int, ...]


class BatchAttentionBackend(Protocol):
    """What a batch and its layers ask of the batch's attention backend: every
    `srt.layers.attention.base_attn_backend.AttentionBackend` is one. Declared here, below the
    backends (which take a ForwardBatch), so the batch does not import them."""

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """Prepare the per-batch metadata every layer's forward reads."""
        ...

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        layer: Any,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
        **kwargs: Any,
    ) -> torch.Tensor:
        """Attention of the batch's new tokens for one layer (a RadixAttention)."""
        ...


@dataclass
class ForwardBatch:
    """The inputs of one forward pass (SGLang field names).

    Shapes use B = batch_size (number of requests) and T = number of new tokens in the batch
    (T == B in DECODE mode). "device" means the model's device; "cpu" tensors and Python lists
    are host-side copies that backends may read without a device sync.
    """

    # The kind of pass.
    forward_mode: ForwardMode
    # B: number of requests (int, host).
    batch_size: int
    # int64 [T], device: token ids of the new tokens.
    input_ids: torch.Tensor
    # int64 [B], device: row of each request in req_to_token_pool.req_to_token.
    req_pool_indices: torch.Tensor
    # int64 [B], device: total length of each request *including* the new tokens.
    seq_lens: torch.Tensor
    # int64 [T], device: KV-cache slot each new token's K/V is written to (< 0: do not write).
    out_cache_loc: torch.Tensor
    # int: sum(seq_lens) (host).
    seq_lens_sum: int
    # int64 [T], device: position of each new token (prefix_len + i within its request).
    positions: torch.Tensor | None = None
    # int64 [B], cpu: host copy of seq_lens (optional; lets backends avoid a device sync).
    seq_lens_cpu: torch.Tensor | None = None
    # int64 [T], device: window-pool slot of each new token for the sliding-window layers of a
    # hybrid SWAKVPool (-1: no window slot, not written); None with a uniform pool. A decode
    # batch from ScheduleBatch carries it (the allocator gave the slots on the host); otherwise
    # ModelRunner.model_forward fills it from out_cache_loc on the device.
    out_cache_loc_swa: torch.Tensor | None = None
    # int64 [5, B] (uniform pool) or [6, B] (hybrid pool), device (DECODE, optional): one block
    # whose rows are input_ids, req_pool_indices, seq_lens, out_cache_loc, positions (and
    # out_cache_loc_swa); those fields are views of it, so a CUDA-graph replay copies the batch
    # into its static inputs in one launch.
    decode_inputs: torch.Tensor | None = None
    # DECODE, optional: requests whose leading KV slots are shared (SharedPrefixes; host).
    shared_prefixes: SharedPrefixes | None = None

    # ---- EXTEND only ----
    # int32 [B], device: number of new tokens per request.
    extend_seq_lens: torch.Tensor | None = None
    # int32 [B], device: number of already-cached tokens per request (seq_lens - extend_seq_lens).
    extend_prefix_lens: torch.Tensor | None = None
    # int32 [B], device: offset of each request's first new token in the token-level tensors.
    extend_start_loc: torch.Tensor | None = None
    # list[int] of length B, host: extend_seq_lens.
    extend_seq_lens_cpu: list[int] | None = None
    # list[int] of length B, host: extend_prefix_lens.
    extend_prefix_lens_cpu: list[int] | None = None

    # ---- Pools and backend (objects, not tensors) ----
    # ReqToTokenPool: .req_to_token is int32 [max_reqs, max_context_len] of KV slots, device.
    req_to_token_pool: Any = None
    # MHATokenToKVPool: per-layer K/V buffers (get_key_buffer / get_value_buffer / set_kv_buffer).
    token_to_kv_pool: Any = None
    # The AttentionBackend that runs RadixAttention for this batch.
    attn_backend: BatchAttentionBackend | None = None

    # ---- Options ----
    # Whether attention layers may fuse the K/V cache write into the RoPE kernel
    # (see srt/models/utils.py: enable_fused_set_kv_buffer).
    enable_fused_rope_kv: bool = True
    # Whether the logits processor should also return logits of every new token (EXTEND).
    return_all_logits: bool = False

    # ---- Input-token logprobs (EXTEND only; SGLang's names) ----
    # Whether the logits processor also scores the prompt tokens (the two fields below).
    return_logprob: bool = False
    # list[int] of length B, host: each request's first prompt position with an input logprob
    # (srt/layers/logprob_processor.py: input_logprob_rows); extend_seq_lens_cpu[i]: none.
    extend_logprob_start_lens_cpu: list[int] | None = None
    # list[int] of length B, host: top logprobs wanted per scored position of each request.
    top_logprobs_nums: list[int] | None = None

    # ---- Per-batch memo (not an input) ----
    # (pool, answer) of srt.models.utils.enable_fused_set_kv_buffer for this batch's pool, so
    # the layers after the first skip the pool's layout checks; None until the first layer.
    fused_kv_memo: tuple[Any, bool] | None = field(default=None, init=False, repr=False)
    # The residual stream of SGLang-style stage boundaries during one forward pass
    # (srt.layers.layer_boundary: started by the model, closed by its final norm); None between
    # passes.
    residual_stream: Any = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.positions is None and self.forward_mode.is_decode():
            # int64 [B]: the single new token sits at the last position of its request.
            self.positions = (self.seq_lens - 1).to(torch.int64)

    @property
    def num_tokens(self) -> int:
        """T, the number of new tokens (host int, from a shape: no sync)."""
        return int(self.input_ids.shape[0])

    @property
    def device(self) -> torch.device:
        return self.input_ids.device


class PPProxyTensors:
    """Tensors handed from one pipeline stage to the next (SGLang's name). srt runs one stage,
    so model files only name this type; it holds a dict of tensors."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = dict(tensors)

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.tensors[key]

    def __len__(self) -> int:
        return len(self.tensors)


def compute_extend_metadata(
    prefix_lens: list[int], extend_lens: list[int], device: torch.device | str
) -> dict[str, Any]:
    """Host-side helper: positions and extend_* fields for an EXTEND batch.

    Parameters
    ----------
    prefix_lens, extend_lens : list[int] of length B
        Cached and new tokens of each request.
    device : device of the returned tensors.

    Returns
    -------
    dict with `positions` (int64 [T]), `extend_seq_lens`, `extend_prefix_lens`,
    `extend_start_loc` (int32 [B]), their `*_cpu` lists, `seq_lens` (int64 [B]), `seq_lens_cpu`
    and `seq_lens_sum`, ready to be splatted into `ForwardBatch(...)`.
    """
    if len(prefix_lens) != len(extend_lens):
        raise ValueError(
            f"prefix_lens has {len(prefix_lens)} entries, extend_lens has {len(extend_lens)}"
        )
    if any(n <= 0 for n in extend_lens) or any(p < 0 for p in prefix_lens):
        raise ValueError("extend_lens must be positive and prefix_lens non-negative")
    seq_lens = [p + n for p, n in zip(prefix_lens, extend_lens, strict=True)]
    starts = [0]
    for n in extend_lens[:-1]:
        starts.append(starts[-1] + n)
    # int64 [T]: prefix_len .. seq_len - 1 of each request, concatenated.
    positions = torch.cat(
        [torch.arange(p, s, dtype=torch.int64) for p, s in zip(prefix_lens, seq_lens, strict=True)]
    )
    return dict(
        positions=positions.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=device),
        seq_lens_cpu=torch.tensor(seq_lens, dtype=torch.int64),
        seq_lens_sum=sum(seq_lens),
        extend_seq_lens=torch.tensor(extend_lens, dtype=torch.int32, device=device),
        extend_prefix_lens=torch.tensor(prefix_lens, dtype=torch.int32, device=device),
        extend_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        extend_seq_lens_cpu=list(extend_lens),
        extend_prefix_lens_cpu=list(prefix_lens),
    )
