"""Weight-loading helpers shared by the model files' `load_weights`.

A checkpoint names separate q/k/v and gate/up projections; the models pack them. The mapping
(param_suffix, checkpoint_suffix, shard_id) routes each checkpoint tensor to the packed
parameter's `weight_loader` with its shard id.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

# (packed parameter name part, checkpoint name part, shard id), as in SGLang's models.
StackedParams = tuple[tuple[str, str, str | int], ...]
QKV_STACKED_PARAMS: StackedParams = (
    (".qkv_proj", ".q_proj", "q"),
    (".qkv_proj", ".k_proj", "k"),
    (".qkv_proj", ".v_proj", "v"),
)
LLAMA_STACKED_PARAMS: StackedParams = (
    *QKV_STACKED_PARAMS,
    (".gate_up_proj", ".gate_proj", 0),
    (".gate_up_proj", ".up_proj", 1),
)


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor, shard_id=None):
    """Copy a whole tensor into a parameter of the same shape (one element into one: any
    shapes, as SGLang's loader allows)."""
    if param.numel() == 1 and loaded_weight.numel() == 1:
        param.data.fill_(loaded_weight.item())
        return
    if param.shape != loaded_weight.shape:
        raise ValueError(
            f"checkpoint tensor shape {tuple(loaded_weight.shape)} != parameter shape "
            f"{tuple(param.shape)}"
        )
    param.data.copy_(loaded_weight)


def load_stacked_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    stacked_params: StackedParams = LLAMA_STACKED_PARAMS,
    skip_substrings: tuple[str, ...] = (
        "rotary_emb.inv_freq",
        "rotary_emb.cos_cached",
        "rotary_emb.sin_cached",
    ),
) -> set[str]:
    """Load (name, tensor) pairs into model parameters; returns the names of loaded params
    (a packed parameter only when all its shards were loaded).

    Parameters
    ----------
    model : the ForCausalLM module.
    weights : iterable of (checkpoint name, tensor) (any dtype/device; copied in place).
    stacked_params : packed-parameter mapping.
    skip_substrings : checkpoint tensors to ignore.
    """
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    expected: dict[str, set] = {}  # packed part -> the shard ids that complete it
    for packed, _, shard_id in stacked_params:
        expected.setdefault(packed, set()).add(shard_id)
    got: dict[tuple[str, str], set] = {}  # (param name, packed part) -> shard ids loaded
    for name, tensor in weights:
        if any(s in name for s in skip_substrings):
            continue
        for packed, part, shard_id in stacked_params:
            if part not in name:
                continue
            pname = name.replace(part, packed)
            if pname not in params:
                continue
            p = params[pname]
            _call_loader(pname, p, tensor, shard_id)
            got.setdefault((pname, packed), set()).add(shard_id)
            break
        else:
            if name not in params:
                raise KeyError(f"checkpoint tensor {name!r} matches no model parameter")
            p = params[name]
            _call_loader(name, p, tensor, None)
            loaded.add(name)
    # A packed parameter counts as loaded only once every shard arrived.
    loaded |= {name for (name, packed), ids in got.items() if ids >= expected[packed]}
    return loaded


def _call_loader(name: str, p: torch.Tensor, tensor: torch.Tensor, shard_id) -> None:
    loader = getattr(p, "weight_loader", None)
    try:
        if loader is None:
            default_weight_loader(p, tensor)
        elif shard_id is None:
            loader(p, tensor)
        else:
            loader(p, tensor, shard_id)
    except ValueError as e:
        raise ValueError(f"loading {name}: {e}") from e
