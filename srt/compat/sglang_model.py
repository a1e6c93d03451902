"""Build, load and watch a model class from one of SGLang's own model files (model_impl "sglang").

SGLang's files are built as SGLang builds them: `cls(hf_config, quant_config=...)`, where
hf_config is the checkpoint's transformers config (dtype set to the runtime dtype) and
quant_config the checkpoint's quantization config (None, or MXFP4 for gpt-oss; another method
raises here, naming it). What srt lacks is refused at build time: tensor parallelism > 1 for
these files (their layers would need the TP group at construction; srt's layers take their rank
explicitly), and whatever a layer is asked for and cannot serve (pipeline stages, DP attention,
LoRA, EPLB, quantized linears: each raises in that layer).

Their `load_weights` returns nothing, so `load_sglang_weights` tracks which parameters it
filled: every weight loader is watched while it runs, and floating parameters are primed with
NaN, which catches the ones a file copies into directly (gpt-oss's sinks).

`count_rope_calls(model)` counts the calls of the model's RotaryEmbedding modules, with and
without a FusedSetKVBufferArg: how many of the file's RoPE calls went through srt's fused
RoPE + KV-cache write.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from srt.configs.model_config import ModelConfig
from srt.layers.quantization import get_quantization_config
from srt.layers.rotary_embedding import RotaryEmbedding
from srt.models.weight_utils import default_weight_loader


def hf_config(config: ModelConfig, dtype: torch.dtype | None = None) -> Any:
    """The transformers config SGLang's model files read: the checkpoint's config.json (with
    srt's overrides, as ModelConfig.hf_config holds it) as its transformers class (a plain
    PretrainedConfig for a model type transformers does not know), dtype = the model dtype."""
    import transformers

    raw = dict(config.hf_config) or {}
    raw.pop("torch_dtype", None)
    raw.pop("dtype", None)
    raw.setdefault("architectures", list(config.architectures))
    model_type = raw.pop("model_type", None) or config.model_type
    try:
        hf = transformers.AutoConfig.for_model(model_type, **raw)
    except ValueError:  # a model type transformers does not know
        hf = transformers.PretrainedConfig(**raw)
        hf.model_type = model_type  # type: ignore[misc]
    hf.dtype = dtype or config.dtype
    return hf


def build_sglang_model(
    cls: type[nn.Module], config: ModelConfig, tp_rank: int = 0, tp_size: int = 1
) -> nn.Module:
    """`cls(hf_config, quant_config=...)` in the current default dtype and device.

    Raises NotImplementedError for tp_size > 1 and ValueError for a quantization method srt
    does not serve, before anything is built.
    """
    if tp_size != 1:
        raise NotImplementedError(
            f"tensor parallelism (tp_size={tp_size}) with SGLang model files is not supported; "
            "use srt's own model file (model_impl 'srt') or tp_size 1"
        )
    quant_config = get_quantization_config(config.quantization_config)
    return cls(hf_config(config, torch.get_default_dtype()), quant_config=quant_config)


@contextlib.contextmanager
def _watch_loaders(model: nn.Module, loaded: set[str]) -> Iterator[None]:
    """Every parameter's weight_loader (SGLang's default where it has none) records the
    parameter's name in `loaded` when called; restored afterwards."""
    params = dict(model.named_parameters())
    names = {id(p): n for n, p in params.items()}
    saved: dict[str, Callable[..., Any] | None] = {}

    def watch(loader: Callable[..., Any]) -> Callable[..., Any]:
        def watched(param: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            loaded.add(names[id(param)])
            return loader(param, *args, **kwargs)

        return watched

    for name, p in params.items():
        saved[name] = getattr(p, "weight_loader", None)
        p.weight_loader = watch(saved[name] or default_weight_loader)  # type: ignore[attr-defined]
    try:
        yield
    finally:
        for name, p in params.items():
            if saved[name] is None:
                del p.weight_loader  # type: ignore[attr-defined]
            else:
                p.weight_loader = saved[name]  # type: ignore[attr-defined]


def load_sglang_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
    """Run the SGLang file's `model.load_weights(weights)`; returns the names of the
    parameters it filled (through a weight loader, or by a direct copy into a NaN-primed
    floating parameter)."""
    loaded: set[str] = set()
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point():
                p.fill_(float("nan"))
        with _watch_loaders(model, loaded):
            model.load_weights(weights)  # type: ignore[operator]
        for name, p in model.named_parameters():
            if name not in loaded and p.is_floating_point() and not bool(p.isnan().any()):
                loaded.add(name)
    return loaded


@dataclass
class RopeCallCount:
    """Calls of a model's RotaryEmbedding modules: with a FusedSetKVBufferArg (RoPE also wrote
    K and V into the cache) and without."""

    fused: int = 0
    unfused: int = 0

    @property
    def total(self) -> int:
        return self.fused + self.unfused

    def describe(self) -> str:
        return f"{self.fused} of {self.total} RoPE calls fused with the KV-cache write"


@contextlib.contextmanager
def count_rope_calls(model: nn.Module) -> Iterator[RopeCallCount]:
    """Count the model's RoPE calls while the context is open (forward pre-hooks on its
    RotaryEmbedding modules; eager forwards only: a CUDA-graph replay runs no Python)."""
    counts = RopeCallCount()

    def hook(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        arg = kwargs.get("fused_set_kv_buffer_arg", args[4] if len(args) > 4 else None)
        if arg is None:
            counts.unfused += 1
        else:
            counts.fused += 1

    ropes = {id(m): m for m in model.modules() if isinstance(m, RotaryEmbedding)}
    handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in ropes.values()]
    try:
        yield counts
    finally:
        for h in handles:
            h.remove()
