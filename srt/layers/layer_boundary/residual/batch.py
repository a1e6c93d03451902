"""The residual stream of one forward pass, kept in the batch (`forward_batch.residual_stream`;
SGLang's `layer_boundary.residual.batch`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from srt.layers.layer_boundary.residual.stream import ResidualStream

if TYPE_CHECKING:
    from srt.model_executor.forward_batch_info import ForwardBatch


def start(forward_batch: ForwardBatch) -> None:
    """A fresh stream for a new pass through the layer stack (once, before the first layer)."""
    forward_batch.residual_stream = ResidualStream()


def stream_of(forward_batch: ForwardBatch) -> ResidualStream:
    stream = forward_batch.residual_stream
    if stream is None:
        raise RuntimeError("start the layer stack (residual.batch.start) before a stage")
    return stream


def clear(forward_batch: ForwardBatch) -> None:
    """Drop the stream (the pass ended)."""
    forward_batch.residual_stream = None


def written_residual(forward_batch: ForwardBatch) -> torch.Tensor | None:
    """The residual the last prepare wrote (borrowed: do not modify)."""
    return stream_of(forward_batch).residual


def complete_output(hidden_states: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
    """The stack's output with nothing owed (every stage completes in its finish)."""
    stream_of(forward_batch)
    return hidden_states


def final_norm(
    hidden_states: torch.Tensor,
    forward_batch: ForwardBatch,
    layernorm: nn.Module,
    capture: Callable[[torch.Tensor], None] | None = None,
    *,
    finalize_norm: Any = None,
    skip_empty: bool = False,
) -> torch.Tensor:
    """The last layer's residual add and the model's final norm; closes the stream.

    capture receives the residual after the add. skip_empty returns a zero-row output as it
    is. A producer-specific finalize (finalize_norm) is not supported.
    """
    if finalize_norm is not None:
        raise NotImplementedError("final_norm(finalize_norm=...)")
    residual = stream_of(forward_batch).residual
    clear(forward_batch)
    if skip_empty and hidden_states.shape[0] == 0:
        if capture is not None:
            capture(hidden_states)
        return hidden_states
    if residual is None:  # no layer ran an add: the stack was empty
        out = layernorm(hidden_states)
        if capture is not None:
            capture(hidden_states)
        return out
    out, residual = layernorm(hidden_states, residual, inplace=True)
    if capture is not None:
        capture(residual)
    return out


def snapshot(hidden_states: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
    """hidden_states + residual (a new tensor): the stream's value at this point."""
    residual = stream_of(forward_batch).residual
    return hidden_states.clone() if residual is None else hidden_states + residual


def to_pp(hidden_states: torch.Tensor, forward_batch: ForwardBatch) -> Any:
    raise NotImplementedError("pipeline parallelism: srt runs one pipeline stage")
