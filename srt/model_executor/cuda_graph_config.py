"""CUDA-graph phases and backends (SGLang's `model_executor/cuda_graph_config`).

srt captures whole decode graphs (`cuda_graph_runner.py`) and runs prefill eagerly; SGLang's
model files ask `check_cuda_graph_backend` only on NPU paths. It answers for srt: decode uses
the full backend when graphs are on; nothing else is in use.
"""

from __future__ import annotations


class Phase:
    """The two phases of a forward."""

    DECODE = "decode"
    PREFILL = "prefill"
    ALL = (DECODE, PREFILL)


class Backend:
    """Capture backends (SGLang's names)."""

    TC_PIECEWISE = "tc_piecewise"
    FULL = "full"
    BREAKABLE = "breakable"
    DISABLED = "disabled"
    ALL = (FULL, BREAKABLE, DISABLED)


def check_cuda_graph_backend(phase: str, backend: str) -> bool:
    """Whether `phase` runs under `backend` as a model file asks at build time: srt decides per
    batch in the runner, so a model file is only told the one fixed fact: prefill is eager."""
    return phase == Phase.PREFILL and backend == Backend.DISABLED
