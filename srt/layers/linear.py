"""Linear layers with SGLang's names, shard-aware weight loaders, tp_size = 1 for now.

Each layer returns `(output, output_bias)` like SGLang (output_bias is None unless
`skip_bias_add`). Parameters carry a `weight_loader(param, loaded_weight, shard_id=None)` so a
model's `load_weights` can put checkpoint tensors (q_proj, k_proj, v_proj / gate_proj, up_proj)
into the packed parameters. Tensor parallelism: column layers keep rows
[tp_rank * out/tp, (tp_rank+1) * out/tp) of each shard, row layers the matching input columns;
only tp_size = 1 is exercised today.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _check_loaded(name: str, param: torch.Tensor, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(
            f"{name}: checkpoint tensor has shape {tuple(loaded.shape)}, "
            f"parameter expects {tuple(param.shape)}"
        )


class LinearBase(nn.Module):
    """y = x W^T (+ b). weight: [output_size_per_partition, input_size_per_partition]."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = True,
        skip_bias_add: bool = False,
        params_dtype: torch.dtype | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
        prefix: str = "",
    ) -> None:
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self.skip_bias_add = skip_bias_add
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.params_dtype = params_dtype or torch.get_default_dtype()
        self.prefix = prefix
        self._has_bias = bias

    def _create(self, out_part: int, in_part: int) -> None:
        self.weight = nn.Parameter(
            torch.empty(out_part, in_part, dtype=self.params_dtype), requires_grad=False
        )
        self.weight.weight_loader = self.weight_loader
        if self._has_bias:
            self.bias = nn.Parameter(
                torch.empty(out_part, dtype=self.params_dtype), requires_grad=False
            )
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None
    ) -> None:
        _check_loaded(self.prefix or type(self).__name__, param, loaded_weight)
        param.data.copy_(loaded_weight)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x: [..., in] -> ([..., out_part], bias or None)."""
        bias = None if self.skip_bias_add else self.bias
        out = F.linear(x, self.weight, bias)
        return out, (self.bias if self.skip_bias_add else None)


class ReplicatedLinear(LinearBase):
    """The full weight on every rank."""

    def __init__(self, input_size: int, output_size: int, **kw) -> None:
        super().__init__(input_size, output_size, **kw)
        self._create(output_size, input_size)


class ColumnParallelLinear(LinearBase):
    """Output dim split over ranks; weight [out / tp, in]."""

    def __init__(self, input_size: int, output_size: int, **kw) -> None:
        super().__init__(input_size, output_size, **kw)
        if output_size % self.tp_size:
            raise ValueError(f"output_size {output_size} not divisible by tp_size {self.tp_size}")
        self._create(output_size // self.tp_size, input_size)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None
    ) -> None:
        n = param.shape[0]
        part = loaded_weight.narrow(0, self.tp_rank * n, n) if self.tp_size > 1 else loaded_weight
        super().weight_loader(param, part)


class RowParallelLinear(LinearBase):
    """Input dim split over ranks (the all-reduce of partial outputs goes here once tp > 1)."""

    def __init__(self, input_size: int, output_size: int, reduce_results: bool = True, **kw):
        super().__init__(input_size, output_size, **kw)
        if input_size % self.tp_size:
            raise ValueError(f"input_size {input_size} not divisible by tp_size {self.tp_size}")
        self.reduce_results = reduce_results
        self._create(output_size, input_size // self.tp_size)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None
    ) -> None:
        if self.tp_size > 1 and param.ndim == 2:
            n = param.shape[1]
            loaded_weight = loaded_weight.narrow(1, self.tp_rank * n, n)
        super().weight_loader(param, loaded_weight)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        out = F.linear(x, self.weight)
        if self.tp_size > 1 and self.reduce_results:
            torch.distributed.all_reduce(out)
        if self.bias is not None and not self.skip_bias_add:
            out = out + self.bias
        return out, (self.bias if self.skip_bias_add else None)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matmul (e.g. gate_proj and up_proj).

    weight: [sum(output_sizes) / tp, in], shards in order; shard_id is the index (0, 1, ...).
    """

    def __init__(self, input_size: int, output_sizes: list[int], **kw) -> None:
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), **kw)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None
    ) -> None:
        if shard_id is None:  # already packed in the checkpoint
            if self.tp_size > 1:
                raise NotImplementedError("packed checkpoint weights need splitting for tp > 1")
            return LinearBase.weight_loader(self, param, loaded_weight)
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"{self.prefix}: bad shard_id {shard_id!r}")
        size = self.output_sizes[shard_id] // self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        if self.tp_size > 1:
            loaded_weight = loaded_weight.narrow(0, self.tp_rank * size, size)
        dst = param.data.narrow(0, offset, size)  # rows of this shard (view)
        _check_loaded(f"{self.prefix}[shard {shard_id}]", dst, loaded_weight)
        dst.copy_(loaded_weight)


class QKVParallelLinear(ColumnParallelLinear):
    """Packed q, k, v projections: weight [(Hq + 2 * Hkv) * D / tp, hidden], rows q | k | v.

    shard_id is "q", "k" or "v". tp_size must divide both head counts (no KV-head replication).
    """

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: int | None = None,
        bias: bool = True,
        v_head_size: int | None = None,
        **kw,
    ) -> None:
        total_num_kv_heads = total_num_kv_heads or total_num_heads
        tp_size = kw.get("tp_size", 1)
        if total_num_heads % tp_size or total_num_kv_heads % tp_size:
            raise NotImplementedError(
                f"tp_size {tp_size} must divide num_heads {total_num_heads} and num_kv_heads "
                f"{total_num_kv_heads} (KV-head replication is not implemented)"
            )
        self.head_size = head_size
        self.v_head_size = v_head_size or head_size
        self.total_num_heads, self.total_num_kv_heads = total_num_heads, total_num_kv_heads
        self.num_heads = total_num_heads // tp_size
        self.num_kv_heads = total_num_kv_heads // tp_size
        out = (total_num_heads + total_num_kv_heads) * head_size
        out += total_num_kv_heads * self.v_head_size
        super().__init__(hidden_size, out, bias=bias, **kw)
        self.q_size = self.num_heads * head_size
        self.kv_size = self.num_kv_heads * head_size
        self.v_size = self.num_kv_heads * self.v_head_size

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None
    ) -> None:
        if shard_id is None:
            if self.tp_size > 1:
                raise NotImplementedError("packed qkv checkpoints need per-shard splits for tp > 1")
            return LinearBase.weight_loader(self, param, loaded_weight)
        offsets = {"q": (0, self.q_size), "k": (self.q_size, self.kv_size),
                   "v": (self.q_size + self.kv_size, self.v_size)}  # fmt: skip
        if shard_id not in offsets:
            raise ValueError(f"{self.prefix}: shard_id must be 'q', 'k' or 'v', got {shard_id!r}")
        offset, size = offsets[shard_id]
        if self.tp_size > 1:
            loaded_weight = loaded_weight.narrow(0, self.tp_rank * size, size)
        dst = param.data.narrow(0, offset, size)  # rows of this shard (view)
        _check_loaded(f"{self.prefix}[{shard_id}]", dst, loaded_weight)
        dst.copy_(loaded_weight)
