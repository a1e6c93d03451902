"""The server's Prometheus metrics (`GET /metrics`), in the text exposition format.

SGLang's metric names and `model_name` label, no client library: counters of finished requests
and their prompt / generated tokens, counted by the HTTP layer as each output ends, and gauges
of the scheduler's running and waiting requests and of the KV pool in use, read when scraped.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# name -> help text, in the order /metrics lists them.
COUNTERS = {
    "sglang:num_requests_total": "Number of requests processed.",
    "sglang:num_aborted_requests_total": "Number of requests aborted or rejected.",
    "sglang:prompt_tokens_total": "Number of prefill tokens processed.",
    "sglang:generation_tokens_total": "Number of generation tokens processed.",
}
GAUGES = {
    "sglang:num_running_reqs": "The number of running requests.",
    "sglang:num_queue_reqs": "The number of requests in the waiting queue.",
    "sglang:token_usage": "The fraction of KV-cache token slots in use.",
}


@dataclass(frozen=True)
class SchedulerLoad:
    """What the gauges show, read from the engine when /metrics is scraped."""

    running: int
    queued: int
    token_usage: float


def scheduler_load(engine: Any) -> SchedulerLoad | None:
    """The running / waiting request counts and the KV pool's used fraction; None where the
    engine's scheduler runs in worker processes. Read from another thread: a snapshot."""
    sched = getattr(engine, "scheduler", None)
    runner = getattr(engine, "model_runner", None)
    if sched is None or runner is None:
        return None
    total = int(getattr(runner, "max_total_num_tokens", 0) or 0)
    # in use: neither free nor held by the prefix cache unlocked (SGLang's token usage)
    usage = 0.0 if total <= 0 else max(0.0, 1.0 - sched.available_kv_size() / total)
    return SchedulerLoad(len(sched.running), len(sched.waiting), usage)


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class ServerMetrics:
    """Counters of one server (thread-safe)."""

    def __init__(self, model_name: str) -> None:
        self.labels = f'{{model_name="{_label(model_name)}"}}'
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(COUNTERS, 0)

    def observe(self, output: dict[str, Any]) -> None:
        """Count one finished output (a result dict of Engine.generate, error entries too)."""
        meta = output.get("meta_info") or {}
        reason = meta.get("finish_reason") or {}
        with self._lock:
            self._counts["sglang:num_requests_total"] += 1
            if "error" in output or reason.get("type") == "abort":
                self._counts["sglang:num_aborted_requests_total"] += 1
            self._counts["sglang:prompt_tokens_total"] += int(meta.get("prompt_tokens") or 0)
            self._counts["sglang:generation_tokens_total"] += int(
                meta.get("completion_tokens") or 0
            )

    def render(self, load: SchedulerLoad | None) -> str:
        """The exposition text: every counter, and the gauges when `load` is known."""
        with self._lock:
            counts = dict(self._counts)
        lines = []
        for name, doc in COUNTERS.items():
            lines += [f"# HELP {name} {doc}", f"# TYPE {name} counter"]
            lines.append(f"{name}{self.labels} {counts[name]}")
        if load is not None:
            values = (load.running, load.queued, load.token_usage)
            for (name, doc), value in zip(GAUGES.items(), values, strict=True):
                lines += [f"# HELP {name} {doc}", f"# TYPE {name} gauge"]
                lines.append(f"{name}{self.labels} {value}")
        return "\n".join(lines) + "\n"


__all__ = ["CONTENT_TYPE", "SchedulerLoad", "ServerMetrics", "scheduler_load"]
