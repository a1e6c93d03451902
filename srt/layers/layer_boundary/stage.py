"""Stage boundaries: what sits between a decoder layer's attention and MLP stages (SGLang's
`layer_boundary`, reduced to what one pipeline stage without DP attention needs).

A decoder layer declares its stages (`declare_attn`, `declare_ffn`) and pairs each with the norm
that opens it (`append_stages`). Each stage then runs as

    x = boundary.prepare(x, forward_batch)   # residual add + norm (the first: norm only)
    x = stage(x)                             # attention or MLP: this rank's partial sum
    x = boundary.finish(x, forward_batch)    # the partial sums summed over TP

The residual stream lives in the batch (`forward_batch.residual_stream`, started by
`residual.batch.start` and closed by `residual.batch.final_norm`), so the add + norm is one
in-place `RMSNorm(x, residual, inplace=True)` call, the same the srt decoder layers make.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from srt.distributed import tensor_model_parallel_all_reduce
from srt.layers.layer_boundary.residual.batch import stream_of
from srt.runtime_context import get_parallel

if TYPE_CHECKING:
    from srt.model_executor.forward_batch_info import ForwardBatch


@dataclass(frozen=True)
class StageFacts:
    """What a stage declares: its kind ("attn" / "ffn"), whether it is a sparse (MoE) stage
    and whether the next layer's is, and the read SGLang may fuse into its norm (a tag: srt
    always reads through the plain norm)."""

    kind: str
    sparse: bool = False
    next_layer_sparse: bool = False
    read: Any = None


def declare_attn(read: Any = None, **kwargs: Any) -> StageFacts:
    """An attention stage. SGLang's other keywords (layout contracts) are not supported."""
    if kwargs:
        raise NotImplementedError(f"declare_attn({', '.join(sorted(kwargs))}=...)")
    return StageFacts("attn", read=read)


def declare_ffn(sparse: bool = False, next_layer_sparse: bool = False, **kwargs: Any) -> StageFacts:
    """An MLP stage (sparse: a MoE)."""
    if kwargs:
        raise NotImplementedError(f"declare_ffn({', '.join(sorted(kwargs))}=...)")
    return StageFacts("ffn", sparse=sparse, next_layer_sparse=next_layer_sparse)


class StageBoundary:
    """The residual add + norm before a stage and the TP reduction after it."""

    def __init__(self, facts: StageFacts, norm: nn.Module) -> None:
        self.facts = facts
        self.norm = norm
        self.tp_size = get_parallel().tp_size

    def prepare(
        self,
        hidden_states: torch.Tensor,
        forward_batch: ForwardBatch,
        capture: Callable[[torch.Tensor], None] | None = None,
        post_residual_addition: torch.Tensor | None = None,
        cache: Any = None,
    ) -> torch.Tensor:
        """The stage's input: norm(hidden_states + residual), the sum becoming the residual (the
        first stage of the stack: norm(hidden_states), hidden_states the residual).

        capture receives the residual after the add (SGLang's aux hidden-state capture).
        post_residual_addition (an extra residual term) and cache (an NPU weight prefetch) are
        not supported.
        """
        if post_residual_addition is not None:
            raise NotImplementedError("post_residual_addition in a stage boundary")
        if cache is not None:
            raise NotImplementedError("stage boundary weight prefetch (cache=...)")
        stream = stream_of(forward_batch)
        if stream.residual is None:
            residual = hidden_states
            out = self.norm(hidden_states)
        else:
            out, residual = self.norm(hidden_states, stream.residual, inplace=True)
        stream.residual = residual
        if capture is not None:
            capture(residual)
        return out

    def finish(self, hidden_states: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        """The stage's output completed: its partial sums added up over the TP ranks (the
        stage's layers are built with reduce_results=False, as SGLang's files do)."""
        if self.tp_size > 1:
            hidden_states = tensor_model_parallel_all_reduce(hidden_states)
        return hidden_states

    def from_pp(self, pp_proxy_tensors: Any, forward_batch: ForwardBatch) -> torch.Tensor:
        raise NotImplementedError("pipeline parallelism: srt runs one pipeline stage")


def append_stages(*stages: tuple[StageFacts, nn.Module]) -> tuple[StageBoundary, ...]:
    """One StageBoundary per (facts, norm) pair, in order."""
    for facts, norm in stages:
        if not isinstance(facts, StageFacts):
            raise TypeError(f"stage facts must come from declare_attn / declare_ffn, got {facts!r}")
        if not isinstance(norm, nn.Module):
            raise TypeError(f"a stage's norm must be a module, got {type(norm).__name__}")
    return tuple(StageBoundary(facts, norm) for facts, norm in stages)
