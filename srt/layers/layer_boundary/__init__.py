"""Stage boundaries of SGLang's decoder layers (see `stage.py`)."""

from srt.layers.layer_boundary.residual.add_norm import NORM_QUANT_READOUT, PLAIN_ADD
from srt.layers.layer_boundary.stage import (
    StageBoundary,
    StageFacts,
    append_stages,
    declare_attn,
    declare_ffn,
)

__all__ = [
    "NORM_QUANT_READOUT",
    "PLAIN_ADD",
    "StageBoundary",
    "StageFacts",
    "append_stages",
    "declare_attn",
    "declare_ffn",
]
