"""Sampler: greedy, temperature, top-k and top-p sampling of next tokens (seeded)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

_GREEDY_EPS = 1e-6


@dataclass(frozen=True)
class SamplingBatchInfo:
    """Per-request sampling parameters of a batch (all on the logits' device).

    temperatures : float32 [B]; 0 means greedy.
    top_ps : float32 [B] in (0, 1].
    top_ks : int64 [B]; <= 0 or >= vocab means no top-k cut.
    generator : torch.Generator on the same device, for reproducible sampling (None: global RNG).
    """

    temperatures: torch.Tensor
    top_ps: torch.Tensor
    top_ks: torch.Tensor
    generator: torch.Generator | None = None

    @property
    def is_all_greedy(self) -> bool:
        return bool((self.temperatures <= _GREEDY_EPS).all())

    @classmethod
    def from_params(
        cls, params: list[dict], device: torch.device | str = "cpu", seed: int | None = None
    ) -> SamplingBatchInfo:
        """From SGLang-style dicts: temperature (default 1.0), top_p (1.0), top_k (-1)."""
        temps, top_ps, top_ks = [], [], []
        for i, p in enumerate(params):
            t = float(p.get("temperature", 1.0))
            tp = float(p.get("top_p", 1.0))
            tk = int(p.get("top_k", -1))
            if t < 0:
                raise ValueError(f"request {i}: temperature must be >= 0, got {t}")
            if not 0.0 < tp <= 1.0:
                raise ValueError(f"request {i}: top_p must be in (0, 1], got {tp}")
            temps.append(t)
            top_ps.append(tp)
            top_ks.append(tk)
        gen = None
        if seed is not None:
            gen = torch.Generator(device=device)
            gen.manual_seed(seed)
        return cls(
            torch.tensor(temps, dtype=torch.float32, device=device),
            torch.tensor(top_ps, dtype=torch.float32, device=device),
            torch.tensor(top_ks, dtype=torch.int64, device=device),
            gen,
        )


def top_k_top_p_mask(probs: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor):
    """Zero the probabilities outside each row's top-k and top-p set, then renormalise.

    probs: float32 [B, V]; top_ks: int64 [B]; top_ps: float32 [B]. Returns float32 [B, V].
    """
    V = probs.shape[-1]
    sorted_p, order = probs.sort(dim=-1, descending=True)  # [B, V] each
    rank = torch.arange(V, device=probs.device)[None, :]  # [1, V]
    k = torch.where((top_ks <= 0) | (top_ks > V), V, top_ks)[:, None]  # [B, 1]
    keep = rank < k
    # Top-p: keep the smallest prefix whose mass reaches top_p (the first token always).
    before = sorted_p.cumsum(dim=-1) - sorted_p  # mass strictly before each token
    keep &= (before < top_ps[:, None]) | (rank == 0)
    sorted_p = sorted_p * keep
    out = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    return out / out.sum(dim=-1, keepdim=True)


class Sampler(nn.Module):
    """Pick the next token of each request from its logits."""

    def forward(
        self,
        logits: torch.Tensor,
        sampling_info: SamplingBatchInfo,
        return_logprob: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """logits: float [B, V] -> next ids int64 [B] (and their float32 log-probs [B] under
        the unmodified distribution when return_logprob)."""
        logits = logits.float()
        greedy_ids = logits.argmax(dim=-1)  # [B]
        if sampling_info.is_all_greedy:
            ids = greedy_ids
        else:
            t = sampling_info.temperatures.clamp_min(_GREEDY_EPS)[:, None]  # [B, 1]
            probs = torch.softmax(logits / t, dim=-1)  # [B, V]
            probs = top_k_top_p_mask(probs, sampling_info.top_ks, sampling_info.top_ps)
            sampled = torch.multinomial(probs, 1, generator=sampling_info.generator)[:, 0]
            ids = torch.where(sampling_info.temperatures <= _GREEDY_EPS, greedy_ids, sampled)
        if not return_logprob:
            return ids
        logprobs = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, None])[:, 0]
        return ids, logprobs
