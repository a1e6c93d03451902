"""Model construction for the runner: config (checkpoint, embedded tiny, presets) and weights.

`build_model_config(server_args)` reads the HF config of `model_path`, or the embedded tiny
Llama config when there is none, with `json_model_override_args` merged on top (the bench presets
`llama3-8b` / `qwen3-8b` / `gpt-oss-20b` / `gpt-oss-20b-mxfp4` are such overrides). `build_model`
builds this rank's model and its weights through the loader (checkpoint, or random seeded
weights for "dummy").
"""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any

import torch

from srt.server_args import ServerArgs

logger = logging.getLogger(__name__)

# Llama-3-8B: 32 layers, hidden 4096, 32 q / 8 kv heads, D 128, FFN 14336.
LLAMA3_8B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 128000,
    "eos_token_id": 128001,
}

# gpt-oss-20b: 24 layers, hidden 2880, 64 q / 8 kv heads, D 64, 32 experts (top-4) of FFN 2880,
# sliding window 128 on every other layer, attention sinks, YaRN RoPE.
GPT_OSS_20B: dict[str, Any] = {
    "architectures": ["GptOssForCausalLM"],
    "model_type": "gpt_oss",
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "num_hidden_layers": 24,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "num_local_experts": 32,
    "num_experts_per_tok": 4,
    "experts_per_token": 4,
    "vocab_size": 201088,
    "sliding_window": 128,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 150000.0,
    "rope_scaling": {
        "rope_type": "yarn",
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 4096,
    },
    "attention_bias": True,
    "swiglu_limit": 7.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "eos_token_id": 200002,
}

# Qwen3-8B: 36 layers, hidden 4096, 32 q / 8 kv heads, D 128, FFN 12288, per-head q/k RMSNorm.
QWEN3_8B: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "attention_bias": False,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}

# gpt-oss-20b as released: MXFP4 experts (packed on CUDA, random valid scales as dummy weights).
GPT_OSS_20B_MXFP4: dict[str, Any] = {
    **GPT_OSS_20B,
    "quantization_config": {"quant_method": "mxfp4"},
}

PRESETS: dict[str, dict[str, Any]] = {
    "llama3-8b": LLAMA3_8B,
    "qwen3-8b": QWEN3_8B,
    "gpt-oss-20b": GPT_OSS_20B,
    "gpt-oss-20b-mxfp4": GPT_OSS_20B_MXFP4,
}


def preset_overrides(name: str) -> str:
    """json_model_override_args that turn the embedded config into a preset's shape."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose from {sorted(PRESETS)}")
    return json.dumps(PRESETS[name])


def tiny_config_dict() -> dict[str, Any]:
    """The embedded tiny Llama config (srt/configs/tiny.py), a fresh copy."""
    from srt.configs.tiny import tiny_llama_config

    return tiny_llama_config()


def build_model_config(args: ServerArgs) -> Any:
    """ModelConfig of the checkpoint (or the tiny config) with the JSON overrides applied."""
    from srt.configs.model_config import ModelConfig, read_config_json
    from srt.model_loader.hub import resolve_model_path

    overrides = args.model_overrides
    if args.model_path is None:
        cfg = tiny_config_dict()
        if overrides.get("architectures") not in (None, cfg["architectures"]):
            cfg = {}  # a preset replaces the tiny config rather than patching it
        return ModelConfig.from_hf({**cfg, **overrides})
    path = resolve_model_path(args.model_path)  # a local directory, or a Hub id's snapshot
    if not overrides:
        return ModelConfig.from_hf(path)
    cfg = {**read_config_json(path), **overrides}
    return ModelConfig.from_hf(cfg, path=path)


def build_model(
    model_config: Any,
    args: ServerArgs,
    dtype: torch.dtype,
    device: torch.device,
    tp_rank: int = 0,
    tp_size: int = 1,
) -> torch.nn.Module:
    """The registry's model class in `dtype` on `device` (this rank's TP shard), with checkpoint
    or dummy weights (`srt.model_loader.loader.get_model`). With model_impl "sglang" the class
    comes from SGLang's model file `args.model_file` (`srt.compat.sglang.register_model_file`).

    Dummy weights are the loader's seeded CPU-generated ones (identical on every device), except
    for big models on CUDA (the bench presets), which are drawn on the device: generating
    billions of numbers on the CPU would dominate the benchmark's start-up.

    Before allocating anything it logs what it loads (path, parameters, dtype, device) and
    raises `NotEnoughMemoryError` (a ValueError) when the weights cannot fit in the device's
    available memory.
    """
    from srt.model_loader.loader import get_model
    from srt.model_loader.weight_memory import check_weight_memory, describe_load, weight_footprint

    config = dataclasses.replace(model_config, dtype=dtype)
    load_format = "dummy" if args.model_path is None else args.load_format
    if args.model_impl == "sglang":  # SGLang's own model file: import it, register its classes
        from srt.compat.sglang import register_model_file

        assert args.model_file is not None  # ServerArgs checks
        register_model_file(args.model_file)
    footprint = weight_footprint(config, dtype, args.tp_size, args.model_impl)
    what = config.path or (
        f"a {config.num_hidden_layers}-layer, {config.hidden_size}-wide model (no checkpoint)"
    )
    logger.info(describe_load(what, config.architecture, footprint, device, load_format))
    check_weight_memory(footprint, device, what)
    on_device = device.type == "cuda" and _num_params(config) >= 2e8
    return get_model(
        config,
        load_format,
        device,
        args.random_seed,
        tp_rank,
        tp_size,
        dummy_on_device=on_device,
        model_impl=args.model_impl,
    )


def _num_params(cfg: Any) -> float:
    """Rough parameter count (embeddings + attention + MLP or experts) to pick the init path."""
    h, layers = cfg.hidden_size, cfg.num_hidden_layers
    attn = h * cfg.head_dim * (2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads)
    mlp = 3 * h * cfg.intermediate_size * max(1, cfg.num_local_experts)
    return 2.0 * cfg.vocab_size * h + layers * (attn + mlp)


def kv_cache_shape(model_config: Any, tp_size: int = 1) -> tuple[int, int, int, int]:
    """(num_layers, num_kv_heads, head_dim, v_head_dim) of one TP rank's KV cache (its local KV
    heads: total / tp, at least 1 when tp exceeds them and they are replicated)."""
    layers = int(model_config.num_hidden_layers)
    heads = max(1, int(model_config.num_key_value_heads) // tp_size)
    head_dim = int(model_config.head_dim)
    v_head_dim = int(getattr(model_config, "v_head_dim", None) or head_dim)
    return layers, heads, head_dim, v_head_dim
