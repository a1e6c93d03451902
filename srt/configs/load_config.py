"""How weights are loaded: the `load_format` names (SGLang's `LoadFormat` values we support).

- "auto" / "safetensors": `model.safetensors`, an indexed shard set, or every `*.safetensors`;
- "pt": `pytorch_model*.bin`;
- "dummy": seeded random weights, no files read.
"""

from __future__ import annotations

LOAD_FORMATS: tuple[str, ...] = ("auto", "safetensors", "pt", "dummy")
