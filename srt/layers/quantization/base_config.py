"""QuantizationConfig: what a checkpoint's `quantization_config` asks of each layer (SGLang's base
class, reduced to the one question srt's layers need answered).

SGLang's layers take `quant_config=` and build a quantized method from it. srt's layers take it
too and ask: does this config quantize a layer of this kind? Where it does and srt has no kernel
for that, the layer raises at build time, naming the method, so a model never runs with weights
it silently misreads. Configs: None (unquantized) and `Mxfp4Config` (gpt-oss: MXFP4 experts, every
other layer unquantized).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

# Layer kinds a config is asked about.
LAYER_KINDS = ("linear", "embedding", "attention", "moe")


class QuantizationConfig(ABC):
    """A checkpoint's quantization scheme (SGLang's `QuantizationConfig` interface)."""

    @classmethod
    @abstractmethod
    def get_name(cls) -> str:
        """The method's name as written in `quantization_config.quant_method`."""

    @classmethod
    @abstractmethod
    def from_config(cls, config: dict[str, Any]) -> QuantizationConfig:
        """Build from the checkpoint's `quantization_config` dict."""

    @abstractmethod
    def quantizes(self, kind: str, prefix: str = "") -> bool:
        """Whether the layer of this kind (one of LAYER_KINDS) named `prefix` holds quantized
        weights under this config."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def require_unquantized(quant_config: QuantizationConfig | None, kind: str, prefix: str) -> None:
    """Raise, at build time, when `quant_config` quantizes this layer: srt serves that layer kind
    only unquantized.

    Parameters
    ----------
    quant_config : None or a QuantizationConfig.
    kind : one of LAYER_KINDS.
    prefix : the layer's name in the model (for the message).
    """
    if kind not in LAYER_KINDS:
        raise ValueError(f"kind must be one of {LAYER_KINDS}, got {kind!r}")
    if quant_config is None:
        return
    if not isinstance(quant_config, QuantizationConfig):
        raise TypeError(
            f"quant_config must be a QuantizationConfig or None, got {type(quant_config).__name__}"
        )
    if quant_config.quantizes(kind, prefix):
        raise NotImplementedError(
            f"quantization method {quant_config.get_name()!r} on {kind} layers is not supported "
            f"(layer {prefix or '<unnamed>'}): srt runs these layers unquantized only"
        )
