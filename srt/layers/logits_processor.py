"""LogitsProcessor: hidden states -> next-token logits (only the rows that need them)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from srt.distributed import tensor_model_parallel_all_gather
from srt.layers.gemm_choice import dispatch_linear
from srt.layers.logprob_processor import TokenLogprobs, input_logprob_rows, input_token_logprobs

if TYPE_CHECKING:
    from srt.model_executor.forward_batch_info import ForwardBatch


@dataclass
class LogitsProcessorOutput:
    # float32 [B, V]: logits after each request's last new token.
    next_token_logits: torch.Tensor
    # float32 [T, V]: logits after every new token (only when forward_batch.return_all_logits).
    all_logits: torch.Tensor | None = None
    # [B, sum of hidden sizes]: the captured aux hidden states of the rows whose logits were
    # computed (SGLang's EAGLE3 capture; only when the model passes aux_hidden_states).
    hidden_states: torch.Tensor | None = None
    # Logprobs of the prompt tokens at the rows `input_logprob_rows` names (only when
    # forward_batch.return_logprob): one row per scored position, request after request.
    input_logprobs: TokenLogprobs | None = None


class LogitsProcessor(nn.Module):
    """Project the last hidden state of each request onto the vocabulary.

    Parameters (SGLang's signature)
    ----------
    config : the model config (its `vocab_size` and `final_logit_softcapping` are read: an HF
        config, a ModelConfig) or the vocabulary size itself.
    skip_all_gather : at TP > 1, return this rank's vocabulary slice of the logits (no gather).
    logit_scale : multiply the logits by it (after the projection, before any softcap).
    return_full_logits : also return the logits of every new token of an EXTEND batch.
    vocab_size, final_logit_softcapping : keywords overriding the config's (padded LM-head rows
        past vocab_size are dropped; a cap > 0 applies cap * tanh(logits / cap)).
    """

    def __init__(
        self,
        config: Any = None,
        skip_all_gather: bool = False,
        logit_scale: float | None = None,
        return_full_logits: bool = False,
        *,
        vocab_size: int | None = None,
        final_logit_softcapping: float | None = None,
    ) -> None:
        super().__init__()
        config_vocab: Any
        config_cap: Any = None
        if isinstance(config, int):
            config_vocab = config
        else:
            config_vocab = getattr(config, "vocab_size", None)
            config_cap = getattr(config, "final_logit_softcapping", None)
        vocab: Any = vocab_size if vocab_size is not None else config_vocab
        if not isinstance(vocab, int) or vocab <= 0:
            raise ValueError(f"vocab_size must be a positive int, got {vocab!r}")
        self.config = config
        self.vocab_size = vocab
        cap = final_logit_softcapping if final_logit_softcapping is not None else config_cap
        self.softcap = float(cap or 0.0)
        self.skip_all_gather = skip_all_gather
        self.logit_scale = logit_scale
        self.return_full_logits = return_full_logits

    def _project(self, hidden: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        weight: torch.Tensor = lm_head.weight  # type: ignore[assignment]  # [V / tp, hidden]
        bias: torch.Tensor | None = getattr(lm_head, "bias", None)
        x = hidden.to(weight.dtype)
        tp = getattr(lm_head, "tp_size", 1)
        if tp == 1 and weight.shape[0] == self.vocab_size:
            # float32 [N, V] stored by the GEMM itself (the skinny Triton GEMM at decode sizes,
            # gemm_choice's LM-head rows): the values of the 16-bit product, no second kernel
            logits = dispatch_linear(x, weight, bias, out_dtype=torch.float32)
        elif tp > 1 and self.skip_all_gather:
            logits = dispatch_linear(x, weight, bias).float()  # [N, Vp]: this rank's slice
        else:
            logits = dispatch_linear(x, weight, bias)  # [N, Vp]
            if tp > 1:
                logits = tensor_model_parallel_all_gather(logits, dim=-1)  # [N, Vp * tp]
            logits = logits[:, : self.vocab_size].float()  # [N, V]
        if self.logit_scale is not None:
            logits = logits * self.logit_scale
        if self.softcap > 0:
            logits = self.softcap * torch.tanh(logits / self.softcap)
        return logits

    def input_logprobs(
        self,
        input_ids: torch.Tensor,
        hidden_states: torch.Tensor,
        lm_head: nn.Module,
        forward_batch: ForwardBatch,
    ) -> TokenLogprobs:
        """The prompt-token logprobs an EXTEND batch asks for (chunked LM-head projections)."""
        rows, top_k = _scored_rows(forward_batch)
        project = lambda h: self._project(h, lm_head)  # noqa: E731
        return input_token_logprobs(hidden_states, input_ids, rows, project, self.vocab_size, top_k)

    def forward(
        self,
        input_ids: torch.Tensor,
        hidden_states: torch.Tensor,
        lm_head: nn.Module,
        logits_metadata: ForwardBatch,
        aux_hidden_states: Sequence[torch.Tensor] | None = None,
        hidden_states_before_norm: torch.Tensor | None = None,
    ) -> LogitsProcessorOutput:
        """hidden_states: [T, hidden] of the new tokens -> LogitsProcessorOutput.

        logits_metadata is the ForwardBatch. aux_hidden_states (SGLang's EAGLE3 capture: [T, h]
        tensors) come back concatenated for the same rows in `hidden_states`;
        hidden_states_before_norm is not used (no speculative decoding here).
        """
        mode = logits_metadata.forward_mode
        aux = torch.cat(list(aux_hidden_states), dim=-1) if aux_hidden_states else None
        if mode.is_extend():
            start, lens = logits_metadata.extend_start_loc, logits_metadata.extend_seq_lens
            assert start is not None and lens is not None  # extend batches carry both
            # int64 [B]: index of each request's last new token (device math, no sync).
            last = (start + lens - 1).long()
            aux = aux[last] if aux is not None else None
            if getattr(logits_metadata, "return_logprob", False):
                out = LogitsProcessorOutput(self._project(hidden_states[last], lm_head), None, aux)
                out.input_logprobs = self.input_logprobs(
                    input_ids, hidden_states, lm_head, logits_metadata
                )
                return out
            if self.return_full_logits or getattr(logits_metadata, "return_all_logits", False):
                all_logits = self._project(hidden_states, lm_head)  # [T, V]
                return LogitsProcessorOutput(all_logits[last], all_logits, aux)
            return LogitsProcessorOutput(self._project(hidden_states[last], lm_head), None, aux)
        return LogitsProcessorOutput(self._project(hidden_states, lm_head), None, aux)  # [B, V]


def _scored_rows(fb: ForwardBatch) -> tuple[list[int], int]:
    """The rows an EXTEND batch with return_logprob scores, and the top-k they need."""
    lens, starts = fb.extend_seq_lens_cpu, fb.extend_logprob_start_lens_cpu
    if lens is None or starts is None or fb.top_logprobs_nums is None:
        raise ValueError(
            "return_logprob needs extend_seq_lens_cpu, extend_logprob_start_lens_cpu and "
            "top_logprobs_nums"
        )
    rows, _ = input_logprob_rows(lens, starts)
    return rows, max(fb.top_logprobs_nums, default=0)


def scored_all_logits(
    all_logits: torch.Tensor, forward_batch: ForwardBatch
) -> LogitsProcessorOutput:
    """The LogitsProcessorOutput of an EXTEND batch asking for input logprobs, from a model that
    returned the [T, V] logits of every new token (no LogitsProcessor of its own)."""
    fb = forward_batch
    rows, top_k = _scored_rows(fb)
    vocab = int(all_logits.shape[1])
    scored = input_token_logprobs(all_logits, fb.input_ids, rows, lambda x: x, vocab, top_k)
    lens = fb.extend_seq_lens_cpu
    assert lens is not None  # _scored_rows checked it
    last = torch.tensor(lens, dtype=torch.int64).cumsum(0) - 1  # [B]
    next_logits = all_logits.index_select(0, last.to(all_logits.device)).float()
    return LogitsProcessorOutput(next_logits, input_logprobs=scored)
