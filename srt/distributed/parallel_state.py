"""The tensor-parallel (TP) group: one process per rank, every rank holding a shard of the model.

`init_distributed_environment(tp_size, rank, ...)` starts torch.distributed (NCCL on CUDA, gloo
on CPU) and makes the whole world the TP group; `destroy_distributed_environment()` ends it.
The runner asks `get_tp_rank()` / `get_tp_size()` once and passes them to the model it builds;
layers take `tp_rank` / `tp_size` explicitly and never read the group themselves.

NCCL all-reduce through torch.distributed is capturable in a CUDA graph once the communicator
exists, so initialisation runs one warm-up all-reduce on the device before any capture.

NVLink multicast (NVLS) and symmetric-memory multicast are always switched off: the shared GPU
hosts this runs on require it (`set_multicast_off_env`, called before the group is created).

torchrun's variables (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) are read here, when
asked (`launched_by_torchrun`, `torchrun_world_size`), not through `srt.settings`: they describe
how this process was started, and torch.distributed's env:// start reads the same ones.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

MULTICAST_OFF_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


@dataclass(frozen=True)
class TPGroup:
    """rank / world size of this process in the TP group, its backend and local device index."""

    rank: int
    world_size: int
    backend: str
    local_rank: int
    group: Any = None  # the ProcessGroup (None: the default group)
    owns_default_group: bool = False


_TP: TPGroup | None = None


def set_multicast_off_env() -> None:
    """NCCL_NVLS_ENABLE=0 and TORCH_SYMM_MEM_DISABLE_MULTICAST=1 in this process's environment."""
    os.environ.update(MULTICAST_OFF_ENV)


def launched_by_torchrun() -> bool:
    """True when torchrun (or torch.distributed.launch) started this process (env:// init)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def torchrun_world_size() -> int | None:
    """torchrun's WORLD_SIZE (None when torchrun did not start this process)."""
    return int(os.environ["WORLD_SIZE"]) if launched_by_torchrun() else None


def init_distributed_environment(
    world_size: int,
    rank: int | None = None,
    init_method: str = "env://",
    backend: str | None = None,
    local_rank: int | None = None,
    timeout_s: float = 600.0,
) -> TPGroup:
    """Start torch.distributed (unless already started) and make the world the TP group.

    Parameters
    ----------
    world_size : number of TP ranks (= processes).
    rank : this process's rank (None: $RANK, as set by torchrun).
    init_method : "env://" (torchrun's MASTER_ADDR/PORT) or "tcp://host:port".
    backend : "nccl" or "gloo" (None: nccl when CUDA is available, else gloo).
    local_rank : CUDA device index of this rank (None: $LOCAL_RANK, else rank).
    timeout_s : collective timeout (a rank that stops answering fails the others).

    Returns
    -------
    The TPGroup.
    """
    global _TP
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if rank is None:
        rank = int(os.environ.get("RANK", "0"))
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", str(rank)))
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside [0, {world_size})")
    if _TP is not None:
        if (_TP.rank, _TP.world_size) != (rank, world_size):
            raise RuntimeError(
                f"TP group already initialised as rank {_TP.rank} of {_TP.world_size}"
            )
        return _TP
    set_multicast_off_env()
    owns = False
    if not dist.is_initialized():
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        kw: dict[str, Any] = {}
        if backend == "nccl":
            torch.cuda.set_device(local_rank)
            kw["device_id"] = torch.device("cuda", local_rank)
        dist.init_process_group(
            backend,
            init_method=init_method,
            world_size=world_size,
            rank=rank,
            timeout=datetime.timedelta(seconds=timeout_s),
            **kw,
        )
        owns = True
    elif dist.get_world_size() != world_size or dist.get_rank() != rank:
        raise RuntimeError(
            f"torch.distributed runs rank {dist.get_rank()} of {dist.get_world_size()}, "
            f"asked for rank {rank} of {world_size}"
        )
    backend = dist.get_backend()
    _TP = TPGroup(rank, world_size, backend, local_rank, None, owns)
    if backend == "nccl":  # create the communicator now, before any CUDA-graph capture
        warm = torch.ones(1, device=torch.device("cuda", local_rank))
        dist.all_reduce(warm)
        torch.cuda.synchronize(local_rank)
    else:
        dist.barrier()
    return _TP


def destroy_distributed_environment() -> None:
    """Forget the TP group; destroy the process group if this module created it."""
    global _TP
    tp, _TP = _TP, None
    if tp is not None and tp.owns_default_group and dist.is_initialized():
        dist.destroy_process_group()


def model_parallel_is_initialized() -> bool:
    return _TP is not None


def get_tp_group() -> TPGroup:
    if _TP is None:
        raise RuntimeError("the TP group is not initialised (init_distributed_environment)")
    return _TP


def get_tp_rank() -> int:
    """This process's TP rank (0 without a group)."""
    return _TP.rank if _TP is not None else 0


def get_tp_size() -> int:
    """The TP world size (1 without a group)."""
    return _TP.world_size if _TP is not None else 1


def resolve_tp(tp_rank: int | None = 0, tp_size: int | None = 1) -> tuple[int, int]:
    """A layer's (tp_rank, tp_size), checked (0 <= rank < size). None stands for rank 0 / size 1:
    the TP group is not consulted (models get each rank's position passed in)."""
    rank = 0 if tp_rank is None else int(tp_rank)
    size = 1 if tp_size is None else int(tp_size)
    if not 0 <= rank < size:
        raise ValueError(f"tp_rank {rank} outside [0, tp_size={size})")
    return rank, size


def get_tp_local_rank() -> int:
    """CUDA device index of this rank (0 without a group)."""
    return _TP.local_rank if _TP is not None else 0


# SGLang's spellings
get_tensor_model_parallel_rank = get_tp_rank
get_tensor_model_parallel_world_size = get_tp_size
