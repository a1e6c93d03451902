"""PlanCache: an op's launch plans by call metadata, the shared piece of every op's eager fast
path (`_plans.py` has the RoPE / KV-write keys; `triton/launcher.py`'s CachedLauncher and the
layer ops keep theirs here too).

An op checks a call once per distinct metadata and keeps what it decided (backend, Triton
`KernelLauncher`) in a frozen plan under a key that holds everything the checks and the launch
configuration read: each tensor's dtype, shape, strides, device and data_ptr() % 16 (and
requires_grad where the op writes it), and the scalars with their types. A changed input
therefore misses and is checked again; a hit skips the checks and launches the plan's compiled
kernel directly.
"""

from __future__ import annotations

from typing import Any

import torch

from sgl_ext import settings

MAX_PLANS = 4096  # a cache past this size is dropped (e.g. a float scale that changes per call)
# What building a plan key raises for an argument the checks reject (the op then runs them,
# and they name it): not a tensor, unhashable, or a tensor without a data pointer (sparse).
KEY_ERRORS = (AttributeError, TypeError, RuntimeError)


class PlanCache(dict):
    """key -> plan of one op; emptied when the settings change (plans hold the backend and
    launch configuration chosen under them) and when it grows past MAX_PLANS."""

    def __init__(self) -> None:
        super().__init__()
        settings.on_change(self.clear)

    def put(self, key: object, plan: Any) -> Any:
        """Store plan under key (None: an uncacheable call, not stored); returns plan."""
        if key is not None:
            if len(self) >= MAX_PLANS:
                self.clear()
            self[key] = plan
        return plan


def tensor_key(t: torch.Tensor) -> tuple:
    """A tensor's part of a plan key: (dtype, shape, strides, device, data_ptr() % 16).

    Raises AttributeError / TypeError for a non-tensor (the caller then runs the checks, which
    name the bad argument)."""
    return (t.dtype, t.shape, t.stride(), t.device, t.data_ptr() & 15)


def optional_key(t: torch.Tensor | None) -> tuple | None:
    """tensor_key of an optional tensor argument (None stays None)."""
    return None if t is None else (t.dtype, t.shape, t.stride(), t.device, t.data_ptr() & 15)
