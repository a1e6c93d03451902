"""Residual updates and reads of a stage (SGLang's `residual.add_norm` tags).

srt's stages always update with the plain add and read through the plain norm; SGLang's tag
for a norm fused with an fp8 input quantisation names the same read here (no quantized
linear layers)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ResidualOp:
    name: str


PLAIN_ADD = ResidualOp("plain_add")
NORM_QUANT_READOUT = ResidualOp("norm_quant_readout")
