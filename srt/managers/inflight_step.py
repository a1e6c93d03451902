"""InFlightStep: an overlapped decode step launched and not yet read back (Scheduler)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from srt.managers.schedule_batch import Req


@dataclass
class InFlightStep:
    """A decode step launched and not yet read back (the overlapped decode)."""

    reqs: list[Req]  # its batch, in row order
    ids: torch.Tensor  # int64 [B] on the device: its tokens (the next step feeds them)
    host: torch.Tensor  # int64 [B] on the host (pinned on CUDA): the same, once `done`
    done: torch.cuda.Event | None  # recorded once the tokens' way to `host` is queued
    queued: bool = False  # whether that way (a copy, or the next step's table kernel) is queued

    def queue_copy(self) -> None:
        """Queue the tokens' copy to host (before anything overwrites `ids`), unless queued."""
        if not self.queued:
            self.host.copy_(self.ids, non_blocking=self.done is not None)
            if self.done is not None:
                self.done.record()
            self.queued = True

    def tokens(self) -> list[int]:
        self.queue_copy()
        if self.done is not None:
            self.done.synchronize()  # this step only: the next one keeps running
        return self.host.tolist()
