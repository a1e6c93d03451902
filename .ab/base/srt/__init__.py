"""srt: SGLang-style runtime model layers on top of sgl_ext (fused RoPE + KV-cache write).

`srt.Engine` is imported lazily, so `import srt` does no heavy work.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Engine"]


def __getattr__(name: str) -> Any:
    if name == "Engine":
        from srt.entrypoints.engine import Engine

        return Engine
    raise AttributeError(f"module 'srt' has no attribute {name!r}")
