"""SGLang's expert-distribution recorder (EPLB statistics). srt records nothing: the recorder's
`with_current_layer` is an empty context."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


class ExpertDistributionRecorder:
    """Records nothing (srt has no EPLB)."""

    @contextlib.contextmanager
    def with_current_layer(self, layer_idx: int) -> Iterator[None]:
        yield


_RECORDER = ExpertDistributionRecorder()


def get_global_expert_distribution_recorder() -> ExpertDistributionRecorder:
    return _RECORDER
