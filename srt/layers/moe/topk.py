"""Top-k routing: router logits -> (routing weights, expert ids) per token."""

from __future__ import annotations

import torch


def select_experts(
    router_logits: torch.Tensor, top_k: int, softmax_after_topk: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick each token's top-k experts and their routing weights.

    Parameters
    ----------
    router_logits : float [T, E]
    top_k : k, the experts per token.
    softmax_after_topk : True (gpt-oss, Mixtral): softmax over the k selected logits. False:
        softmax over all experts, then take the top k (not renormalised).

    Returns
    -------
    (weights float32 [T, k], expert ids int64 [T, k])
    """
    if softmax_after_topk:
        vals, ids = torch.topk(router_logits, top_k, dim=-1)
        return torch.softmax(vals.float(), dim=-1), ids
    probs = torch.softmax(router_logits.float(), dim=-1)
    vals, ids = torch.topk(probs, top_k, dim=-1)
    return vals, ids
