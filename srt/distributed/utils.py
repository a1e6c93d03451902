"""Group descriptions handed to model code (SGLang's `srt/distributed/utils.py`).

A layer's `tp_group` is a `LogicalGroup`: this rank's position in the group its weights are split
over. `get_group_rank_size(group)` reads it back, as SGLang's model files do when they shard a
tensor themselves (gpt-oss's attention sinks).
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
