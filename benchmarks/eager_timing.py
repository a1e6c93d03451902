"""Eager µs per call, timed so that columns can be compared: warm-up first, then interleaved
rounds, medians over rounds with their spread.

Used by `bench_rope_kv.py --eager` and `bench_eager.py`. A *point* (e.g. one shape and token
count) has *columns* (ours, the peers, a bare launch); each column is a `fn(i)` that makes one
eager call (i: the call's index, to rotate input sets). `time_points`:

1. warm-up: every column of every point runs `warmup` calls (compiles, makes plans, loads
   modules) before anything is timed; a column that raises here is dropped with a message;
2. n per point: at least `min_calls`, and enough calls that a loop lasts `min_loop_s` of host
   time for the point's cheapest column (so the timer and the loop overhead do not matter);
3. R rounds; in each round every column of every point is timed once: 3 untimed calls, a
   synchronised GPU, a loop of n calls (host time), then a synchronisation (host + device
   time). The column order rotates from round to round and the points are visited in every
   round, so a drift of the host (clocks, other load) reaches every column alike;
4. per column: the median over rounds of the µs per call (host + device, and host only) and
   all the rounds' values, from which the tables print a spread.
"""

from __future__ import annotations

import contextlib
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from bench_util import loop_us  # (benchmarks/)

Fn = Callable[[int], object]


@dataclass
class Column:
    """One timed column: fn(i) makes call i; ctx() wraps its loops (e.g. a settings override)."""

    fn: Fn
    ctx: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext


@dataclass
class Timing:
    """µs per call of one column over the rounds (total: host + device; host: the loop alone)."""

    total: list[float] = field(default_factory=list)
    host: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.total)

    @property
    def host_median(self) -> float:
        return statistics.median(self.host)

    def quartiles(self) -> tuple[float, float]:
        """(first, third) quartile of the rounds' totals (min, max with fewer than 4 rounds)."""
        if len(self.total) < 4:
            return min(self.total), max(self.total)
        q = statistics.quantiles(self.total, n=4, method="inclusive")
        return q[0], q[2]


def _loop(fn: Fn, n: int, untimed: int = 3) -> tuple[float, float]:
    """(host + device, host) µs per call of a loop of n calls, after `untimed` calls (a
    settings override, e.g. the direct launch off, empties the plan caches: the next column's
    first call would make its plan again)."""
    for i in range(untimed):
        fn(i)
    return loop_us(fn, n)


def time_points(
    points: dict[object, dict[str, Column]],
    rounds: int = 15,
    warmup: int = 20,
    min_calls: int = 200,
    min_loop_s: float = 2e-3,
    max_calls: int = 5000,
    log: Callable[[str], None] = print,
) -> tuple[dict[object, dict[str, Timing]], dict[object, int]]:
    """Time every column of every point (see the module docstring); returns
    ({point: {column: Timing}}, {point: n calls per loop}). Columns that fail are left out."""
    live: dict[object, dict[str, Column]] = {}
    for p, cols in points.items():
        live[p] = {}
        for name, col in cols.items():
            try:
                with col.ctx():
                    for i in range(warmup):
                        col.fn(i)
                torch.cuda.synchronize()
                live[p][name] = col
            except Exception as err:  # noqa: BLE001 - one failing column must not end the table
                log(f"# {p} {name}: warm-up failed: {type(err).__name__}: {str(err)[:150]}")
    calls: dict[object, int] = {}
    for p, cols in live.items():
        cheapest = math.inf
        for col in cols.values():  # host time per call from one short loop each
            with col.ctx():
                cheapest = min(cheapest, _loop(col.fn, 20)[1])
        want = math.ceil(min_loop_s / (cheapest * 1e-6)) if cheapest > 0 else min_calls
        calls[p] = max(min_calls, min(max_calls, want))
    out: dict[object, dict[str, Timing]] = {
        p: {c: Timing() for c in cols} for p, cols in live.items()
    }
    for r in range(rounds):
        for p, cols in live.items():
            names = list(cols)
            k = r % len(names) if names else 0
            for name in names[k:] + names[:k]:  # rotated: no column is always first
                if name not in out[p]:
                    continue  # failed in an earlier round
                col = cols[name]
                try:
                    with col.ctx():
                        total, host = _loop(col.fn, calls[p])
                except Exception as err:  # noqa: BLE001
                    log(f"# {p} {name}: failed in round {r}: {type(err).__name__}: {err}"[:200])
                    del out[p][name]
                    continue
                out[p][name].total.append(total)
                out[p][name].host.append(host)
    return out, calls
