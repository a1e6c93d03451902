"""The printed report (SGLang's bench_serving layout: 40-column labels, ms with 2 decimals)
and the jsonl result row (one line per run, appended)."""

from __future__ import annotations

import json
import math
import os
from typing import Any

from srt.bench_serving.metrics import BenchmarkMetrics, Distribution


def _line(label: str, value: Any) -> str:
    text = f"{value:.2f}" if isinstance(value, float) else str(value)
    return f"{label:<40} {text:<10}"


def _dist(title: str, short: str, d: Distribution, with_max: bool = False) -> list[str]:
    lines = [f"{title:-^50}"]
    lines += [
        _line(f"Mean {short} (ms):", d.mean),
        _line(f"Median {short} (ms):", d.median),
        _line(f"P99 {short} (ms):", d.p99),
    ]
    if with_max:
        lines.append(_line(f"Max {short} (ms):", d.max))
    return lines


def format_report(m: BenchmarkMetrics, header: dict[str, Any]) -> list[str]:
    """The report's lines: ``header`` (backend, rate, ...) first, then the metrics."""
    lines = [f"{' Serving Benchmark Result ':=^50}"]
    lines += [_line(k, v) for k, v in header.items()]
    lines += [
        _line("Successful requests:", m.completed),
        _line("Failed requests:", m.failed),
        _line("Benchmark duration (s):", m.duration),
        _line("Total input tokens:", m.total_input),
        _line("Total generated tokens:", m.total_output),
        _line("Request throughput (req/s):", m.request_throughput),
        _line("Input token throughput (tok/s):", m.input_throughput),
        _line("Output token throughput (tok/s):", m.output_throughput),
        _line("Total token throughput (tok/s):", m.total_throughput),
        _line("Concurrency:", m.concurrency),
    ]
    lines += _dist("End-to-End Latency", "E2E Latency", m.e2e_latency)
    lines += _dist("Time to First Token", "TTFT", m.ttft)
    lines += _dist("Time per Output Token (excl. 1st token)", "TPOT", m.tpot)
    lines += _dist("Inter-Token Latency", "ITL", m.itl, with_max=True)
    lines.append(f"{'Prefix Cache':-^50}")
    if m.cache_hit_rate is None:
        lines.append(_line("Cache hit rate:", "n/a (not reported by the server)"))
    else:
        lines.append(_line("Total cached tokens:", m.total_cached))
        lines.append(f"{'Cache hit rate:':<40} {m.cache_hit_rate * 100:.1f}%")
    return lines


def _finite(x: Any) -> Any:
    """``x`` with every NaN / infinite float replaced by None (strict JSON has neither)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def append_jsonl(path: str, row: dict[str, Any]) -> None:
    """Append ``row`` as one strict-JSON line to ``path`` (its folder must exist)."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(_finite(row), allow_nan=False) + "\n")


def check_writable(flag: str, path: str | None) -> None:
    """Raise ValueError naming ``flag`` when ``path``'s folder does not exist."""
    if path is None:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"{flag}: folder {folder} does not exist ({path})")
    if os.path.isdir(path):
        raise ValueError(f"{flag} is a folder, not a file ({path})")


__all__ = ["append_jsonl", "check_writable", "format_report"]
