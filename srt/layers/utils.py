"""Layer helpers SGLang's model files import (`sglang.srt.layers.utils`)."""

from __future__ import annotations

import re
from typing import Any

from torch import nn

_LAYER_ID = re.compile(r"layers\.(\d+)\.")


def get_layer_id(weight_name: str) -> int | None:
    """The decoder-layer index in a weight name ("model.layers.10.mlp..." -> 10), or None."""
    match = _LAYER_ID.search(weight_name)
    return int(match.group(1)) if match else None


class PPMissingLayer(nn.Identity):
    """Placeholder for a layer another pipeline stage holds: returns its first input (as a
    1-tuple with return_tuple=True). srt runs one stage, so model files build it only for
    branches they never take."""

    def __init__(self, *args: Any, return_tuple: bool = False, **kwargs: Any) -> None:
        super().__init__()
        self.return_tuple = return_tuple

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        value = args[0] if args else next(iter(kwargs.values()))
        return (value,) if self.return_tuple else value
