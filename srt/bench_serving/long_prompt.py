"""What the ``long-prompt-arrival`` scenario measures (issue 48's chunked-prefill goal): the
decoders' inter-token latency while one long prompt is prefilled beside them.

Without chunked prefill the long prompt's whole prefill runs in one step and every decoder
waits for it: one gap as long as that prefill. With chunking the decoders keep stepping
between its chunks: several gaps of one chunk each. The goal compares the decoders' p99 ITL
with their median (<= 3x); the longest gap and the gaps that overlap the prefill (from the
long prompt's send to its first token) show the stall itself, which a p99 over many tokens
can hide.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from srt.bench_serving.datasets import ROLE_DECODER, ROLE_LONG
from srt.bench_serving.metrics import RequestOutput


@dataclass(frozen=True)
class LongPromptMetrics:
    """The decoders' ITL (ms) and the long prompt's TTFT (ms).

    Attributes
    ----------
    decoder_itl_median_ms, decoder_itl_p99_ms, decoder_itl_max_ms : over every decoder gap.
    itl_p99_over_median : decoder_itl_p99_ms / decoder_itl_median_ms (the goal: <= 3).
    long_ttft_ms : the long prompt's time to first token.
    prefill_gaps : decoder gaps that overlap the long prompt's prefill window.
    prefill_gap_max_ms : the longest of them (0 when none).
    prefill_gap_median_ms : their median (0 when none).
    before_itl_median_ms : the median of the gaps that end before the long prompt is sent (the
        decode-only baseline; 0 when none): a small chunk can hold p99 / median only by
        slowing every step after the arrival, which this shows.
    """

    decoder_itl_median_ms: float
    decoder_itl_p99_ms: float
    decoder_itl_max_ms: float
    itl_p99_over_median: float
    long_ttft_ms: float
    prefill_gaps: int
    prefill_gap_max_ms: float
    prefill_gap_median_ms: float
    before_itl_median_ms: float

    def as_row(self) -> dict[str, Any]:
        return {f"lpa_{f.name}": getattr(self, f.name) for f in fields(self)}


def long_prompt_metrics(outputs: list[RequestOutput]) -> LongPromptMetrics:
    """The scenario's metrics from its requests' measurements (roles from the dataset).

    Raises ValueError when the long request or every decoder failed."""
    long = [o for o in outputs if o.role == ROLE_LONG and o.success and o.token_times]
    decoders = [o for o in outputs if o.role == ROLE_DECODER and o.success]
    if not long or not decoders:
        raise ValueError("long-prompt-arrival: the long request or every decoder failed")
    lo = long[0]
    window = (lo.start_time, lo.token_times[0])
    gaps: list[float] = []
    in_window: list[float] = []
    before: list[float] = []
    for d in decoders:
        t = d.token_times
        for a, b in zip(t[:-1], t[1:], strict=True):
            gaps.append(b - a)
            if a < window[1] and b > window[0]:
                in_window.append(b - a)
            elif b <= window[0]:
                before.append(b - a)
    ms = np.asarray(gaps or [0.0], dtype=np.float64) * 1e3
    median = float(np.median(ms))
    p99 = float(np.percentile(ms, 99))
    return LongPromptMetrics(
        decoder_itl_median_ms=median,
        decoder_itl_p99_ms=p99,
        decoder_itl_max_ms=float(ms.max()),
        itl_p99_over_median=p99 / median if median > 0 else float("inf"),
        long_ttft_ms=lo.ttft * 1e3,
        prefill_gaps=len(in_window),
        prefill_gap_max_ms=max(in_window, default=0.0) * 1e3,
        prefill_gap_median_ms=float(np.median(in_window)) * 1e3 if in_window else 0.0,
        before_itl_median_ms=float(np.median(before)) * 1e3 if before else 0.0,
    )


def format_long_prompt(m: LongPromptMetrics) -> list[str]:
    """The scenario's lines of the printed report."""
    rows = [
        ("Decoder median ITL (ms):", f"{m.decoder_itl_median_ms:.2f}"),
        ("Decoder P99 ITL (ms):", f"{m.decoder_itl_p99_ms:.2f}"),
        ("Decoder max ITL (ms):", f"{m.decoder_itl_max_ms:.2f}"),
        ("P99 / median ITL:", f"{m.itl_p99_over_median:.2f}"),
        ("Long prompt TTFT (ms):", f"{m.long_ttft_ms:.2f}"),
        ("Decoder gaps during its prefill:", f"{m.prefill_gaps}"),
        ("Longest of them (ms):", f"{m.prefill_gap_max_ms:.2f}"),
        ("Their median (ms):", f"{m.prefill_gap_median_ms:.2f}"),
        ("Decoder median ITL before it (ms):", f"{m.before_itl_median_ms:.2f}"),
    ]
    return [f"{'Long prompt arrival':-^50}"] + [f"{k:<40} {v:<10}" for k, v in rows]


__all__ = ["LongPromptMetrics", "format_long_prompt", "long_prompt_metrics"]
