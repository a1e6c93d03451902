"""`register_custom_op` (SGLang's `sglang.srt.utils.custom_op`).

SGLang registers such functions as torch custom ops so that its piecewise CUDA graphs can split
around them. srt captures whole decode graphs and never splits them, so the function is
returned as it is: calling it runs it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


def register_custom_op(
    fn: F | None = None,
    *,
    op_name: str | None = None,
    mutates_args: list[str] | None = None,
    out_shape: int | str | None = None,
    fake_impl: Callable[..., Any] | None = None,
    eager: bool = True,
) -> Any:
    """Decorator (with or without arguments): returns `fn` unchanged."""
    if fn is not None:
        return fn
    return lambda f: f
