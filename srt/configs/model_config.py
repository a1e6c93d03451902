"""ModelConfig: one frozen description of a model, with every Hugging Face config quirk resolved.

Model files read only this (never the raw config.json), so HF differences between versions and
families live here: head_dim defaults, rope_theta / rope_scaling (transformers 4.x) vs
rope_parameters (5.x), legacy rope "type" keys, partial_rotary_factor, sliding windows given as
layer_types / use_sliding_window / a bare sliding_window, MoE field names, tied embeddings,
dtype / torch_dtype.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}
FULL, SLIDING = "full_attention", "sliding_attention"
_POSITIVE_INTS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
    "max_position_embeddings",
)


def checkpoint_dtype(dtype: str | torch.dtype, config_dtype: object = None) -> torch.dtype:
    """The torch dtype named by `dtype`; "auto" takes the checkpoint's `config_dtype` (bfloat16
    when it names none). The runner's device-aware "auto" is `model_runner.runtime_dtype`."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype must be float32, float16 or bfloat16, got {dtype}")
        return dtype
    if dtype == "auto":
        if config_dtype is None:
            return torch.bfloat16
        return checkpoint_dtype(str(config_dtype).replace("torch.", ""))
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {dtype!r}")
    return _DTYPES[dtype]


def read_config_json(path: str) -> dict[str, Any]:
    """config.json of a checkpoint directory (or a .json file path) as a dict."""
    is_file = path.endswith(".json") and not os.path.isdir(path)
    file = path if is_file else os.path.join(path, "config.json")
    if not os.path.isfile(file):
        raise FileNotFoundError(f"model config not found: {file}")
    try:
        with open(file, encoding="utf-8") as f:
            cfg = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"malformed model config {file}: {e}") from e
    if not isinstance(cfg, dict):
        raise ValueError(f"malformed model config {file}: top level is not an object")
    return cfg


def _rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None, float]:
    """(rope_theta, rope_scaling with a 'rope_type' key or None, partial_rotary_factor)."""
    params = dict(cfg.get("rope_parameters") or {})
    if params and all(isinstance(v, dict) for v in params.values()):  # per-layer-type params
        params = dict(params.get(FULL) or next(iter(params.values())))
    legacy = dict(cfg.get("rope_scaling") or {})
    theta = params.pop("rope_theta", None) or cfg.get("rope_theta") or 10000.0
    partial = params.pop("partial_rotary_factor", None) or cfg.get("partial_rotary_factor") or 1.0
    scaling = {**legacy, **params}
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    scaling.pop("type", None)
    if scaling.get("rope_type") == "su":
        scaling["rope_type"] = "longrope"
    if not scaling or scaling.get("rope_type", "default") == "default":
        return float(theta), None, float(partial)
    return float(theta), scaling, float(partial)


def _layer_types(cfg: dict[str, Any], n: int) -> tuple[str, ...]:
    window = cfg.get("sliding_window")
    types = cfg.get("layer_types")
    if types is not None:
        if len(types) < n:
            raise ValueError(f"layer_types has {len(types)} entries for {n} layers")
        types = tuple(types[:n])
    elif cfg.get("model_type") == "gpt_oss":  # HF default: even layers slide
        types = tuple(SLIDING if (i + 1) % 2 else FULL for i in range(n))
    elif "use_sliding_window" in cfg:  # Qwen2/3 style
        start = cfg.get("max_window_layers", 0) or 0
        on = bool(cfg["use_sliding_window"])
        types = tuple(SLIDING if on and i >= start else FULL for i in range(n))
    else:  # Mistral style: a bare sliding_window applies to every layer
        types = tuple(SLIDING if window else FULL for _ in range(n))
    if SLIDING in types and not window:
        types = tuple(FULL for _ in types)
    return types


