"""Pooler: one embedding per request from the hidden states (SGLang's `layers/pooler.py`).

SGLang's model files build one for their embedding mode (`get_embedding=True`); srt's runner
asks for logits only, but the pooler works when called.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from srt.model_executor.forward_batch_info import ForwardBatch


class PoolingType(enum.IntEnum):
    LAST = 0  # each request's last new token
    CLS = 1  # each request's first new token
    MEAN = 2  # the mean over each request's new tokens


@dataclass
class EmbeddingPoolerOutput:
    # [B, hidden] float: one pooled (and, with normalize, L2-normalised) vector per request.
    embeddings: torch.Tensor


class Pooler(nn.Module):
    """pooling_type: PoolingType; normalize: L2-normalise each embedding."""

    def __init__(self, pooling_type: PoolingType, normalize: bool) -> None:
        super().__init__()
        self.pooling_type = PoolingType(pooling_type)
        self.normalize = normalize

    def forward(
        self, hidden_states: torch.Tensor, forward_batch: ForwardBatch
    ) -> EmbeddingPoolerOutput:
        """hidden_states [T, hidden] of an EXTEND batch (one token per request: DECODE)."""
        fb = forward_batch
        if fb.forward_mode.is_extend():
            assert fb.extend_start_loc is not None and fb.extend_seq_lens is not None
            start, lens = fb.extend_start_loc.long(), fb.extend_seq_lens.long()
        else:
            start = torch.arange(hidden_states.shape[0], device=hidden_states.device)
            lens = torch.ones_like(start)
        if self.pooling_type == PoolingType.LAST:
            pooled = hidden_states[start + lens - 1]
        elif self.pooling_type == PoolingType.CLS:
            pooled = hidden_states[start]
        else:
            segment = torch.repeat_interleave(torch.arange(len(lens), device=lens.device), lens)
            sums = hidden_states.new_zeros(len(lens), hidden_states.shape[-1])
            sums.index_add_(0, segment, hidden_states)
            pooled = sums / lens[:, None].to(sums.dtype)
        if self.normalize:
            pooled = F.normalize(pooled, p=2, dim=-1)
        return EmbeddingPoolerOutput(pooled)
