"""Linear layers with SGLang's names, signatures and tensor parallelism, shard-aware loaders.

Each layer returns `(output, output_bias)` like SGLang (output_bias is None unless
`skip_bias_add`). Parameters carry a `weight_loader(param, loaded_weight, shard_id=None)` so a
model's `load_weights` can put checkpoint tensors (q_proj, k_proj, v_proj / gate_proj, up_proj)
into the packed parameters; shard_id=None takes the full packed tensor of a TP-1 model.

Constructors take SGLang's arguments in SGLang's order (an unmodified SGLang model file builds
them): `quant_config` (None, or a config that leaves linear layers unquantized; anything else
raises at build time), `prefix`, `parallel_group` ("tp" / "attn_tp": the TP group, the same
without DP attention; "replicated": TP 1), `reduce_results`, `gather_output`, ... Options srt
lacks (`use_presharded_weights`, another `kv_parallel_group`) raise at build time, naming them.

Tensor parallelism (tp_rank / tp_size passed by the model as keywords; default TP 1): column
layers keep rows [tp_rank * out/tp, (tp_rank+1) * out/tp) of each packed shard, row layers the
matching input columns and all-reduce their partial outputs (bias added once, after the sum).
QKV replicates KV heads when tp_size exceeds their number.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn

from srt.distributed import (
    get_tp_rank,
    get_tp_size,
    resolve_tp,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from srt.distributed.utils import LogicalGroup
from srt.layers.gemm_choice import dispatch_linear
from srt.layers.quantization.base_config import QuantizationConfig, require_unquantized

if TYPE_CHECKING:
    from srt.model_executor.forward_batch_info import ForwardBatch

# SGLang's group names. Without DP attention the attention-TP group is the TP group.
LinearParallelGroup = Literal["tp", "attn_tp", "replicated"]
PARALLEL_GROUPS = ("tp", "attn_tp", "replicated")


def _check_loaded(name: str, param: torch.Tensor, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(
            f"{name}: checkpoint tensor has shape {tuple(loaded.shape)}, "
            f"parameter expects {tuple(param.shape)}"
        )


def _group_tp(parallel_group: str | None, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """A layer's (tp_rank, tp_size) for its parallel_group: the given ones, or TP 1 replicated."""
    if parallel_group not in (None, *PARALLEL_GROUPS):
        raise ValueError(
            f"parallel_group must be one of {PARALLEL_GROUPS} or None, got {parallel_group!r}"
        )
    if parallel_group == "replicated":
        return 0, 1
    return resolve_tp(tp_rank, tp_size)


def resolve_linear_parallel_group(parallel_group: LinearParallelGroup) -> tuple[int, int]:
    """(rank, size) of a group in this process: the TP group for "tp" / "attn_tp" (rank 0 of 1
    without one), (0, 1) for "replicated"."""
    return _group_tp(parallel_group, get_tp_rank(), get_tp_size())


def _refuse(flag: bool, name: str) -> None:
    if flag:
        raise NotImplementedError(f"{name}=True is not supported by srt's linear layers")


