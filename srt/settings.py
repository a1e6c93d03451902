"""The srt settings: the environment variables srt reads, read once into a frozen value.

`get()` returns the current `Settings` (read from the environment on first use). A process that
changes the environment later calls `reload()`; tests use `override(...)`, which replaces
fields for a `with` block.

    HF_HUB_OFFLINE             1 / true / yes / on: a Hub id resolves from the local cache only
                               (huggingface_hub's own variable; `srt.model_loader.hub`)
    SGLANG_TORCH_PROFILER_DIR  where `bench_one_batch --profile` writes its traces (default /tmp)
    OPENAI_API_KEY             the key the GPQA eval and bench_serving send to `--base-url`
                               (default "EMPTY")

Read elsewhere, on purpose:
    TRITON_INTERPRET, SGL_EXT_*   `sgl_ext.settings`: one reading for both packages
                               (`sgl_ext.settings.get().interpret`)
    RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
                               `srt.distributed.parallel_state`, when asked: torchrun's account
                               of this process, which torch.distributed's env:// start reads
                               too, so a copy read earlier could disagree with it
    SGLang's switches          `srt.environ.envs` and `srt.utils.common.get_*_env_var`, through
                               `sglang_switch(name)` when a model file asks: SGLang's files name
                               them at call time
srt also writes two variables, never reads them: NCCL_NVLS_ENABLE=0 and
TORCH_SYMM_MEM_DISABLE_MULTICAST=1 before any NCCL communicator exists (`srt.distributed`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

_TRUE = ("1", "true", "yes", "on")


@dataclass(frozen=True)
class Settings:
    """The srt configuration (see the module docstring for the environment variables)."""

    hf_hub_offline: bool = False
    torch_profiler_dir: str = "/tmp"
    openai_api_key: str = "EMPTY"


def from_env(env: Mapping[str, str] = os.environ) -> Settings:
    """Settings as the environment `env` gives them."""
    return Settings(
        hf_hub_offline=env.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE,
        torch_profiler_dir=env.get("SGLANG_TORCH_PROFILER_DIR") or "/tmp",
        openai_api_key=env.get("OPENAI_API_KEY") or "EMPTY",
    )


_current: Settings | None = None


def get() -> Settings:
    """The current settings (read from the environment on first use)."""
    global _current
    if _current is None:
        _current = from_env()
    return _current


def reload() -> Settings:
    """Read the environment again (after a change of one of the variables)."""
    global _current
    _current = from_env()
    return _current


@contextlib.contextmanager
def override(**changes: object) -> Iterator[Settings]:
    """Replace some fields for the duration of a `with` block: `override(hf_hub_offline=True)`."""
    global _current
    before = get()
    _current = dataclasses.replace(before, **changes)  # type: ignore[arg-type]
    try:
        yield _current
    finally:
        _current = before


def sglang_switch(name: str) -> str | None:
    """The raw value of SGLang's environment switch `name` (None: unset), read when asked."""
    return os.environ.get(name)
