"""Model registry: HF architecture name -> model class, per implementation.

- model_impl "srt" (the default): srt's own model files, architecture -> module, imported
  lazily. Adding a model touches its file and one line here. The module must define
  `EntryClass` (a class or a list of classes whose `__name__` is the architecture).
- model_impl "sglang": classes of SGLang's own model files, registered at run time
  (`register_model_class`; `srt.compat.sglang.register_model_file` imports a file through the
  import remap and registers its EntryClass). They are built the SGLang way:
  `cls(hf_config, quant_config=..., prefix="")` (see `srt.compat.sglang_model`).
"""

from __future__ import annotations

import importlib
import threading

from torch import nn

MODEL_IMPLS = ("srt", "sglang")

_MODELS: dict[str, str] = {
    "LlamaForCausalLM": "srt.models.llama",
    "MistralForCausalLM": "srt.models.llama",
    "Qwen3ForCausalLM": "srt.models.qwen3",
    "GptOssForCausalLM": "srt.models.gpt_oss",
}
# (model_impl, architecture) -> class registered at run time
_REGISTERED: dict[tuple[str, str], type[nn.Module]] = {}
_LOCK = threading.Lock()


def _check_impl(impl: str) -> None:
    if impl not in MODEL_IMPLS:
        raise ValueError(f"model_impl must be one of {MODEL_IMPLS}, got {impl!r}")


def register_model_class(
    cls: type[nn.Module], impl: str = "sglang", architecture: str | None = None
) -> None:
    """Serve `architecture` (default: the class's name) with `cls` under model_impl `impl`; a
    later registration of the same pair replaces the earlier one."""
    _check_impl(impl)
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise TypeError(f"a model class must be an nn.Module subclass, got {cls!r}")
    with _LOCK:
        _REGISTERED[(impl, architecture or cls.__name__)] = cls


def supported_architectures(impl: str = "srt") -> list[str]:
    _check_impl(impl)
    builtin = set(_MODELS) if impl == "srt" else set()
    return sorted(builtin | {arch for i, arch in _REGISTERED if i == impl})


def get_model_class(architecture: str, impl: str = "srt") -> type[nn.Module]:
    """The model class for an HF architecture name under model_impl `impl` (srt's files are
    imported on first use)."""
    _check_impl(impl)
    registered = _REGISTERED.get((impl, architecture))
    if registered is not None:
        return registered
    if impl == "sglang":
        raise ValueError(
            f"no SGLang model file registered for architecture {architecture!r} (registered: "
            f"{supported_architectures('sglang')}); pass the file with --model-file / model_file"
        )
    if architecture not in _MODELS:
        raise ValueError(
            f"unsupported architecture {architecture!r}; supported: {supported_architectures()}"
        )
    module = importlib.import_module(_MODELS[architecture])
    entries = module.EntryClass if isinstance(module.EntryClass, list) else [module.EntryClass]
    for cls in entries:
        if cls.__name__ == architecture:
            return cls
    return entries[0]  # an alias architecture served by the module's main class
