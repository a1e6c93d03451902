"""Collectives over the TP group (no-ops at TP 1). All are CUDA-graph capturable on NCCL: no
host syncs, no list-of-tensors gathers on the device path."""

from __future__ import annotations

import torch
import torch.distributed as dist

from srt.distributed.parallel_state import get_tp_group, get_tp_size


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the TP ranks, in place; returns `x` (any shape/dtype)."""
    if get_tp_size() == 1:
        return x
    dist.all_reduce(x, group=get_tp_group().group)
    return x


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim` in rank order: [..., n, ...] -> [..., tp*n, ...]."""
    tp = get_tp_size()
    if tp == 1:
        return x
    grp = get_tp_group()
    dim = dim % x.dim()
    x = x.contiguous()
    if grp.backend == "nccl":
        out = x.new_empty((tp, *x.shape))  # [tp, *x.shape]
        dist.all_gather_into_tensor(out, x, group=grp.group)
        parts = list(out.unbind(0))
    else:  # gloo has no all_gather_into_tensor
        parts = [torch.empty_like(x) for _ in range(tp)]
        dist.all_gather(parts, x, group=grp.group)
    return torch.cat(parts, dim=dim)


def tensor_model_parallel_broadcast(x: torch.Tensor, src: int = 0) -> torch.Tensor:
    """Overwrite `x` on every rank with rank `src`'s copy (in place); returns `x`."""
    if get_tp_size() == 1:
        return x
    dist.broadcast(x, src=src, group=get_tp_group().group)
    return x


def tensor_model_parallel_min_int(value: int, device: torch.device | str = "cpu") -> int:
    """The smallest `value` over the TP ranks (host sync; for start-up decisions such as the KV
    pool size, which every rank must agree on)."""
    if get_tp_size() == 1:
        return int(value)
    grp = get_tp_group()
    if grp.backend == "nccl":
        device = torch.device("cuda", grp.local_rank)
    t = torch.tensor([int(value)], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=grp.group)
    return int(t.item())
