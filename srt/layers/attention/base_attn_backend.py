"""AttentionBackend: the interface every attention backend implements (SGLang's names).

Life cycle per batch:
  eager:      init_forward_metadata(forward_batch), then forward(...) once per layer.
  CUDA graph: init_cuda_graph_state(max_bs, max_num_tokens) once; for each captured batch size
              init_forward_metadata_capture_cuda_graph(...) before capture, and
              init_forward_metadata_replay_cuda_graph(...) before every replay (it must only
              copy into fixed buffers: init_cuda_graph_state's, or those of the capture).
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from srt.layers.radix_attention import RadixAttention
    from srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode


class AttentionBackend(ABC):
    """Base class of the attention backends."""

    @abstractmethod
    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """Prepare the per-batch metadata (index tensors) used by every layer's forward."""

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Allocate the fixed-size metadata buffers that captured graphs read from."""
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def init_forward_metadata_capture_cuda_graph(
        self,
        bs: int,
        num_tokens: int,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        forward_mode: ForwardMode,
    ) -> None:
        """Point the metadata at the graph buffers for a capture of batch size `bs`."""
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def init_forward_metadata_replay_cuda_graph(
        self,
        bs: int,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_sum: int,
        forward_mode: ForwardMode,
        seq_lens_cpu: torch.Tensor | None,
    ) -> None:
        """Refresh the graph buffers in place before a replay (bs = the padded batch size)."""
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        """Value for seq_lens of padded (dummy) requests in a captured batch."""
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    # Whether decode reads a batch's `shared_prefixes` once per group (cascade), in graphs too.
    supports_cascade = False

    def capture_cascade_cuda_graph(self, bs: int) -> None:
        """After init_forward_metadata_capture_cuda_graph(bs): capture the cascade decode."""
        raise NotImplementedError(f"{type(self).__name__} has no cascade decode")

    def replay_cascade_cuda_graph(self, bs: int, shared: Any) -> bool:
        """Before a replay of bs's cascade graph: its buffers get the batch's shared prefixes
        (False: they do not fit the graph; the plain graph replays instead)."""
        raise NotImplementedError(f"{type(self).__name__} has no cascade decode")

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
        **kwargs,
    ) -> torch.Tensor:
        """Attention of the new tokens over their requests' cached + new K/V.

        Parameters
        ----------
        q : [T, Hq*D] or [T, Hq, D], model dtype.
        k : [T, Hkv*D] or [T, Hkv, D]; v : [T, Hkv*Dv] or [T, Hkv, Dv]. May be None when
            save_kv_cache is False and the cache already holds them.
        layer : the RadixAttention module (head counts, scaling, window, sinks, KV scales).
        forward_batch : the batch.
        save_kv_cache : write k/v into the pool at forward_batch.out_cache_loc first. False when
            the RoPE kernel already wrote them (fused path).

        Returns
        -------
        [T, Hq*Dv] in q's dtype.
        """
        mode = forward_batch.forward_mode
        if mode.is_idle():
            return q.new_empty(q.shape[0], layer.tp_q_head_num * layer.v_head_dim)
        if mode.is_decode():
            return self.forward_decode(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
        return self.forward_extend(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    @abstractmethod
    def forward_decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
        **kwargs,
    ) -> torch.Tensor:
        """DECODE mode: one new token per request."""

    @abstractmethod
    def forward_extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
        **kwargs,
    ) -> torch.Tensor:
        """EXTEND mode: several new tokens per request, causal over prefix + new tokens."""


class DecodeGraphMixin:
    """CUDA-graph metadata of a decode-only backend, shared by the torch-native and Triton
    backends. The backend's `init_cuda_graph_state` sets `cuda_graph_metadata`: a dataclass
    whose fields `req_pool_indices` and `seq_lens` are int64 [max_bs] buffers (the other fields
    are kept as they are).

    A capture points the metadata at the buffers the caller passes (the graph runner's static
    inputs; its other fields from `cuda_graph_metadata`), and a replay passing the same buffers
    again copies nothing: the host work before a replay is the runner's copy of the batch. A
    replay passing other tensors copies them into the captured buffers. A batch size that was
    never captured uses the `cuda_graph_metadata` buffers (copied into)."""

    cuda_graph_metadata: Any  # the backend's metadata dataclass (fixed buffers), or None
    forward_metadata: Any

    def _graph_metadata(self) -> dict[int, Any]:
        """Captured batch size -> its metadata (a dataclass of cuda_graph_metadata's type)."""
        table = self.__dict__.get("_captured_metadata")
        if table is None or table[0] is not self.cuda_graph_metadata:  # new graph state
            table = self.__dict__["_captured_metadata"] = (self.cuda_graph_metadata, {})
        return table[1]

    def init_forward_metadata_capture_cuda_graph(
        self,
        bs: int,
        num_tokens: int,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        forward_mode: ForwardMode,
    ) -> None:
        if not forward_mode.is_decode():
            raise NotImplementedError(f"{type(self).__name__} captures decode only")
        g = self.cuda_graph_metadata
        if g is None:
            raise RuntimeError("call init_cuda_graph_state before capturing")
        meta = dataclasses.replace(
            g, req_pool_indices=req_pool_indices[:bs], seq_lens=seq_lens[:bs]
        )
        self._graph_metadata()[bs] = meta
        self.forward_metadata = meta

    def init_forward_metadata_replay_cuda_graph(
        self,
        bs: int,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_sum: int,
        forward_mode: ForwardMode,
        seq_lens_cpu: torch.Tensor | None,
    ) -> None:
        g = self.cuda_graph_metadata
        if g is None:
            raise RuntimeError("call init_cuda_graph_state before capturing")
        meta = self._graph_metadata().get(bs)
        if meta is None:
            meta = dataclasses.replace(
                g, req_pool_indices=g.req_pool_indices[:bs], seq_lens=g.seq_lens[:bs]
            )
        if req_pool_indices.data_ptr() != meta.req_pool_indices.data_ptr():
            meta.req_pool_indices.copy_(req_pool_indices[:bs])
        if seq_lens.data_ptr() != meta.seq_lens.data_ptr():
            meta.seq_lens.copy_(seq_lens[:bs])
        self.forward_metadata = meta

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1
