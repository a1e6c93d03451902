"""HF config helpers SGLang's model files import (`sglang.srt.utils.hf_transformers_utils`)."""

from __future__ import annotations

from typing import Any


def get_rope_config(config: Any) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope parameters) of an HF config, transformers 4 or 5.

    With transformers 5's `rope_parameters` the dict returned is that whole dict (it includes
    rope_theta and the scaling keys); otherwise the 4.x `rope_scaling` dict or None.
    """
    params = getattr(config, "rope_parameters", None)
    if params is not None:
        return params.get("rope_theta", getattr(config, "rope_theta", 10000)), params
    return getattr(config, "rope_theta", 10000), getattr(config, "rope_scaling", None)
