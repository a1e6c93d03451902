"""Tensor parallelism over torch.distributed (NCCL on GPUs, gloo on CPU): the TP group and its
collectives, as in SGLang's `srt/distributed`."""

from srt.distributed.communication_op import (
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
    tensor_model_parallel_broadcast,
    tensor_model_parallel_min_int,
)
from srt.distributed.parallel_state import (
    destroy_distributed_environment,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    get_tp_group,
    get_tp_local_rank,
    get_tp_rank,
    get_tp_size,
    init_distributed_environment,
    launched_by_torchrun,
    model_parallel_is_initialized,
    resolve_tp,
    set_multicast_off_env,
    torchrun_world_size,
)
from srt.distributed.utils import get_pp_group, get_pp_indices

__all__ = [
    "destroy_distributed_environment",
    "get_pp_group",
    "get_pp_indices",
    "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_world_size",
    "get_tp_group",
    "get_tp_local_rank",
    "get_tp_rank",
    "get_tp_size",
    "init_distributed_environment",
    "launched_by_torchrun",
    "model_parallel_is_initialized",
    "resolve_tp",
    "set_multicast_off_env",
    "tensor_model_parallel_all_gather",
    "tensor_model_parallel_all_reduce",
    "tensor_model_parallel_broadcast",
    "tensor_model_parallel_min_int",
    "torchrun_world_size",
]
