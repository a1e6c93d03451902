"""Token embedding and LM head, vocab split over the TP ranks.

Rank r owns ids [r * Vp, (r + 1) * Vp) with Vp = ceil(vocab / tp); rows past the real vocabulary
(padding, when tp does not divide it) are zero and their logits are dropped by LogitsProcessor.

On CUDA the gather is one Triton kernel (`_gather_rows_kernel`) that starts with the PDL entry
of every per-layer kernel: in the decode graph the first layer's norm launches while it runs
(torch's gather releases nothing, so that norm used to launch after it ended). It also does the
TP masking: ids outside this rank's slice give zero rows.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import nn

from sgl_ext.launch import cached_launcher, interpreting, pdl_enter
from srt.distributed import resolve_tp, tensor_model_parallel_all_reduce
from srt.layers.quantization.base_config import QuantizationConfig, require_unquantized

GATHER_BLOCK = 1024  # hidden elements a program


@triton.jit
def _gather_rows_kernel(
    Ids,  # int32 / int64 [T]
    Weight,  # [Vp, D], rows at stride_w, columns contiguous
    Out,  # [T, D] contiguous
    start,  # the first id of this slice
    Vp,  # rows of this slice
    D,
    stride_w,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_enter(USE_PDL)
    t = tl.program_id(0)
    d = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] hidden index
    i = tl.load(Ids + t) - start
    ours = (i >= 0) & (i < Vp)
    src = Weight + tl.where(ours, i, 0).to(tl.int64) * stride_w + d
    row = tl.load(src, mask=d < tl.where(ours, D, 0), other=0.0)  # zeros: not our id
    tl.store(Out + t.to(tl.int64) * D + d, row, mask=d < D)


def embedding_rows(ids: torch.Tensor, weight: torch.Tensor, start: int = 0) -> torch.Tensor:
    """Rows of `weight` for ids - start; ids outside [start, start + Vp) give zero rows.

    Parameters
    ----------
    ids : int32 / int64 [T] (any shape) token ids. weight : [Vp, D] on ids' device.
    start : the first id `weight` holds (a TP rank's vocabulary offset).

    Returns
    -------
    [T, D] of weight's dtype (new tensor): on CUDA (or under TRITON_INTERPRET) one Triton
    launch, elsewhere the torch reference (F.embedding with the same masking). Rows are copies:
    the same bits either way.
    """
    if ids.device != weight.device:
        raise ValueError(f"ids must be on weight's device {weight.device}, got {ids.device}")
    vp, d = weight.shape
    kernel = weight.is_cuda or interpreting()
    if not kernel or weight.stride(1) != 1 or ids.dtype not in (torch.int32, torch.int64):
        local = ids - start
        ours = (local >= 0) & (local < vp)  # [T]
        out = F.embedding(local.masked_fill(~ours, 0), weight)  # [T, D]
        return out.masked_fill(~ours[..., None], 0)
    flat = ids.reshape(-1).contiguous()  # [T]
    out = torch.empty(*ids.shape, d, dtype=weight.dtype, device=weight.device)
    if flat.numel():
        grid = (flat.numel(), -(-d // GATHER_BLOCK))
        cached_launcher(_gather_rows_kernel)[grid](
            flat, weight, out, start, vp, d, weight.stride(0), BLOCK=GATHER_BLOCK, num_warps=4
        )
    return out


class VocabParallelEmbedding(nn.Module):
    """Embedding table [Vp, hidden] of this rank's vocabulary slice.

    Parameters (SGLang's; keywords after embedding_dim)
    ----------
    num_embeddings : vocabulary size V.
    embedding_dim : hidden size.
    params_dtype : parameter dtype (default: torch's default dtype).
    output_dtype : cast the embeddings to it (default: the parameter dtype).
    org_num_embeddings : SGLang's LoRA extra-vocabulary option; only None or V.
    padding_size : each rank's slice is rounded up to a multiple of it (SGLang pads to 64; the
        default 1 pads only to divide V by tp). Padded rows are zero; their logits are dropped.
    quant_config : None, or a config that leaves embeddings unquantized.
    prefix : the layer's name in the model (messages).
    enable_tp : False keeps the whole table on every rank (TP 1 for this layer).
    use_attn_tp_group : split over the attention-TP group: the TP group (no DP attention).
    use_presharded_weights : not supported (raises).
    tp_rank, tp_size : this rank's TP position (default: TP 1).
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        params_dtype: torch.dtype | None = None,
        output_dtype: torch.dtype | None = None,
        org_num_embeddings: int | None = None,
        padding_size: int = 1,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
        enable_tp: bool = True,
        use_attn_tp_group: bool = False,
        use_presharded_weights: bool = False,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        super().__init__()
        require_unquantized(quant_config, "embedding", prefix)
        if org_num_embeddings not in (None, num_embeddings):
            raise NotImplementedError("org_num_embeddings != num_embeddings (LoRA extra vocab)")
        if use_presharded_weights:
            raise NotImplementedError("use_presharded_weights=True is not supported")
        if padding_size < 1:
            raise ValueError(f"padding_size must be >= 1, got {padding_size}")
        tp_rank, tp_size = resolve_tp(tp_rank, tp_size) if enable_tp else (0, 1)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.tp_rank, self.tp_size, self.prefix = tp_rank, tp_size, prefix
        self.output_dtype = output_dtype
        self.use_attn_tp_group = use_attn_tp_group
        per = -(-num_embeddings // tp_size)
        self.num_embeddings_per_partition = -(-per // padding_size) * padding_size
        self.num_embeddings_padded = self.num_embeddings_per_partition * tp_size
        self.vocab_start_index = tp_rank * self.num_embeddings_per_partition
        # Real rows of this slice (the last ranks may own padding only).
        self.num_real = max(
            0, min(num_embeddings - self.vocab_start_index, self.num_embeddings_per_partition)
        )
        dtype = params_dtype or torch.get_default_dtype()
        w = torch.empty(self.num_embeddings_per_partition, embedding_dim, dtype=dtype)
        self.weight = nn.Parameter(w, requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None):
        """Copy this rank's rows of the full [V, ...] tensor (weight or bias); zero the padding."""
        want = (self.num_embeddings, *param.shape[1:])
        if tuple(loaded_weight.shape) != want:
            raise ValueError(
                f"{self.prefix or 'embedding'}: checkpoint shape {tuple(loaded_weight.shape)}, "
                f"expected {want}"
            )
        n = self.num_real
        param.data[:n].copy_(loaded_weight.narrow(0, self.vocab_start_index, n))
        param.data[n:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: int64 [T] -> [T, hidden] (all-reduced over the TP ranks)."""
        if self.tp_size == 1:
            if input_ids.is_cuda:
                out = embedding_rows(input_ids, self.weight)
            else:
                out = F.embedding(input_ids, self.weight)
        else:
            # [T, hidden]: this slice's rows, zeros for ids of other ranks
            out = embedding_rows(input_ids, self.weight, self.vocab_start_index)
            out = tensor_model_parallel_all_reduce(out)
        if self.output_dtype is not None:
            out = out.to(self.output_dtype)
        return out


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection [Vp, hidden] of this rank's vocabulary slice; LogitsProcessor does the
    matmul and gathers the slices."""

    def __init__(
        self, num_embeddings: int, embedding_dim: int, *, bias: bool = False, **kw: Any
    ) -> None:
        """SGLang's ParallelLMHead: VocabParallelEmbedding's keywords, plus an optional bias."""
        super().__init__(num_embeddings, embedding_dim, **kw)
        if bias:
            b = torch.zeros(self.num_embeddings_per_partition, dtype=self.weight.dtype)
            self.bias = nn.Parameter(b, requires_grad=False)
            self.bias.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        else:
            self.register_parameter("bias", None)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("ParallelLMHead has no forward; use LogitsProcessor")