class LinearBase(nn.Module):
    """y = x W^T (+ b). weight: [output_size_per_partition, input_size_per_partition].

    Parameters (SGLang's order)
    ----------
    input_size, output_size : full (TP-1) sizes.
    skip_bias_add : return the bias beside the output instead of adding it.
    params_dtype : parameter dtype (default: torch's default dtype).
    quant_config : None or a config that leaves linear layers unquantized.
    prefix : the layer's name in the model (messages).
    bias, tp_rank, tp_size, parallel_group : keywords (see the module docstring).
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        skip_bias_add: bool = False,
        params_dtype: torch.dtype | None = None,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
        *,
        bias: bool = True,
        tp_rank: int = 0,
        tp_size: int = 1,
        parallel_group: LinearParallelGroup | None = None,
    ) -> None:
        super().__init__()
        require_unquantized(quant_config, "linear", prefix)
        self.input_size, self.output_size = input_size, output_size
        self.skip_bias_add = skip_bias_add
        self.tp_rank, self.tp_size = _group_tp(parallel_group, tp_rank, tp_size)
        self.parallel_group = parallel_group
        self.params_dtype = params_dtype or torch.get_default_dtype()
        self.quant_config = quant_config
        self.prefix = prefix
        self._has_bias = bias
        self._gather = False  # column layers with gather_output at tp > 1 all-gather outputs

    @property
    def tp_group(self) -> LogicalGroup:
        """This layer's weight partition (SGLang's `tp_group`; see `get_group_rank_size`)."""
        return LogicalGroup(self.tp_rank, self.tp_size)

    def _create(self, out_part: int, in_part: int) -> None:
        self.weight = nn.Parameter(
            torch.empty(out_part, in_part, dtype=self.params_dtype), requires_grad=False
        )
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        if self._has_bias:
            self.bias = nn.Parameter(
                torch.empty(out_part, dtype=self.params_dtype), requires_grad=False
            )
            self.bias.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        else:
            self.register_parameter("bias", None)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None
    ) -> None:
        _check_loaded(self.prefix or type(self).__name__, param, loaded_weight)
        param.data.copy_(loaded_weight)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x: [..., in] -> ([..., out_part] (all ranks' parts with gather_output), bias or None)."""
        p: dict[str, Any] = self._parameters  # read directly: no nn.Module.__getattr__ per call
        bias = p["bias"]
        if self._gather:
            out = dispatch_linear(x, p["weight"], None if self.skip_bias_add else bias)
            out = tensor_model_parallel_all_gather(out, dim=-1)
            return out, bias if self.skip_bias_add else None
        if self.skip_bias_add:
            return dispatch_linear(x, p["weight"]), bias
        return dispatch_linear(x, p["weight"], bias), None  # F.linear unless gemm_choice says so


class ReplicatedLinear(LinearBase):
    """The full weight on every rank."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = True,
        skip_bias_add: bool = False,
        params_dtype: torch.dtype | None = None,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__(
            input_size, output_size, skip_bias_add, params_dtype, quant_config, prefix, bias=bias
        )
        self._create(output_size, input_size)


class ColumnParallelLinear(LinearBase):
    """Output dim split over ranks; weight [out / tp, in]. gather_output concatenates the ranks'
    outputs (all-gather) instead of leaving each its slice."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = True,
        gather_output: bool = False,
        skip_bias_add: bool = False,
        params_dtype: torch.dtype | None = None,
        quant_config: QuantizationConfig | None = None,
        output_sizes: list[int] | None = None,
        prefix: str = "",
        *,
        use_presharded_weights: bool = False,
        skip_block_quant_check: bool = False,  # no block quantization here: nothing to check
        parallel_group: LinearParallelGroup | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        _refuse(use_presharded_weights, "use_presharded_weights")
        super().__init__(
            input_size,
            output_size,
            skip_bias_add,
            params_dtype,
            quant_config,
            prefix,
            bias=bias,
            tp_rank=tp_rank,
            tp_size=tp_size,
            parallel_group=parallel_group,
        )
        if output_size % self.tp_size:
            raise ValueError(f"output_size {output_size} not divisible by tp_size {self.tp_size}")
        self.gather_output = gather_output
        self._gather = gather_output and self.tp_size > 1
        if output_sizes is not None and not hasattr(self, "output_sizes"):
            self.output_sizes = list(output_sizes)
        self._create(output_size // self.tp_size, input_size)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None
    ) -> None:
        n = param.shape[0]
        part = loaded_weight.narrow(0, self.tp_rank * n, n) if self.tp_size > 1 else loaded_weight
        super().weight_loader(param, part)


