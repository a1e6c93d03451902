"""What `GET /get_server_info` and `Engine.get_server_info()` report (SGLang's keys).

The engine's resolved ServerArgs, with the values resolved at start-up filled in
(`context_length`, `max_total_num_tokens`, `max_running_requests`, `max_req_input_len`), the
scheduler's load under `internal_states`, and the package version.
"""

from __future__ import annotations

import dataclasses
from importlib import metadata
from typing import Any

DISTRIBUTION = "sgl-rope-kv"


def package_version() -> str:
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:  # run from a source tree that is not installed
        return "unknown"


def server_info(engine: Any) -> dict[str, Any]:
    """The server information of `engine` (JSON-ready: plain values, lists, dicts)."""
    info: dict[str, Any] = dataclasses.asdict(engine.server_args)
    runner = getattr(engine, "model_runner", None)
    if runner is not None:
        info["context_length"] = int(runner.context_len)
        info["max_req_input_len"] = int(runner.context_len) - 1
        info["max_total_num_tokens"] = int(runner.max_total_num_tokens)
        info["max_running_requests"] = int(runner.max_running_requests)
    sched = getattr(engine, "scheduler", None)
    state: dict[str, Any] = {}
    if sched is not None:
        state = {"num_running_reqs": len(sched.running), "num_queue_reqs": len(sched.waiting)}
    info["internal_states"] = [state]
    info["version"] = package_version()
    return info


__all__ = ["package_version", "server_info"]
