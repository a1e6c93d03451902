"""`current_platform` (SGLang's `sglang.srt.platforms`): the device's cache and sync calls."""

from __future__ import annotations

import torch


class CurrentPlatform:
    """CUDA when present, else the CPU (where both calls do nothing)."""

    @staticmethod
    def empty_cache() -> None:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    @staticmethod
    def synchronize() -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()


current_platform = CurrentPlatform()
