"""SGLang's torch.compile piecewise CUDA graphs: srt does not use them, so no forward is ever
inside one."""

from __future__ import annotations

from typing import NoReturn


def is_in_tc_piecewise_cuda_graph() -> bool:
    return False


def get_tc_piecewise_forward_context() -> NoReturn:
    raise RuntimeError("srt runs no torch.compile piecewise CUDA graphs")
