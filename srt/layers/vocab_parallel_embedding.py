"""Token embedding and LM head, vocab split over the TP ranks.

Rank r owns ids [r * Vp, (r + 1) * Vp) with Vp = ceil(vocab / tp); rows past the real vocabulary
(padding, when tp does not divide it) are zero and their logits are dropped by LogitsProcessor.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from srt.distributed import resolve_tp, tensor_model_parallel_all_reduce


class VocabParallelEmbedding(nn.Module):
    """Embedding table [Vp, hidden] of this rank's vocabulary slice.

    Parameters
    ----------
    num_embeddings : vocabulary size V.
    embedding_dim : hidden size.
    params_dtype : parameter dtype (default: torch's default dtype).
    tp_rank, tp_size : this rank's TP position (default: TP 1).
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        params_dtype: torch.dtype | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
        prefix: str = "",
    ) -> None:
        super().__init__()
        tp_rank, tp_size = resolve_tp(tp_rank, tp_size)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.tp_rank, self.tp_size, self.prefix = tp_rank, tp_size, prefix
        self.num_embeddings_per_partition = -(-num_embeddings // tp_size)
        self.num_embeddings_padded = self.num_embeddings_per_partition * tp_size
        self.vocab_start_index = tp_rank * self.num_embeddings_per_partition
        # Real rows of this slice (the last ranks may own padding only).
        self.num_real = max(
            0, min(num_embeddings - self.vocab_start_index, self.num_embeddings_per_partition)
        )
        dtype = params_dtype or torch.get_default_dtype()
        w = torch.empty(self.num_embeddings_per_partition, embedding_dim, dtype=dtype)
        self.weight = nn.Parameter(w, requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None):
        """Copy this rank's rows of the full [V, ...] tensor (weight or bias); zero the padding."""
        want = (self.num_embeddings, *param.shape[1:])
        if tuple(loaded_weight.shape) != want:
            raise ValueError(
                f"{self.prefix or 'embedding'}: checkpoint shape {tuple(loaded_weight.shape)}, "
                f"expected {want}"
            )
        n = self.num_real
        param.data[:n].copy_(loaded_weight.narrow(0, self.vocab_start_index, n))
        param.data[n:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: int64 [T] -> [T, hidden] (all-reduced over the TP ranks)."""
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start_index  # [T]
        mask = (local < 0) | (local >= self.num_embeddings_per_partition)  # [T] not ours
        out = F.embedding(local.masked_fill(mask, 0), self.weight)  # [T, hidden]
        out = out.masked_fill(mask[:, None], 0)
        return tensor_model_parallel_all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection [Vp, hidden] of this rank's vocabulary slice; LogitsProcessor does the
    matmul and gathers the slices."""

    def __init__(self, num_embeddings: int, embedding_dim: int, bias: bool = False, **kw) -> None:
        super().__init__(num_embeddings, embedding_dim, **kw)
        if bias:
            b = torch.zeros(self.num_embeddings_per_partition, dtype=self.weight.dtype)
            self.bias = nn.Parameter(b, requires_grad=False)
            self.bias.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        else:
            self.register_parameter("bias", None)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("ParallelLMHead has no forward; use LogitsProcessor")
