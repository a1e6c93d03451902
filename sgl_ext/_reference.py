"""`native_reference`: an op's torch-native reference (`<op>_native`), made from the op itself.

Every public op of the rope_kv family has a reference beside it: the same arguments, the same
checks and semantics, computed in torch (the CPU path's bits, and the tests' oracle). Declaring
its parameters again would be a second copy of the op's signature to keep in step, so the
reference takes the op's: `inspect.signature`, `help()` and a bad call read as the op's, less
the parameters that only choose how the op launches (enable_pdl, a GEMM configuration) or belong
to another call form (SGLang 0.5's keywords of the RoPE op).
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable
from typing import Any, TypeVar

R = TypeVar("R")


def native_reference(
    op: Callable[..., R], body: Callable[..., R], drop: tuple[str, ...] = ("enable_pdl",)
) -> Callable[..., R]:
    """`<op>_native`: op's signature less the parameters in `drop`; a call binds its arguments
    to that signature (defaults filled in) and hands them to body positionally, in the
    signature's order.

    A None default that the parameter's annotation does not admit (`positions: torch.Tensor =
    None`: a placeholder for another call form of the op) is no default here: the reference
    requires the argument."""
    sig = inspect.signature(op)
    hints = typing.get_type_hints(op)
    params = []
    for p in sig.parameters.values():
        if p.name in drop:
            continue
        if p.default is None and not _admits_none(hints.get(p.name)):
            p = p.replace(default=inspect.Parameter.empty)
        params.append(p)
    sig = sig.replace(parameters=params)

    def reference(*args: Any, **kwargs: Any) -> R:
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        return body(*bound.args)

    name = op.__name__.removesuffix("_with_cos_sin_cache_inplace")
    reference.__name__ = reference.__qualname__ = f"{name}_native"
    reference.__module__ = op.__module__
    reference.__signature__ = sig  # type: ignore[attr-defined]
    less = [n for n in drop if n in inspect.signature(op).parameters]
    reference.__doc__ = (
        f"The torch-native reference of `{op.__name__}`: its arguments"
        + (f" (less {', '.join(less)})" if less else "")
        + f", checks and semantics, computed in torch. {body.__doc__ or ''}"
    ).rstrip()
    return reference


def _admits_none(hint: object) -> bool:
    return hint is None or hint is type(None) or type(None) in typing.get_args(hint)


__all__ = ["native_reference"]
