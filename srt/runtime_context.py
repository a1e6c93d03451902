"""What SGLang's model files ask of the running server (SGLang's `sglang.srt.runtime_context`):
the parallel layout, execution options, streams and the platform.

srt runs one pipeline stage, no DP attention, no expert parallelism and no deterministic-RL
mode, so those answers are fixed; the tensor-parallel position is the process's TP group (rank
0 of 1 without one). The attention backend is chosen by the model runner after the model is
built, so `get_exec().kernel.attention_backend` is None at build time.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from srt.distributed import get_tp_rank, get_tp_size
from srt.distributed.utils import PPGroup


@dataclass(frozen=True)
class ParallelContext:
    """This process's place in the parallel layout (SGLang's names)."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_group: PPGroup = field(default_factory=PPGroup)
    attn_dp_size: int = 1
    enable_dp_lm_head: bool = False
    enable_tp_lm_head_all_to_all: bool = False
    dwdp_size: int = 1
    moe_ep_size: int = 1

    @property
    def attn_tp_rank(self) -> int:
        return self.tp_rank  # no DP attention: attention TP is the TP group

    @property
    def attn_tp_size(self) -> int:
        return self.tp_size

    @property
    def pp_rank(self) -> int:
        return self.pp_group.rank_in_group

    @property
    def pp_size(self) -> int:
        return self.pp_group.world_size


@dataclass(frozen=True)
class DeterministicConfig:
    rl_on_policy_target: str | None = None
    enable_deterministic_inference: bool = False


@dataclass(frozen=True)
class KernelConfig:
    attention_backend: str | None = None  # picked by the model runner, after the build


@dataclass(frozen=True)
class MoeExecConfig:
    ep_num_redundant_experts: int = 0


@dataclass(frozen=True)
class FeaturesConfig:
    enable_fp32_lm_head: bool = False


@dataclass(frozen=True)
class ExecConfig:
    """Execution options SGLang's model files read (`get_exec()`)."""

    deterministic: DeterministicConfig = field(default_factory=DeterministicConfig)
    kernel: KernelConfig = field(default_factory=KernelConfig)
    moe: MoeExecConfig = field(default_factory=MoeExecConfig)
    features: FeaturesConfig = field(default_factory=FeaturesConfig)


@dataclass(frozen=True)
class PlatformContext:
    """The machine's facts (`get_platform()`)."""

    is_sm90: bool = False
    is_sm100: bool = False
    is_blackwell: bool = False


_EXEC = ExecConfig()


@functools.cache
def _parallel(tp_rank: int, tp_size: int) -> ParallelContext:
    return ParallelContext(tp_rank=tp_rank, tp_size=tp_size)


def get_parallel() -> ParallelContext:
    """The parallel layout: the process's TP group (TP 1 without one), one pipeline stage."""
    return _parallel(get_tp_rank(), get_tp_size())


def get_exec() -> ExecConfig:
    """Execution options (fixed: see the module docstring)."""
    return _EXEC


def get_stream(name: str) -> None:
    """SGLang's named side streams ("alt" overlaps q's and k's norms): srt runs every op of a
    layer on the current stream, so there is none (None)."""
    return None


@functools.cache
def get_platform() -> PlatformContext:
    if not torch.cuda.is_available():
        return PlatformContext()
    major, _ = torch.cuda.get_device_capability()
    return PlatformContext(is_sm90=major == 9, is_sm100=major == 10, is_blackwell=major >= 10)
