"""The sgl_ext settings: every `SGL_EXT_*` environment variable, read once into a frozen value.

`get()` returns the current `Settings` (read from the environment on first use). A process that
changes the environment later calls `reload()`; tests and benchmarks use `override(...)`, which
replaces fields for a `with` block. Every change drops the ops' cached launch plans (they hold
the backend and launch configuration chosen under the old settings).

    SGL_EXT_BACKEND         native | triton: force a backend (default: triton on CUDA tensors,
                            native elsewhere)
    SGL_EXT_CACHE_DIR       where built extensions go (the C fast path; default
                            ~/.cache/sgl_ext)
    SGL_EXT_DEBUG           1: value-reading (synchronising) checks of positions and slots
    SGL_EXT_DIRECT_LAUNCH   0: launch Triton kernels through the JIT on every call (default 1:
                            after a plan's first launch, its compiled kernel is called directly)
    SGL_EXT_FAST_LAUNCH     0: no C fast path (default 1: where a C compiler and libcuda are
                            found, an eager call whose metadata has a plan is keyed and
                            launched by one C call, `fast_launch.py`)
    SGL_EXT_TRITON_CONFIG   one rope_kv launch layout for every call (tuning):
                            "block_h=16,num_warps=4,order=2d,load=pre_wait,early_release=1"
                            (launch_layout.LaunchConfig's fields) or the positional integers
                            "block_h,num_warps[,order[,merged[,...]]]" (launch_layout)
    SGL_EXT_PDL             0: no programmatic dependent launch (default 1: on Hopper+, every
                            Triton kernel that declares USE_PDL overlaps its launch with the
                            previous kernel's tail and waits for its results before reading)
    TRITON_INTERPRET        1: Triton runs in its interpreter (CPU tensors; never launched
                            directly)
    CC                      the C compiler that builds the fast path (default: cc, then gcc,
                            on PATH)
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from sgl_ext.launch_layout import LaunchConfig, parse_tuning

BACKENDS = ("native", "triton")
_FALSE = ("", "0", "false", "False", "no")


@dataclass(frozen=True)
class Settings:
    """The sgl_ext configuration (see the module docstring for the environment variables)."""

    backend: str | None = None
    debug: bool = False
    direct_launch: bool = True
    triton_config: LaunchConfig | None = None  # also given as its text or integers
    interpret: bool = False
    pdl: bool = True
    fast_launch: bool = True
    cache_dir: str = os.path.join("~", ".cache", "sgl_ext")  # "~" expanded where it is used
    cc: str | None = None

    def __post_init__(self) -> None:
        if self.backend is not None and self.backend not in BACKENDS:
            raise ValueError(
                f"SGL_EXT_BACKEND must be one of {', '.join(BACKENDS)} (or unset), "
                f"got {self.backend!r}"
            )
        if self.triton_config is not None and not isinstance(self.triton_config, LaunchConfig):
            object.__setattr__(self, "triton_config", parse_tuning(self.triton_config))


def from_env(env: dict[str, str] | os._Environ[str] = os.environ) -> Settings:
    """Settings as the environment `env` gives them."""
    return Settings(
        backend=env.get("SGL_EXT_BACKEND", "").strip().lower() or None,
        debug=env.get("SGL_EXT_DEBUG", "0") not in _FALSE,
        direct_launch=env.get("SGL_EXT_DIRECT_LAUNCH", "1") not in _FALSE,
        triton_config=parse_tuning(text) if (text := env.get("SGL_EXT_TRITON_CONFIG")) else None,
        interpret=env.get("TRITON_INTERPRET", "0") == "1",
        pdl=env.get("SGL_EXT_PDL", "1") not in _FALSE,
        fast_launch=env.get("SGL_EXT_FAST_LAUNCH", "1") not in _FALSE,
        cache_dir=env.get("SGL_EXT_CACHE_DIR") or Settings.cache_dir,
        cc=env.get("CC") or None,
    )


_current: Settings | None = None
_listeners: list[Callable[[], None]] = []


def get() -> Settings:
    """The current settings (read from the environment on first use)."""
    global _current
    if _current is None:
        _current = from_env()
    return _current


def _set(new: Settings) -> None:
    global _current
    _current = new
    for fn in _listeners:
        fn()


def reload() -> Settings:
    """Read the environment again (after a change of `SGL_EXT_*`)."""
    _set(from_env())
    return get()


@contextlib.contextmanager
def override(**changes: object) -> Iterator[Settings]:
    """Replace some fields for the duration of a `with` block: `override(backend="triton")`."""
    before = get()
    _set(dataclasses.replace(before, **changes))  # type: ignore[arg-type]
    try:
        yield get()
    finally:
        _set(before)


def set_fields(**changes: object) -> None:
    """Replace some fields until the next change (used by `set_debug_checks`)."""
    _set(dataclasses.replace(get(), **changes))  # type: ignore[arg-type]


def on_change(fn: Callable[[], None]) -> None:
    """Call fn() after every change of the settings (the ops drop their cached plans)."""
    _listeners.append(fn)
