"""Host -> device uploads that never wait for the device.

`t.to(cuda)` from pageable memory is a synchronous copy: the host waits until the stream is
idle. The overlapped decode (Scheduler) prepares step N + 1 while step N still runs on the GPU,
so every upload on that path goes through pinned memory: the copy is queued behind step N and
the host goes on. torch's pinned-memory allocator keeps each staging block until its copy has
completed, so a staging buffer is never reused too early.
"""

from __future__ import annotations

import torch


def upload(t: torch.Tensor, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`t.to(device, dtype)` queued on the current stream without a host wait (CUDA, host t:
    staged through pinned memory); any other case is `t.to(device, dtype)` itself."""
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    if not t.is_pinned():
        t = t.pin_memory()
    return t.to(device, non_blocking=True)