@dataclass(frozen=True)
class ModelConfig:
    """Resolved model hyper-parameters (SGLang-like names). Build with `ModelConfig.from_hf`."""

    architectures: tuple[str, ...]
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    dtype: torch.dtype
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    partial_rotary_factor: float = 1.0
    rope_is_neox_style: bool = True
    attention_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    num_local_experts: int = 0
    num_experts_per_tok: int = 0
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    final_logit_softcapping: float | None = None
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    quantization_config: dict[str, Any] | None = None
    path: str | None = None
    hf_config: MappingProxyType = field(
        default_factory=lambda: MappingProxyType({}), repr=False, compare=False
    )

    def __post_init__(self) -> None:
        """Reject values no model can run with (a config.json or json_model_override_args
        typo), naming the field, before any weight is built."""
        for name in _POSITIVE_INTS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"model config {name} must be an int >= 1, got {value!r}")
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"model config {name} must be a number, got {value!r}")
            if not math.isfinite(value) or value <= 0:
                raise ValueError(f"model config {name} must be finite and > 0, got {value!r}")
        if not 0.0 < self.partial_rotary_factor <= 1.0:
            raise ValueError(
                f"model config partial_rotary_factor must be in (0, 1], "
                f"got {self.partial_rotary_factor!r}"
            )
        if self.rotary_dim < 2 or self.rotary_dim % 2:
            raise ValueError(
                f"model config rotary dim (head_dim {self.head_dim} x partial_rotary_factor "
                f"{self.partial_rotary_factor}) must be even and >= 2, got {self.rotary_dim}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"model config num_attention_heads ({self.num_attention_heads}) must be a "
                f"multiple of num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.sliding_window is not None and (
            isinstance(self.sliding_window, bool)
            or not isinstance(self.sliding_window, int)
            or self.sliding_window < 1
        ):
            raise ValueError(
                f"model config sliding_window must be an int >= 1 or null, "
                f"got {self.sliding_window!r}"
            )
        experts, top_k = self.num_local_experts, self.num_experts_per_tok
        if experts < 0 or top_k < 0 or (experts > 0 and top_k > experts):
            raise ValueError(
                f"model config num_experts_per_tok ({top_k}) must be in "
                f"[0, num_local_experts={experts}]"
            )
        if len(self.layer_types) not in (0, self.num_hidden_layers):
            raise ValueError(
                f"model config has {len(self.layer_types)} layer_types for "
                f"{self.num_hidden_layers} layers"
            )

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def architecture(self) -> str:
        return self.architectures[0]

    def get_window_left(self, layer_id: int) -> int:
        """RadixAttention's sliding_window_size for a layer: HF's window - 1, or -1 (full)."""
        if self.sliding_window and self.layer_types[layer_id] == SLIDING:
            return int(self.sliding_window) - 1
        return -1

    @classmethod
    def from_hf(
        cls,
        path_or_dict: str | os.PathLike | dict[str, Any],
        dtype: str | torch.dtype = "auto",
        architecture: str | None = None,
        **overrides: Any,
    ) -> ModelConfig:
        """Read an HF config.json (directory, file, or already-parsed dict).

        Parameters
        ----------
        path_or_dict : checkpoint directory, config.json path, or the config dict.
        dtype : "auto" (checkpoint dtype; bfloat16 if it names none), "float32", "bfloat16",
            "float16" or a torch.dtype.
        architecture : override `architectures[0]` (needed when the config names none).
        **overrides : replace any resolved field (e.g. max_position_embeddings=4096).
        """
        path = None
        if isinstance(path_or_dict, dict):
            cfg = dict(path_or_dict)
        else:
            path = os.fspath(path_or_dict)
            cfg = read_config_json(path)
            if not os.path.isdir(path):
                path = os.path.dirname(path) or "."
        if "text_config" in cfg and "hidden_size" not in cfg:  # multimodal wrapper
            cfg = {**cfg["text_config"], "architectures": cfg.get("architectures")}
        archs = tuple(cfg.get("architectures") or ())
        if architecture is not None:
            archs = (architecture,)
        if not archs:
            raise ValueError("config has no 'architectures'; pass architecture=...")
        missing = [
            k
            for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
            if k not in cfg
        ]
        if missing:
            raise ValueError(f"model config{' ' + path if path else ''} lacks {missing}")
        heads = int(cfg["num_attention_heads"])
        n_layers = int(cfg["num_hidden_layers"])
        theta, scaling, partial = _rope(cfg)
        eos = cfg.get("eos_token_id")
        eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (int(eos),)
        experts = cfg.get("num_local_experts") or cfg.get("num_experts") or 0
        kw: dict[str, Any] = dict(
            architectures=archs,
            model_type=str(cfg.get("model_type", "")),
            hidden_size=int(cfg["hidden_size"]),
            num_hidden_layers=n_layers,
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
            intermediate_size=int(cfg.get("intermediate_size") or 4 * cfg["hidden_size"]),
            vocab_size=int(cfg["vocab_size"]),
            max_position_embeddings=int(cfg.get("max_position_embeddings") or 2048),
            rms_norm_eps=float(cfg.get("rms_norm_eps") or 1e-6),
            dtype=checkpoint_dtype(dtype, cfg.get("dtype") or cfg.get("torch_dtype")),
            rope_theta=theta,
            rope_scaling=scaling,
            partial_rotary_factor=partial,
            attention_bias=bool(cfg.get("attention_bias", cfg.get("bias", False))),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            sliding_window=cfg.get("sliding_window"),
            layer_types=_layer_types(cfg, n_layers),
            num_local_experts=int(experts),
            num_experts_per_tok=int(
                cfg.get("num_experts_per_tok") or cfg.get("experts_per_token") or 0
            ),
            swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
            swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
            final_logit_softcapping=cfg.get("final_logit_softcapping"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=eos,
            quantization_config=cfg.get("quantization_config"),
            path=path,
            hf_config=MappingProxyType(cfg),
        )
        if not any(t == SLIDING for t in kw["layer_types"]):
            kw["sliding_window"] = None
        unknown = set(overrides) - set(kw)
        if unknown:
            raise TypeError(f"unknown ModelConfig fields: {sorted(unknown)}")
        kw.update(overrides)
        return cls(**kw)
