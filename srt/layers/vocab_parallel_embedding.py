"""Token embedding and LM head, vocab split over ranks (tp_size = 1 today)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class VocabParallelEmbedding(nn.Module):
    """Embedding table [vocab / tp, hidden]; rank r owns ids [r * vocab/tp, (r+1) * vocab/tp).

    Parameters
    ----------
    num_embeddings : vocabulary size.
    embedding_dim : hidden size.
    params_dtype : parameter dtype (default: torch's default dtype).
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
        if num_embeddings % tp_size:
            raise ValueError(f"vocab size {num_embeddings} not divisible by tp_size {tp_size}")
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.tp_rank, self.tp_size, self.prefix = tp_rank, tp_size, prefix
        self.num_embeddings_per_partition = num_embeddings // tp_size
        self.vocab_start_index = tp_rank * self.num_embeddings_per_partition
        dtype = params_dtype or torch.get_default_dtype()
        w = torch.empty(self.num_embeddings_per_partition, embedding_dim, dtype=dtype)
        self.weight = nn.Parameter(w, requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None):
        n = self.num_embeddings_per_partition
        if loaded_weight.shape[0] != self.num_embeddings or loaded_weight.shape[1:] != (
            self.embedding_dim,
        ):
            raise ValueError(
                f"{self.prefix or 'embedding'}: checkpoint shape {tuple(loaded_weight.shape)}, "
                f"expected ({self.num_embeddings}, {self.embedding_dim})"
            )
        param.data.copy_(loaded_weight.narrow(0, self.vocab_start_index, n))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: int64 [T] -> [T, hidden]."""
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start_index
        mask = (local < 0) | (local >= self.num_embeddings_per_partition)
        out = F.embedding(local.masked_fill(mask, 0), self.weight)
        out = out.masked_fill(mask[:, None], 0)
        torch.distributed.all_reduce(out)
        return out


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection [vocab / tp, hidden]; LogitsProcessor does the matmul."""

    def __init__(self, num_embeddings: int, embedding_dim: int, bias: bool = False, **kw) -> None:
        super().__init__(num_embeddings, embedding_dim, **kw)
        if bias:
            b = torch.zeros(self.num_embeddings_per_partition, dtype=self.weight.dtype)
            self.bias = nn.Parameter(b, requires_grad=False)
        else:
            self.register_parameter("bias", None)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("ParallelLMHead has no forward; use LogitsProcessor")
