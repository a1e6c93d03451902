"""gpt-oss for SRT: attention sinks, alternating sliding-window / full layers, YaRN RoPE, and a
top-k routed MoE with gpt-oss's clamped SwiGLU and biases.

Only what differs from the shared skeleton (`srt.models.common`) is here: the MoE MLP, sinks and
float32 norm weights (flags), and the expert weight loading; sliding windows and YaRN come from
the config. Checkpoints: the HF bf16 layout (experts.gate_up_proj [E, H, 2I] with interleaved
gate/up columns, down_proj [E, I, H]) or the original MXFP4 layout (*_blocks / *_scales), which
stays packed on CUDA with quantization_config.quant_method "mxfp4" (the MoE kernels dequantise
it); otherwise, and on the CPU, it is dequantised to the model dtype at load.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import cast

import torch
from torch import nn

from srt.configs.model_config import ModelConfig
from srt.layers.layernorm import RMSNorm
from srt.layers.linear import ReplicatedLinear
from srt.layers.moe import TopKExperts, select_experts
from srt.layers.moe.router_topk import (
    TicketCounts,
    add_norm_fits,
    add_rmsnorm_router_select_experts_x_f16,
    fused_route_fits,
    router_select_experts_x_f16,
)
from srt.layers.moe.topk import select_experts_x_f16
from srt.layers.moe.topk_pairs import TopKPairs
from srt.models.common import CausalLM, DecoderLayer, DecoderModel, RopeAttention
from srt.models.weight_utils import QKV_STACKED_PARAMS
from srt.utils.submodule import Submodule


def _experts_quant_method(config: ModelConfig) -> str | None:
    """The experts' checkpoint format: "mxfp4" (quantization_config.quant_method) or None."""
    method = (config.quantization_config or {}).get("quant_method")
    return "mxfp4" if method == "mxfp4" else None


