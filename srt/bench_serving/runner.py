"""The benchmark loop: send the dataset's requests on SGLang's schedule and gather what each
measured.

Arrivals: a row with an ``arrival_s`` is sent that many seconds after the start; the others
one after another, with exponential gaps of mean 1 / ``request_rate`` (a Poisson process),
or all at once for an infinite rate (SGLang's default). ``max_concurrency`` caps the requests
in flight (an asyncio semaphore, as SGLang's client). Each request is an asyncio task; a tqdm
bar counts the finished ones.
"""

from __future__ import annotations

import asyncio
import math
import sys
import time
from dataclasses import dataclass

import numpy as np

from srt.bench_serving.backends import Backend
from srt.bench_serving.datasets import DatasetRow
from srt.bench_serving.metrics import RequestOutput


@dataclass(frozen=True)
class RunResult:
    """The requests' measurements, in dataset order, and the run's wall time (first send to
    last completion), in seconds."""

    outputs: list[RequestOutput]
    duration: float


def arrival_offsets(rows: list[DatasetRow], request_rate: float, seed: int) -> list[float]:
    """Seconds after the start at which each row is sent (see the module docstring)."""
    if not request_rate > 0:
        raise ValueError(f"request_rate must be > 0 (inf: all at once), got {request_rate}")
    rng = np.random.default_rng(seed)
    t = 0.0
    offsets = []
    for row in rows:
        if row.arrival_s is not None:
            offsets.append(float(row.arrival_s))
            continue
        offsets.append(t)
        if math.isfinite(request_rate):
            t += float(rng.exponential(1.0 / request_rate))
    return offsets


async def run_requests(
    backend: Backend,
    rows: list[DatasetRow],
    request_rate: float = math.inf,
    max_concurrency: int | None = None,
    seed: int = 0,
    progress: bool = True,
) -> RunResult:
    """Send every row to the backend on the schedule; their measurements and the wall time."""
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1 (or None), got {max_concurrency}")
    offsets = arrival_offsets(rows, request_rate, seed)
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(rows), file=sys.stderr, desc="requests")
    start = time.perf_counter()

    async def one(row: DatasetRow, offset: float) -> RequestOutput:
        delay = start + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if limit is None:
            out = await backend.send(row)
        else:
            async with limit:
                out = await backend.send(row)
        if bar is not None:
            bar.update(1)
        return out

    try:
        outputs = await asyncio.gather(*(one(r, o) for r, o in zip(rows, offsets, strict=True)))
    finally:
        if bar is not None:
            bar.close()
    return RunResult(list(outputs), time.perf_counter() - start)


async def warm_up(backend: Backend, rows: list[DatasetRow], flush: bool) -> list[RequestOutput]:
    """Send the warm-up rows at once (compiles, allocator growth) and, with ``flush``, drop
    the prefix cache afterwards so the timed run starts cold. Raises ValueError if a warm-up
    request failed (too long for the server, a wrong model name, ...): the run would fail the
    same way."""
    outs = list(await asyncio.gather(*(backend.send(r) for r in rows)))
    bad = [o.error for o in outs if not o.success]
    if bad:
        raise ValueError(f"a warm-up request failed: {bad[0]}")
    if flush:
        await backend.flush_cache()
    return outs


__all__ = ["RunResult", "arrival_offsets", "run_requests", "warm_up"]
