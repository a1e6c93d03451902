"""Sampler: next tokens from the last-position logits of a batch (greedy or sampled)."""

from __future__ import annotations

import torch

from sgl_ext.launch import interpreting
from srt.mem_cache.host_copy import upload
from srt.sampling.greedy import gumbel_max
from srt.sampling.sampling_params import SamplingParams


def step_seed(seed: int, draw: int) -> int:
    """The Philox seed of a request's draw number `draw` (splitmix64 of both, 53 bits: exact
    through `sample`'s float64 upload)."""
    z = (seed * 0x9E3779B97F4A7C15 + draw * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) % 2**64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
    return (z ^ (z >> 31)) >> 11


def _filters(p: SamplingParams, vocab: int) -> bool:
    """Whether top_k, top_p or min_p can drop a token of a vocab-sized distribution."""
    return 0 < p.top_k < vocab or p.top_p < 1.0 or p.min_p > 0.0


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    return_logprob: bool = False,
    seeds: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Pick one token per row.

    Greedy rows take the argmax. Sampled rows divide by their temperature and draw with the
    row's own generator, so a seeded request gets the same tokens whatever batch it runs in:
    rows with top_k, top_p or min_p from the sorted, cut and renormalised distribution, rows
    with none of them from the whole distribution (no sort of the vocabulary).

    Parameters
    ----------
    logits : float [B, V], any device. Not modified.
    params : B SamplingParams.
    generators : B generators on logits' device (None: torch's default generator).
    return_logprob : also return the log-probability of each chosen token under the raw
        (temperature 1, unfiltered) distribution, float32 [B].
    seeds : B ints in [0, 2**53), or None. Given, the temperature-only rows draw in one launch
        (`greedy.gumbel_max`, on CUDA or under TRITON_INTERPRET) from Philox noise at their
        seed, not from their generator: the caller passes a new seed per row and step.

    Returns
    -------
    (next_token_ids int64 [B], logprobs float32 [B] or None)
    """
    bs = logits.shape[0]
    if len(params) != bs or len(generators) != bs:
        raise ValueError(f"need {bs} params and generators, got {len(params)}, {len(generators)}")
    dev = logits.device
    logits = logits.float()  # [B, V]
    next_ids = torch.argmax(logits, dim=-1)  # [B] int64
    # sampled rows: temperature only first (drawn from the whole distribution: no sort), then
    # those with a top_k / top_p / min_p filter (sorted, cut, drawn in sorted order)
    vocab = logits.shape[1]
    plain = [i for i, p in enumerate(params) if not p.is_greedy and not _filters(p, vocab)]
    cut = [i for i, p in enumerate(params) if not p.is_greedy and _filters(p, vocab)]
    if seeds is not None and (len(seeds) != bs or not all(0 <= x < 2**53 for x in seeds)):
        raise ValueError(f"need {bs} seeds in [0, 2**53), got {seeds}")
    if plain and seeds is not None and (dev.type == "cuda" or interpreting()):
        cfg = upload(
            torch.tensor(
                [plain, [params[i].temperature for i in plain], [seeds[i] for i in plain]],
                dtype=torch.float64,
            ),
            dev,
        )  # [3, P], exact in float64 (seeds < 2**53)
        rows_p = cfg[0].long()
        picked = gumbel_max(logits, rows_p, cfg[1].float(), cfg[2].long())
        next_ids.index_copy_(0, rows_p, picked)
        plain = []
    rows = plain + cut
    if rows:
        # the rows' settings in one upload through pinned memory: no host wait for the device
        # (the overlapped decode samples step N while step N - 1 may still run)
        ps = [params[i] for i in cut]
        cfg = upload(
            torch.tensor(
                rows
                + [params[i].temperature for i in rows]
                + [p.top_k if p.top_k > 0 else vocab for p in ps]
                + [p.top_p for p in ps]
                + [p.min_p for p in ps],
                dtype=torch.float64,  # exact for indices, top_k and the float settings
            ),
            dev,
        )  # [2 R + 3 C]
        r, c = len(rows), len(cut)
        idx = cfg[:r].long()  # [R]
        temps = cfg[r : 2 * r].float()  # [R]
        scaled = logits.index_select(0, idx) / temps[:, None]  # [R, V]
        picks = []  # [1] token id per row, in `rows` order
        if plain:
            probs = scaled[: len(plain)].softmax(dim=-1)  # [P, V]
            for j, i in enumerate(plain):
                picks.append(torch.multinomial(probs[j], 1, generator=generators[i]))
        if cut:
            top_k = cfg[2 * r : 2 * r + c].long()  # [C] each
            top_p, min_p = cfg[2 * r + c :].float().view(2, c)
            sorted_logits, sorted_ids = scaled[len(plain) :].sort(dim=-1, descending=True)
            probs = sorted_logits.softmax(dim=-1)  # [C, V], descending
            rank = torch.arange(vocab, device=dev)[None, :]  # [1, V]
            drop = rank >= top_k[:, None]  # [C, V]
            drop |= (probs.cumsum(dim=-1) - probs) >= top_p[:, None]  # mass before this token
            drop |= probs < min_p[:, None] * probs[:, :1]
            drop[:, 0] = False  # the most likely token always survives
            probs = probs.masked_fill(drop, 0.0)
            for j, i in enumerate(cut):  # index in sorted order, then the token
                pick = torch.multinomial(probs[j], 1, generator=generators[i])  # [1]
                picks.append(sorted_ids[j].gather(0, pick))
        next_ids.index_copy_(0, idx, torch.cat(picks))
    logprobs = None
    if return_logprob:
        logprobs = torch.log_softmax(logits, dim=-1).gather(1, next_ids[:, None]).squeeze(1)
    return next_ids, logprobs
