"""LogitsProcessor: hidden states -> next-token logits (only the rows that need them)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from srt.distributed import tensor_model_parallel_all_gather
from srt.layers.gemm_choice import dispatch_linear

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
            if self.return_full_logits or getattr(logits_metadata, "return_all_logits", False):
                all_logits = self._project(hidden_states, lm_head)  # [T, V]
                return LogitsProcessorOutput(all_logits[last], all_logits, aux)
            return LogitsProcessorOutput(self._project(hidden_states[last], lm_head), None, aux)
        return LogitsProcessorOutput(self._project(hidden_states, lm_head), None, aux)  # [B, V]
