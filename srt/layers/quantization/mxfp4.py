"""Mxfp4Config: gpt-oss's released checkpoint format, MXFP4 experts and everything else in the
model dtype (SGLang's `Mxfp4Config`). The experts (`FusedMoE`) keep the packed weights; the
dequantisation itself is `srt.layers.mxfp4`."""

from __future__ import annotations

from typing import Any

from srt.layers.quantization.base_config import QuantizationConfig


class Mxfp4Config(QuantizationConfig):
    """MXFP4 routed experts; linear, embedding and attention layers unquantized.

    Parameters
    ----------
    ignored_layers : the checkpoint's `modules_to_not_convert` (kept for reference: only the
        experts are ever quantized).
    """

    def __init__(self, ignored_layers: list[str] | None = None) -> None:
        self.ignored_layers = list(ignored_layers or [])

    @classmethod
    def get_name(cls) -> str:
        return "mxfp4"

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Mxfp4Config:
        return cls(config.get("modules_to_not_convert"))

    def quantizes(self, kind: str, prefix: str = "") -> bool:
        return kind == "moe"
