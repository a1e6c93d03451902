"""Model registry: HF architecture name -> model module, imported lazily.

Adding a model touches its file and one line here. The module must define `EntryClass` (a class
or a list of classes whose `__name__` is the architecture).
"""

from __future__ import annotations

import importlib

from torch import nn

_MODELS: dict[str, str] = {
    "LlamaForCausalLM": "srt.models.llama",
    "MistralForCausalLM": "srt.models.llama",
    "Qwen3ForCausalLM": "srt.models.qwen3",
    "GptOssForCausalLM": "srt.models.gpt_oss",
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(architecture: str) -> type[nn.Module]:
    """The model class for an HF architecture name (imports its module on first use)."""
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
