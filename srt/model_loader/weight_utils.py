"""Weight-loading helpers SGLang's model files import (`sglang.srt.model_loader.weight_utils`).

`default_weight_loader` is the one srt's own models use (`srt.models.weight_utils`); the
others cover names SGLang's `load_weights` read: fp8 KV-scale names in a checkpoint, a KV-scale
JSON file, the RL-reload marker.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from srt.models.weight_utils import default_weight_loader

logger = logging.getLogger(__name__)

# SGLang marks tensors its RunAI streamer yields with this attribute; srt's loader has no
# streamer, so no tensor carries it.
RUNAI_STREAMER_TENSOR_ATTR = "_sglang_runai_streamer_tensor"

F = TypeVar("F", bound=Callable[..., Any])
__all__ = [
    "RUNAI_STREAMER_TENSOR_ATTR",
    "default_weight_loader",
    "kv_cache_scales_loader",
    "maybe_remap_kv_scale_name",
    "supports_quantized_rl_reload",
]

# checkpoint spellings of a layer's fp8 KV-cache scales -> the attention layer's name
_KV_SCALE_SUFFIXES = (
    (".self_attn.k_proj.k_scale", ".self_attn.attn.k_scale"),
    (".self_attn.v_proj.v_scale", ".self_attn.attn.v_scale"),
    (".self_attn.k_scale", ".self_attn.attn.k_scale"),
    (".self_attn.v_scale", ".self_attn.attn.v_scale"),
    (".kv_scale", ".attn.k_scale"),
)


def maybe_remap_kv_scale_name(name: str, params_dict: dict[str, Any]) -> str | None:
    """A checkpoint tensor name, with fp8 KV-scale spellings mapped to the attention layer's;
    None when it names a KV scale the model has no parameter for (srt keeps KV scales on the
    RadixAttention, not as parameters, so such tensors are skipped)."""
    for suffix, ours in _KV_SCALE_SUFFIXES:
        if name.endswith(suffix):
            remapped = name[: -len(suffix)] + ours
            return remapped if remapped in params_dict else None
    return name


def kv_cache_scales_loader(
    filename: str, tp_rank: int, tp_size: int, num_hidden_layers: int, model_type: str | None
) -> Iterable[tuple[int, float]]:
    """(layer, scale) pairs of a KV-scale JSON file ({"kv_cache": {"scaling_factor": {tp_rank:
    {layer: scale}}}}); nothing (logged) when the file is missing or malformed."""
    try:
        with open(filename, encoding="utf-8") as f:
            table = json.load(f)["kv_cache"]["scaling_factor"][str(tp_rank)]
        pairs = [(int(layer), float(scale)) for layer, scale in table.items()]
    except (OSError, ValueError, KeyError, TypeError) as e:
        logger.error("cannot read KV-cache scales from %s: %s", filename, e)
        return []
    bad = [layer for layer, _ in pairs if not 0 <= layer < num_hidden_layers]
    if bad:
        logger.error("KV-cache scales in %s name layers %s of %d", filename, bad, num_hidden_layers)
        return []
    return pairs


def supports_quantized_rl_reload(func: F) -> F:
    """SGLang's marker for load_weights that its quantized RL reload may wrap; srt has no such
    reload, so the function is returned as it is (marked)."""
    func._supports_quantized_rl_reload = func  # type: ignore[attr-defined]
    return func
