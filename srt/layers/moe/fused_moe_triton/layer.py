"""FusedMoE: SGLang's routed-expert layer interface over srt's `TopKExperts` (`topk_experts.py`).

An unmodified SGLang model file builds `FusedMoE(num_experts, hidden_size, intermediate_size,
layer_id, top_k, ..., quant_config, activation, gemm1_alpha, gemm1_clamp_limit, with_bias,
gate_up_interleaved, ...)`, loads the checkpoint through `weight_loader(param, loaded_weight,
weight_name, shard_id, expert_id)` and calls `experts(hidden_states, topk_output)`. The
parameters carry SGLang's names: w13_weight / w2_weight (and their MXFP4 `_scale`s),
w13_weight_bias / w2_weight_bias. srt's kernels and torch paths do the work.

Activation: "silu" with gemm1_alpha and gemm1_clamp_limit is gpt-oss's clamped SwiGLU
(srt's "swiglu_oai"); "silu" alone the plain gated silu. Checkpoint gate/up rows arrive
interleaved (g0 u0 g1 u1 ..., `gate_up_interleaved=True`) or gate rows then up rows.
With an MXFP4 quant_config the experts stay packed (SGLang's parameter shapes) on every device;
the CPU path dequantises them per call.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from srt.layers.moe.fused_moe_triton.topk_experts import TopKExperts
from srt.layers.moe.topk import StandardTopKOutput
from srt.layers.quantization.base_config import QuantizationConfig

__all__ = ["FusedMoE", "TopKExperts"]


class FusedMoE(TopKExperts):
    """SGLang's FusedMoE constructor and loader on TopKExperts (see the module docstring).

    Options srt lacks (shared experts fused in, router weight on the input, presharded weights,
    no_combine, routed scaling, gemm1_beta, ungated experts, another quant method's MoE, the
    Qwen3.5 deferred finalize) raise at build time, naming themselves.
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        layer_id: int,
        top_k: int | None = None,
        num_fused_shared_experts: int = 0,
        params_dtype: torch.dtype | None = None,
        reduce_results: bool = False,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
        activation: str = "silu",
        apply_router_weight_on_input: bool = False,
        use_presharded_weights: bool = False,
        inplace: bool = True,
        no_combine: bool = False,
        routed_scaling_factor: float | None = None,
        gemm1_alpha: float | None = None,
        gemm1_beta: float | None = None,
        gemm1_clamp_limit: float | None = None,
        swiglu_limit: float | None = None,
        use_weight_loader_fused: bool = False,
        with_bias: bool = False,
        routing_method_type: Any = None,
        is_gated: bool = True,
        gate_up_interleaved: bool = True,
        enable_qwen35_fp8_deferred_finalize: bool = False,
        quant_method: Any = None,
        uses_expert_location: bool = True,
        *,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        unsupported = {
            "num_fused_shared_experts": num_fused_shared_experts != 0,
            "apply_router_weight_on_input": apply_router_weight_on_input,
            "use_presharded_weights": use_presharded_weights,
            "no_combine": no_combine,
            "routed_scaling_factor": routed_scaling_factor not in (None, 1.0),
            "gemm1_beta": gemm1_beta is not None,
            "is_gated": not is_gated,
            "enable_qwen35_fp8_deferred_finalize": enable_qwen35_fp8_deferred_finalize,
            "quant_method": quant_method is not None,
            "activation": activation != "silu",
        }
        asked = [name for name, on in unsupported.items() if on]
        if asked:
            raise NotImplementedError(f"FusedMoE options not supported by srt: {asked}")
        method = None
        if quant_config is not None and quant_config.quantizes("moe", prefix):
            method = quant_config.get_name()
            if method != "mxfp4":
                raise NotImplementedError(f"quantization method {method!r} for MoE experts")
            if hidden_size % 32 or (intermediate_size // tp_size) % 32:
                raise ValueError(
                    f"MXFP4 experts need hidden_size ({hidden_size}) and intermediate_size / "
                    f"tp ({intermediate_size // tp_size}) to be multiples of 32"
                )
        limit = gemm1_clamp_limit if gemm1_clamp_limit is not None else swiglu_limit
        if gemm1_alpha is not None and limit is None:
            raise ValueError("gpt-oss's SwiGLU (gemm1_alpha) needs gemm1_clamp_limit")
        oai = gemm1_alpha is not None
        kw: dict[str, Any] = {"swiglu_alpha": gemm1_alpha, "swiglu_limit": limit} if oai else {}
        super().__init__(
            num_experts,
            hidden_size,
            intermediate_size,
            bias=with_bias,
            activation="swiglu_oai" if oai else "silu",
            tp_rank=tp_rank,
            tp_size=tp_size,
            reduce_results=reduce_results,
            quant_method=method,
            mxfp4_packed=method == "mxfp4" or None,
            **kw,
        )
        if params_dtype is not None and not self.mxfp4:
            self.to(params_dtype)
        # SGLang's parameter names for the biases; TopKExperts reads them as w13_bias / w2_bias
        for ours, theirs in (("w13_bias", "w13_weight_bias"), ("w2_bias", "w2_weight_bias")):
            param = self._parameters.pop(ours, None)
            if param is not None:
                self.register_parameter(theirs, param)
                self.__dict__[ours] = param
        for param in self._parameters.values():  # the MXFP4 scales too
            if param is not None:
                param.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        self.layer_id, self.top_k, self.prefix = layer_id, top_k, prefix
        self.quant_config = quant_config
        self.use_weight_loader_fused = use_weight_loader_fused
        self.gate_up_interleaved = gate_up_interleaved
        self.num_local_experts = num_experts
        self.moe_tp_rank, self.moe_tp_size = self.tp_rank, self.tp_size
        self.moe_ep_rank, self.moe_ep_size = 0, 1
        self.runner_backend = self.moe_runner_backend

    @classmethod
    def make_expert_params_mapping_fused(
        cls,
        ckpt_gate_up_proj_name: str,
        ckpt_down_proj_name: str,
        ckpt_gate_up_proj_bias_name: str,
        ckpt_down_proj_bias_name: str,
    ) -> list[tuple[str, str, str]]:
        """(parameter name part, checkpoint name part, shard id) of whole-expert-stack tensors."""
        return [
            ("experts.w13_weight", f"experts.{ckpt_gate_up_proj_name}", "w13"),
            ("experts.w13_weight_bias", f"experts.{ckpt_gate_up_proj_bias_name}", "w13"),
            ("experts.w2_weight", f"experts.{ckpt_down_proj_name}", "w2"),
            ("experts.w2_weight_bias", f"experts.{ckpt_down_proj_bias_name}", "w2"),
        ]

    def weight_loader(  # type: ignore[override]
        self,
        param: nn.Parameter,
        loaded_weight: torch.Tensor,
        weight_name: str | None = None,
        shard_id: str | None = None,
        expert_id: int | None = None,
    ) -> None:
        """Copy a tensor holding every expert into `param`.

        With `weight_name` (SGLang's loaders): a checkpoint tensor, gate/up rows interleaved
        when gate_up_interleaved; the full TP-1 tensor (float) or this rank's slice (MXFP4
        blocks / scales, which SGLang's gpt-oss loader slices itself). Without it (srt's
        loaders, e.g. dummy weights): our layout [E, 2I, H] gate rows then up rows, full.
        """
        if expert_id is not None:
            raise NotImplementedError("FusedMoE: per-expert checkpoint tensors (expert_id)")
        if shard_id not in (None, "w13", "w2"):
            raise ValueError(f"shard_id must be 'w13', 'w2' or None, got {shard_id!r}")
        w13 = param is self.w13_weight or param is self.w13_bias or param is self.w13_weight_scale
        if param.dtype == torch.uint8:  # packed MXFP4 blocks or scales: this rank's part
            if w13 and self.gate_up_interleaved:
                loaded_weight = torch.cat([loaded_weight[:, 0::2], loaded_weight[:, 1::2]], dim=1)
            self._copy_packed(param, loaded_weight, weight_name or "mxfp4")
            return
        if weight_name is None or not w13:
            super().weight_loader(param, loaded_weight, None)
            return
        bias = param is self.w13_bias
        if self.gate_up_interleaved:
            layout = "gate_up_bias_interleaved" if bias else "gate_up_interleaved"
        else:
            layout = "gate_up"
        if loaded_weight.shape[1] != 2 * self.full_intermediate_size:  # already this rank's rows
            loaded_weight = self._local_rows(loaded_weight)
            layout = "gate_up"
        super().weight_loader(param, loaded_weight, layout)

    def _local_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """This rank's gate/up rows [E, 2I/tp, ...] as gate | up, from the checkpoint's order."""
        if self.gate_up_interleaved:
            return torch.cat([rows[:, 0::2], rows[:, 1::2]], dim=1)
        return rows

    def forward(  # type: ignore[override]
        self, hidden_states: torch.Tensor, topk_output: StandardTopKOutput
    ) -> torch.Tensor:
        """hidden_states [T, H], TopK's output -> [T, H] (a partial sum over TP ranks unless
        reduce_results)."""
        out = super().forward(hidden_states, topk_output.topk_weights, topk_output.topk_ids)
        assert isinstance(out, torch.Tensor)  # combine=True: never pair rows
        return out
