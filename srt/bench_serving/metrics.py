"""What one request measured, and the run's metrics with SGLang's bench_serving names.

A request records the client-side arrival time of every streamed chunk that carried output
(`RequestOutput.token_times`); everything else is derived from those and its send time:
- TTFT: first chunk - send;
- ITL: the gaps between consecutive chunks (one per chunk, as SGLang's client counts them; a
  server that streams one token per chunk gives one per token);
- TPOT: (E2E latency - TTFT) / (output tokens - 1), for requests with more than one token;
- E2E latency: end of the stream - send.
Distributions are reported as mean, median, std, p90, p95, p99 (numpy's linear
interpolation, as SGLang) and max, in ms; an empty one is all zeros (SGLang's convention).
Throughputs divide by the benchmark's duration (first send to last completion). The prefix-
cache hit rate is the sum of cached prompt tokens over the sum of prompt tokens of the
requests whose server reported a count (None when none did).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np


@dataclass
class RequestOutput:
    """One request's measurement, filled in by a backend while it streams.

    Attributes
    ----------
    prompt_len : prompt tokens sent.
    output_len : output tokens received (or reported by the server's usage).
    start_time : when the request was sent (time.perf_counter()).
    end_time : when its stream ended.
    token_times : arrival time of each chunk that carried output.
    cached_tokens : prompt tokens the server took from its prefix cache (None: not reported).
    success, error : whether it finished, else why not.
    role : the dataset row's role (long-prompt-arrival), else "".
    """

    prompt_len: int
    output_len: int = 0
    start_time: float = 0.0
    end_time: float = 0.0
    token_times: list[float] = field(default_factory=list)
    cached_tokens: int | None = None
    success: bool = False
    error: str = ""
    role: str = ""

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.start_time if self.token_times else 0.0

    @property
    def latency(self) -> float:
        return self.end_time - self.start_time

    @property
    def itl(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t[:-1], t[1:], strict=True)]

    @property
    def tpot(self) -> float | None:
        if self.output_len <= 1:
            return None
        return (self.latency - self.ttft) / (self.output_len - 1)


@dataclass(frozen=True)
class Distribution:
    """Summary of a list of durations, in milliseconds."""

    mean: float
    median: float
    std: float
    p90: float
    p95: float
    p99: float
    max: float

    @classmethod
    def of_seconds(cls, values: list[float]) -> Distribution:
        if not values:
            return cls(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
        ms = np.asarray(values, dtype=np.float64) * 1e3
        p90, p95, p99 = (float(x) for x in np.percentile(ms, [90, 95, 99]))
        return cls(
            float(ms.mean()), float(np.median(ms)), float(ms.std()), p90, p95, p99, float(ms.max())
        )

    def as_row(self, name: str) -> dict[str, float]:
        """SGLang's keys: mean_<name>_ms, median_<name>_ms, ..., max_<name>_ms."""
        return {f"{f.name}_{name}_ms": getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class BenchmarkMetrics:
    """The run's metrics (SGLang's bench_serving names; latencies in ms)."""

    completed: int
    failed: int
    duration: float
    total_input: int
    total_output: int
    total_cached: int | None
    request_throughput: float
    input_throughput: float
    output_throughput: float
    total_throughput: float
    concurrency: float
    cache_hit_rate: float | None
    ttft: Distribution
    tpot: Distribution
    itl: Distribution
    e2e_latency: Distribution

    def as_row(self) -> dict[str, Any]:
        """A flat dict with SGLang's result keys (``total_input_tokens``, ``mean_ttft_ms``,
        ...), its ``cache_report`` and our ``cache_hit_rate`` (a fraction, or None)."""
        row: dict[str, Any] = {
            "duration": self.duration,
            "completed": self.completed,
            "failed": self.failed,
            "total_input_tokens": self.total_input,
            "total_output_tokens": self.total_output,
            "request_throughput": self.request_throughput,
            "input_throughput": self.input_throughput,
            "output_throughput": self.output_throughput,
            "total_throughput": self.total_throughput,
        }
        for name in ("e2e_latency", "ttft", "tpot", "itl"):
            row.update(getattr(self, name).as_row(name))
        row["concurrency"] = self.concurrency
        row["cache_hit_rate"] = self.cache_hit_rate
        pct = None if self.cache_hit_rate is None else round(self.cache_hit_rate * 100, 2)
        row["cache_report"] = {
            "total_prompt_tokens": self.total_input,
            "total_cached_tokens": self.total_cached,
            "cache_hit_rate_pct": pct,
        }
        return row


def calculate_metrics(outputs: list[RequestOutput], duration: float) -> BenchmarkMetrics:
    """The run's metrics over its successful requests (see the module docstring)."""
    if not duration > 0:
        raise ValueError(f"duration must be > 0 seconds, got {duration}")
    ok = [o for o in outputs if o.success]
    total_input = sum(o.prompt_len for o in ok)
    total_output = sum(o.output_len for o in ok)
    reported = [o for o in ok if o.cached_tokens is not None]
    total_cached = sum(o.cached_tokens or 0 for o in reported) if reported else None
    prompt_of_reported = sum(o.prompt_len for o in reported)
    hit_rate = None
    if total_cached is not None and prompt_of_reported > 0:
        hit_rate = total_cached / prompt_of_reported
    tpots = [t for t in (o.tpot for o in ok) if t is not None]
    latencies = [o.latency for o in ok]
    return BenchmarkMetrics(
        completed=len(ok),
        failed=len(outputs) - len(ok),
        duration=duration,
        total_input=total_input,
        total_output=total_output,
        total_cached=total_cached,
        request_throughput=len(ok) / duration,
        input_throughput=total_input / duration,
        output_throughput=total_output / duration,
        total_throughput=(total_input + total_output) / duration,
        concurrency=sum(latencies) / duration,
        cache_hit_rate=hit_rate,
        ttft=Distribution.of_seconds([o.ttft for o in ok if o.token_times]),
        tpot=Distribution.of_seconds(tpots),
        itl=Distribution.of_seconds([x for o in ok for x in o.itl]),
        e2e_latency=Distribution.of_seconds(latencies),
    )


__all__ = ["BenchmarkMetrics", "Distribution", "RequestOutput", "calculate_metrics"]
