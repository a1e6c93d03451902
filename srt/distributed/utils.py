"""Group descriptions handed to model code (SGLang's `srt/distributed/utils.py`).

A layer's `tp_group` is a `LogicalGroup`: this rank's position in the group its weights are split
over. `get_group_rank_size(group)` reads it back, as SGLang's model files do when they shard a
tensor themselves (gpt-oss's attention sinks). Pipeline parallelism: srt runs one stage
(`get_pp_group`, `get_pp_indices`); asking for more raises.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class LogicalGroup:
    """rank_in_group / world_size of a weight partition (SGLang's names)."""

    rank_in_group: int
    world_size: int

    def __post_init__(self) -> None:
        if not 0 <= self.rank_in_group < self.world_size:
            raise ValueError(
                f"rank_in_group {self.rank_in_group} outside [0, world_size={self.world_size})"
            )


def get_group_rank_size(group: Any) -> tuple[int, int]:
    """(rank_in_group, world_size) of a group: a LogicalGroup, or anything with those fields."""
    try:
        return int(group.rank_in_group), int(group.world_size)
    except AttributeError:
        raise TypeError(
            f"group must have rank_in_group and world_size, got {type(group).__name__}"
        ) from None


@dataclass(frozen=True)
class PPGroup:
    """The pipeline-parallel group: one stage (rank 0 of 1)."""

    rank_in_group: int = 0
    world_size: int = 1

    @property
    def is_first_rank(self) -> bool:
        return self.rank_in_group == 0

    @property
    def is_last_rank(self) -> bool:
        return self.rank_in_group == self.world_size - 1


def get_pp_group() -> PPGroup:
    """This process's pipeline group: the only stage."""
    return PPGroup()


def get_pp_indices(num_hidden_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """[start, end) of the layers pipeline stage pp_rank of pp_size holds: all of them at
    pp_size 1; pipeline parallelism (pp_size > 1) is not supported and raises."""
    if pp_size != 1:
        raise NotImplementedError(f"pipeline parallelism (pp_size={pp_size}) is not supported")
    if pp_rank != 0:
        raise ValueError(f"pp_rank {pp_rank} outside [0, pp_size=1)")
    return 0, num_hidden_layers