class GptOssMLP(nn.Module):
    """Router (linear with bias) -> softmax over the top-k logits -> weighted expert MLPs."""

    def __init__(self, config: ModelConfig, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        if config.num_local_experts <= 0 or config.num_experts_per_tok <= 0:
            raise ValueError("gpt-oss config needs num_local_experts and num_experts_per_tok")
        self.top_k = config.num_experts_per_tok
        self.router = ReplicatedLinear(config.hidden_size, config.num_local_experts, bias=True)
        self.experts = TopKExperts(
            config.num_local_experts,
            config.hidden_size,
            config.intermediate_size,
            bias=True,
            activation="swiglu_oai",
            swiglu_alpha=config.swiglu_alpha,
            swiglu_limit=config.swiglu_limit,
            tp_rank=tp_rank,
            tp_size=tp_size,
            quant_method=_experts_quant_method(config),
        )
        self._route_counts = TicketCounts()  # the fused router's ticket counters

    def forward(self, x: torch.Tensor) -> torch.Tensor | TopKPairs:
        """x [T, H] -> [T, H], or the experts' weighted pair rows (TopKPairs, Triton path at tp 1)
        that the next layer's input norm (or the final norm) adds up with its residual."""
        return self._forward(x, self.experts.takes_x_f16(x))

    def forward_add_norm(
        self, hidden: torch.Tensor, residual: torch.Tensor, norm: RMSNorm
    ) -> torch.Tensor | TopKPairs:
        """forward(norm(hidden, residual, inplace=True)[0]): residual takes the sum in place. The
        norm runs inside the fused router's launch where that launch serves the call (hidden
        is then left as it is)."""
        x_f16 = self.experts.takes_x_f16(hidden)
        p = self.router._parameters  # read directly: no nn.Module.__getattr__ per call
        w = cast(torch.Tensor, p["weight"])
        nw = cast(torch.Tensor, norm._parameters["weight"])
        if (
            x_f16
            and norm.weight_in_fp32
            and fused_route_fits(hidden, w, self.top_k)
            and add_norm_fits(hidden, residual, nw)
        ):
            counts = self._route_counts.get(hidden.shape[0], hidden.device)
            r = add_rmsnorm_router_select_experts_x_f16(
                hidden,
                residual,
                nw,
                norm.variance_epsilon,
                w,
                p["bias"],
                self.top_k,
                counts,
                weights_dtype=hidden.dtype,
            )
            return self.experts(r.x, r.weights, r.ids, x_f16=r.x_f16, combine=False)
        x, _ = norm(hidden, residual, inplace=True)
        return self._forward(x, x_f16)  # (the norm keeps shape and dtype: takes_x_f16 holds)

    def _forward(self, x: torch.Tensor, x_f16: bool) -> torch.Tensor | TopKPairs:
        """forward, given `self.experts.takes_x_f16(x)`."""
        if x_f16:  # x's fp16 words for the experts, with the routing
            p = self.router._parameters
            w = cast(torch.Tensor, p["weight"])
            if fused_route_fits(x, w, self.top_k):
                # the router GEMM, the routing and the words in one launch
                counts = self._route_counts.get(x.shape[0], x.device)
                weights, ids, x_f16_words = router_select_experts_x_f16(
                    x, w, p["bias"], self.top_k, counts, weights_dtype=x.dtype
                )
            else:
                logits, _ = self.router(x)  # [T, E]
                weights, ids, x_f16_words = select_experts_x_f16(
                    logits, self.top_k, x, weights_dtype=x.dtype
                )
            return self.experts(x, weights, ids, x_f16=x_f16_words, combine=False)
        logits, _ = self.router(x)  # [T, E]
        # [T, k] weights in x's dtype, expert ids
        weights, ids = select_experts(logits, self.top_k, weights_dtype=x.dtype)
        return self.experts(x, weights, ids, combine=False)


class GptOssAttention(RopeAttention):
    """qkv (with bias) -> YaRN RoPE (+ fused KV write) -> attention with sinks (and a sliding
    window on sliding layers) -> o_proj."""

    has_sinks = True


class GptOssDecoderLayer(DecoderLayer):
    """Pre-norm block (norm weights applied in float32, as in HF) around the MoE."""

    attention_cls = GptOssAttention
    norm_weight_in_fp32 = True
    mlp: Submodule[GptOssMLP] = Submodule()

    def build_mlp(self, config: ModelConfig, tp_rank: int, tp_size: int) -> nn.Module:
        return GptOssMLP(config, tp_rank, tp_size)

    def norm_and_mlp(
        self, hidden_states: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor | TopKPairs, torch.Tensor]:
        """The post-attention norm, inside the fused router's launch where that serves the call
        (GptOssMLP.forward_add_norm), then the MLP."""
        out = self.mlp.forward_add_norm(hidden_states, residual, self.post_attention_layernorm)
        return out, residual


class GptOssModel(DecoderModel):
    """Embedding, decoder layers, final norm (float32 weight): token ids -> [T, hidden]."""

    layer_cls = GptOssDecoderLayer


# checkpoint suffix -> (our parameter suffix, TopKExperts shard_id)
_EXPERT_PARAMS = {
    "experts.gate_up_proj": ("experts.w13_weight", "gate_up_t_interleaved"),
    "experts.gate_up_proj_bias": ("experts.w13_bias", "gate_up_bias_interleaved"),
    "experts.down_proj": ("experts.w2_weight", "down_t"),
    "experts.down_proj_bias": ("experts.w2_bias", "down"),
}


class GptOssForCausalLM(CausalLM):
    """gpt-oss with its LM head. forward(input_ids, positions, forward_batch) -> logits output."""

    model_cls = GptOssModel
    stacked_params_mapping = QKV_STACKED_PARAMS

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named tensors (bf16 or MXFP4 experts); returns the loaded parameter names."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        pending_mxfp4: dict[str, dict[str, torch.Tensor]] = {}
        rest = []
        for name, w in weights:
            if name.endswith(("_blocks", "_scales")):  # MXFP4: pair blocks with scales
                base, kind = name.rsplit("_", 1)
                pending_mxfp4.setdefault(base, {})[kind] = w
                if len(pending_mxfp4[base]) == 2:
                    t = pending_mxfp4.pop(base)
                    loaded |= self._load_mxfp4_expert(base, t["blocks"], t["scales"])
                continue
            expert = next((k for k in _EXPERT_PARAMS if name.endswith(k)), None)
            if expert is not None:
                loaded.add(self._load_expert(params, name, w, _EXPERT_PARAMS[expert][1]))
                continue
            rest.append((name, w))
        if pending_mxfp4:
            raise ValueError(
                f"MXFP4 tensors without their blocks/scales pair: {list(pending_mxfp4)}"
            )
        return loaded | super().load_weights(rest)

    def _load_mxfp4_expert(
        self, ckpt_base: str, blocks: torch.Tensor, scales: torch.Tensor
    ) -> set[str]:
        """An MXFP4 expert pair (<prefix>.experts.{gate_up,down}_proj _blocks / _scales) into the
        layer's TopKExperts: packed, or dequantised at load (see TopKExperts.load_mxfp4)."""
        prefix, proj = ckpt_base.rsplit(".", 1)  # "<...>.mlp.experts", "gate_up_proj"
        if proj not in ("gate_up_proj", "down_proj"):
            raise KeyError(f"MXFP4 tensor {ckpt_base!r} matches no model parameter")
        try:
            experts = cast(TopKExperts, self.get_submodule(prefix))  # <...>.mlp.experts
        except AttributeError:
            raise KeyError(f"MXFP4 tensor {ckpt_base!r} matches no model parameter") from None
        names = experts.load_mxfp4(proj[: -len("_proj")], blocks, scales)
        return {f"{prefix}.{n}" for n in names}

    @staticmethod
    def _expert_param_name(ckpt_name: str) -> str:
        key = next(k for k in _EXPERT_PARAMS if ckpt_name.endswith(k))
        return ckpt_name[: -len(key)] + _EXPERT_PARAMS[key][0]

    @classmethod
    def _load_expert(cls, params: dict, ckpt_name: str, w: torch.Tensor, shard_id: str) -> str:
        pname = cls._expert_param_name(ckpt_name)
        if pname not in params:
            raise KeyError(f"checkpoint tensor {ckpt_name!r} matches no model parameter")
        p = params[pname]
        p.weight_loader(p, w, shard_id)
        return pname


EntryClass = GptOssForCausalLM
