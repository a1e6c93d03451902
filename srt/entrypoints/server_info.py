"""What `GET /get_server_info` and `Engine.get_server_info()` report (SGLang's keys).

Keys (SGLang's names where it has them):
- every ServerArgs field (as `dataclasses.asdict`), device-dependent defaults resolved;
- `max_total_num_tokens` (KV slots of the pool), `max_running_requests`, `context_length`,
  `max_req_input_len` (context_length - 1: at least one token is generated), `page_size`;
- `model_config`: architectures, model_type, vocab_size, hidden_size, num_hidden_layers,
  num_attention_heads, num_key_value_heads, head_dim, sliding_window, dtype (a string);
- `internal_states`: one dict per scheduler (one here), a snapshot taken on the caller's
  thread: num_running_reqs, num_waiting_reqs (also as SGLang's metric name num_queue_reqs),
  available_kv_tokens (free slots and the prefix cache's evictable ones), token_usage (share
  of KV slots in use), num_prefill_steps, num_decode_steps, num_overlapped_steps,
  cache_hit_rate (share of prompt tokens taken from the prefix cache);
- `version`: this package's version.
With Engine-spawned TP workers (the model lives in other processes) only the server args,
`internal_states: []` and `version` are known here.
"""

from __future__ import annotations

import dataclasses
from importlib import metadata
from typing import Any

PACKAGE = "sgl-rope-kv"
MODEL_CONFIG_KEYS = (
    "architectures",
    "model_type",
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "sliding_window",
)


def package_version() -> str:
    try:
        return metadata.version(PACKAGE)
    except metadata.PackageNotFoundError:  # a source tree that was never installed
        return "unknown"


def _model_config(cfg: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in MODEL_CONFIG_KEYS:
        value = getattr(cfg, key, None)
        out[key] = list(value) if isinstance(value, tuple) else value
    dtype = getattr(cfg, "dtype", None)
    out["dtype"] = None if dtype is None else str(dtype).removeprefix("torch.")
    return out


def _internal_state(runner: Any, sched: Any) -> dict[str, Any]:
    total = int(runner.max_total_num_tokens)
    free = int(sched.available_kv_size())  # free slots and the prefix cache's evictable ones
    return {
        "num_running_reqs": len(sched.running),
        "num_waiting_reqs": len(sched.waiting),
        "num_queue_reqs": len(sched.waiting),
        "available_kv_tokens": free,
        "token_usage": (total - free) / total if total else 0.0,
        "num_prefill_steps": sched.num_prefill_steps,
        "num_decode_steps": sched.num_decode_steps,
        "num_overlapped_steps": sched.num_overlapped_steps,
        "cache_hit_rate": sched.cache_hit_rate(),
    }


def server_info(engine: Any) -> dict[str, Any]:
    """The dict described in the module docstring (JSON-serialisable)."""
    info: dict[str, Any] = dataclasses.asdict(engine.server_args)
    runner = getattr(engine, "model_runner", None)
    sched = getattr(engine, "scheduler", None)
    states = []
    if runner is not None:
        ctx = int(runner.context_len)
        info.update(
            max_total_num_tokens=int(runner.max_total_num_tokens),
            max_running_requests=int(runner.max_running_requests),
            context_length=ctx,
            max_req_input_len=ctx - 1,
            page_size=int(runner.page_size),
            model_config=_model_config(runner.model_config),
        )
        if sched is not None:
            states.append(_internal_state(runner, sched))
    info["internal_states"] = states
    info["version"] = package_version()
    return info


__all__ = ["package_version", "server_info"]
