"""AuxHiddenStateList: hidden states a model captures between layers (SGLang's EAGLE3 capture)."""

from __future__ import annotations

import torch


class AuxHiddenStateList(list):
    """A list of captured [T, hidden] tensors; `capture` copies a borrowed tensor (a later layer
    may write into it in place) or adopts an owned one."""

    def capture(self, hidden: torch.Tensor, *, owned: bool = False) -> None:
        self.append(hidden if owned else hidden.clone())