class RowParallelLinear(LinearBase):
    """Input dim split over ranks (the all-reduce of partial outputs goes here once tp > 1).

    reduce_results=False leaves each rank its partial sum (the caller reduces: SGLang's layer
    boundaries do); input_is_parallel=False takes the full input and keeps this rank's columns.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = True,
        input_is_parallel: bool = True,
        skip_bias_add: bool = False,
        params_dtype: torch.dtype | None = None,
        reduce_results: bool = True,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
        *,
        use_presharded_weights: bool = False,
        use_dp_attention_reduce: bool = False,
        parallel_group: LinearParallelGroup | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        _refuse(use_presharded_weights, "use_presharded_weights")
        if use_dp_attention_reduce:
            raise NotImplementedError("use_dp_attention_reduce=True needs DP attention")
        super().__init__(
            input_size,
            output_size,
            skip_bias_add,
            params_dtype,
            quant_config,
            prefix,
            bias=bias,
            tp_rank=tp_rank,
            tp_size=tp_size,
            parallel_group=parallel_group,
        )
        if input_size % self.tp_size:
            raise ValueError(f"input_size {input_size} not divisible by tp_size {self.tp_size}")
        self.input_is_parallel = input_is_parallel
        self.reduce_results = reduce_results
        self._create(output_size, input_size // self.tp_size)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None
    ) -> None:
        if self.tp_size > 1 and param.ndim == 2:
            n = param.shape[1]
            loaded_weight = loaded_weight.narrow(1, self.tp_rank * n, n)
        super().weight_loader(param, loaded_weight)

    def forward(
        self,
        input_: torch.Tensor,
        skip_all_reduce: bool = False,
        forward_batch: ForwardBatch | None = None,
        output_tensor: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """input_: [..., in / tp] (this rank's columns; [..., in] with input_is_parallel=False)
        -> ([..., out], bias or None).

        With reduce_results=False or skip_all_reduce=True the output is this rank's partial sum,
        bias on rank 0 only. forward_batch is SGLang's hint for DP-attention reductions (none
        here, so it changes nothing). output_tensor, if given, receives the result.
        """
        p: dict[str, Any] = self._parameters  # read directly: no nn.Module.__getattr__ per call
        bias = p["bias"]
        if self.tp_size == 1 and not self.skip_bias_add and output_tensor is None:
            return dispatch_linear(input_, p["weight"], bias), None  # bias in the GEMM: 1 launch
        x = input_
        if not self.input_is_parallel and self.tp_size > 1:
            n = x.shape[-1] // self.tp_size
            x = x.narrow(-1, self.tp_rank * n, n)
        out = dispatch_linear(x, p["weight"])  # [..., out], partial over ranks when tp > 1
        reduce = self.reduce_results and not skip_all_reduce
        if self.tp_size > 1 and reduce:
            out = tensor_model_parallel_all_reduce(out)
        out_bias = None
        if self.skip_bias_add:
            out_bias = bias
        elif bias is not None and (reduce or self.tp_rank == 0):
            out = out + bias
        if output_tensor is not None:
            output_tensor.copy_(out)
            out = output_tensor
        return out, out_bias


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matmul (e.g. gate_proj and up_proj).

    weight: [sum(output_sizes) / tp, in]: this rank's rows of shard 0, then of shard 1, ...
    shard_id is the index (0, 1, ...); None loads the full packed tensor [sum(output_sizes), in].
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool = True,
        gather_output: bool = False,
        skip_bias_add: bool = False,
        params_dtype: torch.dtype | None = None,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
        *,
        use_presharded_weights: bool = False,
        parallel_group: LinearParallelGroup | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        self.output_sizes = list(output_sizes)
        super().__init__(
            input_size,
            sum(output_sizes),
            bias,
            gather_output,
            skip_bias_add,
            params_dtype,
            quant_config,
            None,
            prefix,
            use_presharded_weights=use_presharded_weights,
            parallel_group=parallel_group,
            tp_rank=tp_rank,
            tp_size=tp_size,
        )
        if any(n % self.tp_size for n in self.output_sizes):
            raise ValueError(f"output_sizes {output_sizes} not divisible by tp_size {self.tp_size}")

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None
    ) -> None:
        if shard_id is None:  # already packed in the checkpoint: split it into its shards
            full = (sum(self.output_sizes), *param.shape[1:])
            if tuple(loaded_weight.shape) != full:
                raise ValueError(
                    f"{self.prefix or 'merged linear'}: checkpoint tensor has shape "
                    f"{tuple(loaded_weight.shape)}, packed parameter expects {full}"
                )
            offset = 0
            for i, n in enumerate(self.output_sizes):
                self.weight_loader(param, loaded_weight.narrow(0, offset, n), i)
                offset += n
            return
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"{self.prefix}: bad shard_id {shard_id!r}")
        size = self.output_sizes[shard_id] // self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        if self.tp_size > 1 and loaded_weight.shape[0] == self.output_sizes[shard_id]:
            loaded_weight = loaded_weight.narrow(0, self.tp_rank * size, size)
        dst = param.data.narrow(0, offset, size)  # rows of this shard (view)
        _check_loaded(f"{self.prefix}[shard {shard_id}]", dst, loaded_weight)
        dst.copy_(loaded_weight)


class QKVParallelLinear(ColumnParallelLinear):
    """Packed q, k, v projections: weight [(Hq + 2 * Hkv) * D / tp, hidden], rows q | k | v.

    shard_id is "q", "k" or "v"; None loads the full packed tensor of a TP-1 model. tp_size must
    divide the query heads; KV heads are split when tp_size divides them, else replicated
    (tp_size a multiple of them: ranks r with the same r // (tp / Hkv) share a KV head).
    """

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: int | None = None,
        bias: bool = True,
        skip_bias_add: bool = False,
        params_dtype: torch.dtype | None = None,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
        *,
        load_presharded_attn: bool = False,
        v_head_size: int | None = None,
        skip_block_quant_check: bool = False,  # no block quantization here: nothing to check
        parallel_group: LinearParallelGroup | None = None,
        kv_parallel_group: LinearParallelGroup | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        _refuse(load_presharded_attn, "load_presharded_attn")
        if kv_parallel_group not in (None, parallel_group):
            raise NotImplementedError(
                f"kv_parallel_group {kv_parallel_group!r} other than parallel_group "
                f"{parallel_group!r} is not supported"
            )
        total_num_kv_heads = total_num_kv_heads or total_num_heads
        tp_rank, tp_size = _group_tp(parallel_group, tp_rank, tp_size)
        if total_num_heads % tp_size:
            raise ValueError(f"tp_size {tp_size} must divide num_heads {total_num_heads}")
        if total_num_kv_heads % tp_size and tp_size % total_num_kv_heads:
            raise ValueError(
                f"tp_size {tp_size} must divide num_kv_heads {total_num_kv_heads} or be a "
                "multiple of it (replicated KV heads)"
            )
        self.head_size = head_size
        self.v_head_size = v_head_size or head_size
        self.total_num_heads, self.total_num_kv_heads = total_num_heads, total_num_kv_heads
        self.num_heads = total_num_heads // tp_size
        self.num_kv_heads = max(1, total_num_kv_heads // tp_size)
        self.num_kv_head_replicas = max(1, tp_size // total_num_kv_heads)
        # The local output is (Hq/tp + 2 * Hkv_local) heads; ColumnParallel divides by tp.
        out = (self.num_heads + self.num_kv_heads) * head_size
        out += self.num_kv_heads * self.v_head_size
        super().__init__(
            hidden_size,
            out * tp_size,
            bias,
            False,
            skip_bias_add,
            params_dtype,
            quant_config,
            None,
            prefix,
            parallel_group=parallel_group,
            tp_rank=tp_rank,
            tp_size=tp_size,
        )
        self.q_size = self.num_heads * head_size
        self.kv_size = self.num_kv_heads * head_size
        self.v_size = self.num_kv_heads * self.v_head_size

    def _shard(self, shard_id: str) -> tuple[int, int, int, int]:
        """(offset in param, local size, full size, shard rank) of q, k or v."""
        kv_rank = self.tp_rank // self.num_kv_head_replicas
        full_kv = self.total_num_kv_heads
        return {
            "q": (0, self.q_size, self.total_num_heads * self.head_size, self.tp_rank),
            "k": (self.q_size, self.kv_size, full_kv * self.head_size, kv_rank),
            "v": (self.q_size + self.kv_size, self.v_size, full_kv * self.v_head_size, kv_rank),
        }[shard_id]

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None
    ) -> None:
        if shard_id is None:  # packed [(Hq + 2 Hkv) * D, ...] of a TP-1 model
            offset = 0
            for s in "qkv":
                n = self._shard(s)[2]
                if offset + n > loaded_weight.shape[0]:
                    break  # too short: the shape check below names it
                self.weight_loader(param, loaded_weight.narrow(0, offset, n), s)
                offset += n
            if offset != loaded_weight.shape[0] or offset == 0:
                raise ValueError(
                    f"{self.prefix or 'qkv'}: packed checkpoint tensor has "
                    f"{loaded_weight.shape[0]} rows, expected "
                    f"{sum(self._shard(s)[2] for s in 'qkv')}"
                )
            return
        if shard_id not in ("q", "k", "v"):
            raise ValueError(f"{self.prefix}: shard_id must be 'q', 'k' or 'v', got {shard_id!r}")
        offset, size, full, rank = self._shard(shard_id)
        if self.tp_size > 1 and loaded_weight.shape[0] == full:
            loaded_weight = loaded_weight.narrow(0, rank * size, size)
        dst = param.data.narrow(0, offset, size)  # rows of this shard (view)
        _check_loaded(f"{self.prefix}[{shard_id}]", dst, loaded_weight)
        dst.copy_(loaded_weight)
