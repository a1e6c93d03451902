"""Top-k routed mixture of experts, as used by gpt-oss: the module, its torch paths (the CPU
implementation and the test oracle) and the dispatch to the Triton kernels (`fused_moe.py`).

Experts hold packed weights in one layout, whatever the checkpoint's:
  w13_weight [E, 2I, H] (gate rows 0..I-1, then up rows), w13_bias [E, 2I],
  w2_weight  [E, H, I], w2_bias [E, H].
The `weight_loader` converts checkpoint layouts (named by shard_id, see `TopKExperts.LAYOUTS`).
Activation "swiglu_oai" is gpt-oss's clamped SwiGLU:
  gate = min(gate, limit); up = clamp(up, -limit, limit);
  out = (up + 1) * gate * sigmoid(alpha * gate)
and "silu" is the plain silu(gate) * up.

Tensor parallelism splits every expert's intermediate dim I: rank r holds gate and up rows
[r * I/tp, (r+1) * I/tp) (w13 [E, 2I/tp, H]) and the matching down columns (w2 [E, H, I/tp]);
each rank's output is a partial sum, all-reduced at the end; the down bias is added on rank 0
only, so it counts once.

MXFP4 experts (quant_method "mxfp4", the gpt-oss checkpoint format, loaded with `load_mxfp4`):
on CUDA they stay packed, w13_weight uint8 [E, 2I, H/2] + w13_weight_scale uint8 [E, 2I, H/32]
and w2_weight uint8 [E, H, I/2] + w2_weight_scale uint8 [E, H, I/32] (E2M1 pairs along the input
dim, low nibble first; one E8M0 scale per 32 inputs), and the Triton kernels dequantise them
(the torch paths dequantise all experts per call: a reference only). Elsewhere (the CPU
reference) they are dequantised at load into the layout above. TP shards the packed down
weights along I in whole scale groups, so packing needs I / tp % 32 == 0 (else: dequantised).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from srt.distributed import resolve_tp, tensor_model_parallel_all_reduce
from srt.layers.moe.topk_pairs import TopKPairs
from srt.layers.mxfp4 import dequantize_mxfp4

if TYPE_CHECKING:  # kernel modules load lazily (TRITON_INTERPRET may be set after import)
    from srt.layers.moe.fused_moe_triton.moe_x_f16 import XF16

logger = logging.getLogger(__name__)


class TopKExperts(nn.Module):
    """E experts with gated MLPs; forward combines each token's top-k experts.

    Parameters
    ----------
    num_experts, hidden_size, intermediate_size : E, H, I.
    bias : whether experts have biases (gpt-oss: yes).
    activation : "swiglu_oai" or "silu".
    swiglu_alpha, swiglu_limit : gpt-oss activation constants.
    tp_rank, tp_size : TP position (default: the TP group's); tp_size must divide I.
    reduce_results : all-reduce the partial outputs over the TP ranks (tp > 1).
    moe_runner_backend : "auto" (Triton kernels on CUDA, torch elsewhere), "triton" or "torch".
    quant_method : None (weights in the model dtype) or "mxfp4" (checkpoint experts in MXFP4).
    mxfp4_packed : with "mxfp4", keep the weights packed (default: when built on CUDA).
    """

    dense_max_tokens = 64  # batches up to this size run every expert densely

    # shard_id -> description of a checkpoint tensor accepted by weight_loader
    LAYOUTS = {
        "gate_up_t_interleaved": "[E, H, 2I], columns g0 u0 g1 u1 ... (HF gpt-oss bf16)",
        "gate_up_interleaved": "[E, 2I, H], rows g0 u0 g1 u1 ... (gpt-oss MXFP4, dequantised)",
        "gate_up": "[E, 2I, H], gate rows then up rows (our layout)",
        "gate_up_bias_interleaved": "[E, 2I] g0 u0 g1 u1 ...",
        "down_t": "[E, I, H] (HF gpt-oss bf16)",
        "down": "[E, H, I] (our layout / MXFP4 dequantised)",
    }

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        bias: bool = True,
        activation: str = "swiglu_oai",
        swiglu_alpha: float = 1.702,
        swiglu_limit: float = 7.0,
        tp_rank: int | None = None,
        tp_size: int | None = None,
        reduce_results: bool = True,
        moe_runner_backend: str = "auto",
        quant_method: str | None = None,
        mxfp4_packed: bool | None = None,
    ) -> None:
        super().__init__()
        if quant_method not in (None, "mxfp4"):
            raise ValueError(f"quant_method must be None or 'mxfp4', got {quant_method!r}")
        if activation not in ("swiglu_oai", "silu"):
            raise ValueError(f"activation must be 'swiglu_oai' or 'silu', got {activation!r}")
        if moe_runner_backend not in ("auto", "triton", "torch"):
            raise ValueError(
                "moe_runner_backend must be auto, triton or torch, got " + repr(moe_runner_backend)
            )
        self.moe_runner_backend = moe_runner_backend
        self.tp_rank, self.tp_size = resolve_tp(tp_rank, tp_size)
        if intermediate_size % self.tp_size:
            raise ValueError(
                f"tp_size {self.tp_size} must divide intermediate_size {intermediate_size}"
            )
        self.reduce_results = reduce_results
        self.full_intermediate_size = intermediate_size
        E, H, I2 = num_experts, hidden_size, intermediate_size // self.tp_size
        self.num_experts, self.hidden_size, self.intermediate_size = E, H, I2
        self.activation, self.alpha, self.limit = activation, swiglu_alpha, swiglu_limit
        self.quant_method = quant_method
        if mxfp4_packed is None:
            mxfp4_packed = torch.empty(0).device.type == "cuda"  # the device being built on
        self.mxfp4 = quant_method == "mxfp4" and mxfp4_packed
        if self.mxfp4 and (H % 32 or I2 % 32):
            logger.warning(
                "MXFP4 experts dequantised at load: hidden %d and intermediate/tp %d must be "
                "multiples of 32 to stay packed",
                H,
                I2,
            )
            self.mxfp4 = False
        p = lambda *s: nn.Parameter(torch.empty(s), requires_grad=False)
        u8 = lambda *s: nn.Parameter(torch.empty(s, dtype=torch.uint8), requires_grad=False)
        self.w13_weight_scale: nn.Parameter | None  # uint8 [E, 2I, H/32] (MXFP4) or None
        self.w2_weight_scale: nn.Parameter | None  # uint8 [E, H, I/32] (MXFP4) or None
        if self.mxfp4:
            self.w13_weight, self.w13_weight_scale = u8(E, 2 * I2, H // 2), u8(E, 2 * I2, H // 32)
            self.w2_weight, self.w2_weight_scale = u8(E, H, I2 // 2), u8(E, H, I2 // 32)
        else:
            self.w13_weight, self.w2_weight = p(E, 2 * I2, H), p(E, H, I2)
            self.w13_weight_scale = self.w2_weight_scale = None
        self.w13_bias = p(E, 2 * I2) if bias else None
        self.w2_bias = p(E, H) if bias else None
        for prm in (self.w13_weight, self.w2_weight, self.w13_bias, self.w2_bias):
            if prm is not None:
                prm.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        """Copy a checkpoint tensor (layout named by shard_id, see LAYOUTS) into `param`."""
        if shard_id in ("gate_up_t_interleaved", "down_t"):
            loaded = loaded.transpose(1, 2)  # -> [E, out, in]
            shard_id = "gate_up_interleaved" if shard_id == "gate_up_t_interleaved" else "down"
        if shard_id in ("gate_up_interleaved", "gate_up_bias_interleaved"):
            loaded = torch.cat([loaded[:, 0::2], loaded[:, 1::2]], dim=1)  # gate rows | up rows
        elif shard_id not in (None, "gate_up", "down"):
            raise ValueError(f"unknown expert shard_id {shard_id!r}; one of {list(self.LAYOUTS)}")
        loaded = self._tp_slice(param, loaded)
        if param.shape != loaded.shape:
            raise ValueError(
                f"expert tensor ({shard_id}) shape {tuple(loaded.shape)} != {tuple(param.shape)}"
            )
        param.data.copy_(loaded)

    def _tp_slice(self, param: nn.Parameter, loaded: torch.Tensor) -> torch.Tensor:
        """This rank's part of a full (TP-1 shaped) expert tensor in our layout."""
        full_i, i_loc, r = self.full_intermediate_size, self.intermediate_size, self.tp_rank
        if self.tp_size == 1:
            return loaded
        if param is self.w13_weight or param is self.w13_bias:
            if loaded.shape[1] != 2 * full_i:
                return loaded  # not a full tensor: the shape check names it
            gate = loaded[:, r * i_loc : (r + 1) * i_loc]  # [E, I/tp, ...]
            up = loaded[:, full_i + r * i_loc : full_i + (r + 1) * i_loc]
            return torch.cat([gate, up], dim=1)  # [E, 2I/tp, ...]
        if param is self.w2_weight and loaded.shape[-1] == full_i:
            return loaded[..., r * i_loc : (r + 1) * i_loc]  # [E, H, I/tp]
        return loaded  # w2_bias [E, H]: replicated

    def load_mxfp4(self, proj: str, blocks: torch.Tensor, scales: torch.Tensor) -> list[str]:
        """Load one expert projection of an HF MXFP4 checkpoint (full, TP-1 shaped).

        Parameters
        ----------
        proj : "gate_up" (blocks uint8 [E, 2I, H/32, 16], scales uint8 [E, 2I, H/32], rows
            g0 u0 g1 u1 ...) or "down" (blocks [E, H, I/32, 16], scales [E, H, I/32]).

        Returns
        -------
        The names of the parameters set (packed: the weight and its scale).
        """
        if proj not in ("gate_up", "down"):
            raise ValueError(f"proj must be 'gate_up' or 'down', got {proj!r}")
        if not self.mxfp4:  # dequantised straight to the model's dtype, on its device
            param = self.w13_weight if proj == "gate_up" else self.w2_weight
            dev, dt = param.device, param.dtype
            w = dequantize_mxfp4(blocks.to(dev), scales.to(dev), dt)
            self.weight_loader(param, w, "gate_up_interleaved" if proj == "gate_up" else "down")
            return ["w13_weight" if proj == "gate_up" else "w2_weight"]
        w13_scale, w2_scale = self.w13_weight_scale, self.w2_weight_scale
        assert w13_scale is not None and w2_scale is not None  # packed MXFP4 has its scales
        if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
            raise TypeError(f"MXFP4 {proj} blocks/scales must be uint8")
        if blocks.dim() != 4 or blocks.shape[-1] != 16 or blocks.shape[:-1] != scales.shape:
            raise ValueError(
                f"MXFP4 {proj} blocks {tuple(blocks.shape)} / scales {tuple(scales.shape)} are "
                "not [E, N, G, 16] / [E, N, G]"
            )
        if proj == "gate_up":
            pairs = ((self.w13_weight, blocks.flatten(-2)), (w13_scale, scales))
            for param, t in pairs:
                t = torch.cat([t[:, 0::2], t[:, 1::2]], dim=1)  # gate rows | up rows
                t = self._tp_slice(self.w13_weight, t)  # this rank's gate and up rows
                self._copy_packed(param, t, proj)
            return ["w13_weight", "w13_weight_scale"]
        groups, r = self.intermediate_size // 32, self.tp_rank  # this rank's scale groups of I
        if self.tp_size > 1 and scales.shape[-1] == self.full_intermediate_size // 32:
            blocks = blocks[:, :, r * groups : (r + 1) * groups]
            scales = scales[:, :, r * groups : (r + 1) * groups]
        self._copy_packed(self.w2_weight, blocks.flatten(-2), proj)  # [E, H, I/2]
        self._copy_packed(w2_scale, scales, proj)  # [E, H, I/32]
        return ["w2_weight", "w2_weight_scale"]

    @staticmethod
    def _copy_packed(param: nn.Parameter, t: torch.Tensor, proj: str) -> None:
        if tuple(t.shape) != tuple(param.shape):
            raise ValueError(f"MXFP4 {proj} shape {tuple(t.shape)} != {tuple(param.shape)}")
        param.data.copy_(t)

    def _dense_weights(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13 [E, 2I, H], w2 [E, H, I]) for the torch paths: packed MXFP4 dequantised."""
        if not self.mxfp4:
            return self.w13_weight, self.w2_weight
        deq = lambda q, s: dequantize_mxfp4(q.view(*s.shape, 16), s, dtype)  # [E, N, K]
        w13 = deq(self.w13_weight, self.w13_weight_scale)
        return w13, deq(self.w2_weight, self.w2_weight_scale)

    def _act(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up[..., : self.intermediate_size], gate_up[..., self.intermediate_size :]
        if self.activation == "silu":
            return F.silu(gate) * up
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def _expert(self, x: torch.Tensor, e: int, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        h = x @ w13[e].T  # [n, 2I]
        if self.w13_bias is not None:
            h = h + self.w13_bias[e]
        out = self._act(h) @ w2[e].T  # [n, H]
        if self.w2_bias is not None and self.tp_rank == 0:
            out = out + self.w2_bias[e]
        return out

    def _forward_gathered(self, x, topk_weights, topk_ids, w13, w2) -> torch.Tensor:
        """Static shapes, reads only the T*k selected experts (cheapest when T*k < E)."""
        out = torch.zeros_like(x)
        for j in range(topk_ids.shape[1]):
            ids = topk_ids[:, j]  # [T]
            h = torch.bmm(w13[ids], x[:, :, None])[..., 0]  # [T, 2I, H] @ [T, H, 1]
            if self.w13_bias is not None:
                h = h + self.w13_bias[ids]
            a = self._act(h)  # [T, I]
            y = torch.bmm(w2[ids], a[:, :, None])[..., 0]  # [T, H]
            if self.w2_bias is not None and self.tp_rank == 0:
                y = y + self.w2_bias[ids]
            out += (y * topk_weights[:, j, None]).to(x.dtype)
        return out

    def _forward_dense(self, x, topk_weights, topk_ids, w13, w2) -> torch.Tensor:
        """Static shapes, every expert on every token (weight 0 where unused)."""
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            w = (topk_weights * (topk_ids == e)).sum(-1, keepdim=True)  # [T, 1]
            out += (self._expert(x, e, w13, w2) * w).to(x.dtype)
        return out

    def _forward_grouped(self, x, topk_weights, topk_ids, w13, w2) -> torch.Tensor:
        """Each expert on its own tokens only (host sync per expert: eager only)."""
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            tok, slot = torch.where(topk_ids == e)
            if tok.numel() == 0:
                continue
            y = self._expert(x[tok], e, w13, w2) * topk_weights[tok, slot, None]
            out.index_add_(0, tok, y.to(x.dtype))
        return out

    def uses_triton(self, x: torch.Tensor) -> bool:
        """Whether forward(x, ...) runs the Triton kernels (CUDA under "auto")."""
        if self.moe_runner_backend == "auto":
            return x.is_cuda
        return self.moe_runner_backend == "triton"

    def takes_x_f16(self, x: torch.Tensor) -> bool:
        """Whether forward(x, ...) runs the fp16-product GEMVs (then an x_f16 made with the
        routing, `select_experts_x_f16`, saves their activation conversion's launch)."""
        if not (self.mxfp4 and self.uses_triton(x) and x.is_cuda and x.dim() == 2):
            return False
        from srt.layers.moe.fused_moe_triton.config import get_config
        from srt.layers.moe.fused_moe_triton.moe_gemv_f16 import f16_products_apply

        cfg = get_config(x.shape[0], x.device, x.dtype, mxfp4=True)
        return f16_products_apply(cfg, x, True, self.activation, self.alpha, self.limit)

    def _forward_triton(
        self, x, topk_weights, topk_ids, x_f16=None, combine=True
    ) -> torch.Tensor | TopKPairs:
        """Routed experts only, grouped by expert (static shapes, sync-free, graph-safe)."""
        from srt.layers.moe.fused_moe_triton.fused_moe import fused_experts

        return fused_experts(
            x,
            self.w13_weight,
            self.w2_weight,
            topk_weights,
            topk_ids,
            w13_bias=self.w13_bias,
            w2_bias=self.w2_bias if self.tp_rank == 0 else None,  # counted once over TP
            activation=self.activation,
            swiglu_alpha=self.alpha,
            swiglu_limit=self.limit,
            w13_scale=self.w13_weight_scale,
            w2_scale=self.w2_weight_scale,
            x_f16=x_f16,
            combine=combine,
        )

    def forward(
        self,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        x_f16: XF16 | None = None,
        combine: bool = True,
    ) -> torch.Tensor | TopKPairs:
        """Each token's top-k experts, weighted by the routing weights and summed.

        Parameters
        ----------
        x : [T, H]
        topk_weights : float [T, k]
        topk_ids : int64/int32 [T, k]
        x_f16 : x's fp16 words for the fp16-product GEMVs (see takes_x_f16), or None.
        combine : False lets the Triton path return its weighted pair rows (TopKPairs, for the
            next RMSNorm to add up) at tp 1; the other paths combine.

        Returns
        -------
        [T, H], x.dtype (this rank's partial sum when tp > 1 and not reduce_results), or
        TopKPairs (combine=False, see above).

        On CUDA (backend "auto") the Triton kernels read only the routed experts. The torch
        paths: small batches (decode; always under CUDA-graph capture) take a static-shape,
        sync-free path, so an eager decode step and its graph replay run the same arithmetic:
        gathered experts when T*k < E (fewer weight bytes), else dense. Larger eager batches
        group tokens per expert.
        """
        T, k = topk_ids.shape
        capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
        if self.uses_triton(x):
            # pair rows only at tp 1: a partial sum over I is all-reduced (here or by the caller)
            out = self._forward_triton(
                x, topk_weights, topk_ids, x_f16, combine or self.tp_size > 1
            )
            if isinstance(out, TopKPairs):
                return out
        else:
            w = self._dense_weights(x.dtype)
            if capturing or T <= self.dense_max_tokens:
                if T * k < self.num_experts:
                    out = self._forward_gathered(x, topk_weights, topk_ids, *w)
                else:
                    out = self._forward_dense(x, topk_weights, topk_ids, *w)
            else:
                out = self._forward_grouped(x, topk_weights, topk_ids, *w)
        if self.tp_size > 1 and self.reduce_results:
            out = tensor_model_parallel_all_reduce(out)  # partial sums over I -> [T, H]
        return out
