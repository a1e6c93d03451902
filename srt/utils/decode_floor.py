"""The read floor of a decode step: the bytes it must read over the measured copy bandwidth.

A decode step of a batch of ``bs`` requests reads every weight once (except the rows of an untied
input embedding it does not look up, and, in a mixture of experts, the experts no token picks)
and the K/V of every cached token of every layer (a sliding-window layer: the window only). With
the device-copy bandwidth measured once by `measure_copy_bandwidth` (a 1 GiB copy, counted as
read + write bytes, the same convention as benchmarks/gpu_run.sh `info`), the floor is
(weight bytes + KV bytes) / bandwidth. CPU runs have no floor (None).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

import torch

# Parameters of a routed-experts module (srt/layers/moe.py): the first dim is the expert.
EXPERT_PARAM_SUFFIXES = (
    "w13_weight",
    "w2_weight",
    "w13_bias",
    "w2_bias",
    "w13_weight_scale",  # MXFP4 experts (packed on CUDA)
    "w2_weight_scale",
)


@dataclass(frozen=True)
class DecodeReads:
    """Bytes one decode step reads, split by kind."""

    weight_bytes: int  # weights actually read at this batch size
    kv_bytes: int  # K and V of the cached tokens every layer attends to

    @property
    def total(self) -> int:
        return self.weight_bytes + self.kv_bytes


def measure_copy_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> float | None:
    """Device-copy bandwidth in bytes/s (read + write bytes over the median copy time).

    Returns None on a non-CUDA device or when the two buffers do not fit.
    """
    if device.type != "cuda":
        return None
    try:
        x = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
        y = torch.empty_like(x)
    except torch.cuda.OutOfMemoryError:
        return None
    for _ in range(5):  # warm-up
        y.copy_(x)
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        y.copy_(x)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del x, y
    torch.cuda.empty_cache()
    return 2 * (nbytes // 4) * 4 / statistics.median(times)


def expert_read_fraction(batch_size: int, num_experts: int, top_k: int) -> float:
    """Expected share of experts at least one of ``batch_size`` tokens routes to (uniform)."""
    if num_experts <= 0 or top_k <= 0:
        return 1.0
    return 1.0 - (1.0 - min(top_k, num_experts) / num_experts) ** batch_size


def weight_bytes_read(model: torch.nn.Module, model_config: Any, batch_size: int) -> int:
    """Weight bytes one decode step of ``batch_size`` tokens reads (this rank's parameters)."""
    frac = expert_read_fraction(
        batch_size,
        int(getattr(model_config, "num_local_experts", 0) or 0),
        int(getattr(model_config, "num_experts_per_tok", 0) or 0),
    )
    tied = bool(getattr(model_config, "tie_word_embeddings", False))
    total = 0.0
    for name, p in model.named_parameters():
        nbytes = p.numel() * p.element_size()
        if name.endswith("embed_tokens.weight") and not tied and p.dim() == 2:
            total += min(batch_size, p.shape[0]) * p.shape[1] * p.element_size()  # rows looked up
        elif name.endswith(EXPERT_PARAM_SUFFIXES):
            total += nbytes * frac
        else:
            total += nbytes
    return int(total)


def kv_bytes_read(runner: Any, batch_size: int, seq_len: int) -> int:
    """K/V bytes a decode step reads when each of ``batch_size`` requests holds ``seq_len``
    tokens (the new one included), over all layers (sliding-window layers: the window)."""
    cfg = runner.model_config
    layers = int(cfg.num_hidden_layers)
    heads = max(1, int(cfg.num_key_value_heads) // int(getattr(runner, "tp_size", 1)))  # local
    head_dim = int(cfg.head_dim)
    v_head_dim = int(getattr(cfg, "v_head_dim", None) or head_dim)
    elem = torch.empty((), dtype=runner.kv_dtype).element_size()
    per_token_layer = heads * (head_dim + v_head_dim) * elem
    tokens = 0
    for layer in range(layers):
        window = cfg.get_window_left(layer) + 1 if hasattr(cfg, "get_window_left") else 0
        tokens += min(seq_len, window) if window > 0 else seq_len
    return batch_size * tokens * per_token_layer


def decode_reads(runner: Any, batch_size: int, seq_len: int) -> DecodeReads:
    """Weight and KV bytes of one decode step (see the module docstring)."""
    return DecodeReads(
        weight_bytes_read(runner.model, runner.model_config, batch_size),
        kv_bytes_read(runner, batch_size, seq_len),
    )


__all__ = [
    "DecodeReads",
    "decode_reads",
    "expert_read_fraction",
    "kv_bytes_read",
    "measure_copy_bandwidth",
    "weight_bytes_read",
]
