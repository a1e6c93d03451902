"""gpt-oss for SRT: attention sinks, alternating sliding-window / full layers, YaRN RoPE, and a
top-k routed MoE with gpt-oss's clamped SwiGLU and biases.

Read top to bottom: MLP (MoE) -> Attention -> DecoderLayer -> Model -> ForCausalLM ->
load_weights. Checkpoints: the HF bf16 layout (experts.gate_up_proj [E, H, 2I] with interleaved
gate/up columns, down_proj [E, I, H]) or the original MXFP4 layout (*_blocks / *_scales): with
quantization_config.quant_method "mxfp4" the experts stay packed on CUDA (the MoE kernels
dequantise them); otherwise, and on the CPU, they are dequantised to the model dtype at load.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from srt.configs.model_config import ModelConfig
from srt.layers.layernorm import RMSNorm
from srt.layers.linear import QKVParallelLinear, ReplicatedLinear, RowParallelLinear
from srt.layers.logits_processor import LogitsProcessor, LogitsProcessorOutput
from srt.layers.moe import TopKExperts, select_experts
from srt.layers.radix_attention import RadixAttention
from srt.layers.rotary_embedding import get_rope
from srt.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from srt.models.llama import rope_attention
from srt.models.weight_utils import load_stacked_weights

if TYPE_CHECKING:
    from srt.model_executor.forward_batch_info import ForwardBatch


def _experts_quant_method(config: ModelConfig) -> str | None:
    """The experts' checkpoint format: "mxfp4" (quantization_config.quant_method) or None."""
    method = (config.quantization_config or {}).get("quant_method")
    return "mxfp4" if method == "mxfp4" else None


class GptOssMLP(nn.Module):
    """Router (linear with bias) -> softmax over the top-k logits -> weighted expert MLPs."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
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
            quant_method=_experts_quant_method(config),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits, _ = self.router(x)  # [T, E]
        weights, ids = select_experts(logits, self.top_k, softmax_after_topk=True)  # [T, k]
        return self.experts(x, weights.to(x.dtype), ids)


class GptOssAttention(nn.Module):
    """qkv (with bias) -> YaRN RoPE (+ fused KV write) -> attention with sinks (and a sliding
    window on sliding layers) -> o_proj."""

    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            self.head_dim,
            config.num_attention_heads,
            config.num_key_value_heads,
            bias=config.attention_bias,
            prefix=f"layers.{layer_id}.qkv_proj",
        )
        # Heads on this TP rank (KV heads replicated when tp exceeds them).
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim,
            config.hidden_size,
            bias=config.attention_bias,
        )
        # float32 like HF (the sink logit joins the softmax in float32)
        self.sinks = nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32), False)
        self.sinks.weight_loader = self._load_sinks
        self.rotary_emb = get_rope(
            self.head_dim,
            rotary_dim=self.head_dim,
            max_position=config.max_position_embeddings,
            base=config.rope_theta,
            is_neox_style=True,
            rope_scaling=config.rope_scaling,
            partial_rotary_factor=config.partial_rotary_factor,
        )
        self.attn = RadixAttention(
            self.num_heads,
            self.head_dim,
            self.head_dim**-0.5,
            self.num_kv_heads,
            layer_id,
            sliding_window_size=config.get_window_left(layer_id),
            sinks=self.sinks,
        )

    def _load_sinks(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        """sinks: full [Hq] -> this rank's heads [Hq / tp]."""
        n, r = self.num_heads, self.qkv_proj.tp_rank
        if loaded.shape == (self.qkv_proj.total_num_heads,):
            loaded = loaded.narrow(0, r * n, n)
        if loaded.shape != param.shape:
            raise ValueError(f"sinks: checkpoint shape {tuple(loaded.shape)} != {param.shape}")
        param.data.copy_(loaded)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        qkv, _ = self.qkv_proj(hidden_states)  # [T, (Hq + 2 Hkv) * D]
        # q [T, Hq*D], k [T, Hkv*D], v [T, Hkv*D]: strided views of qkv
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        out = rope_attention(self.rotary_emb, self.attn, positions, q, k, v, forward_batch)
        out, _ = self.o_proj(out)  # [T, hidden]
        return out


class GptOssDecoderLayer(nn.Module):
    """Pre-norm block (norm weights applied in float32, as in HF)."""

    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.self_attn = GptOssAttention(config, layer_id)
        self.mlp = GptOssMLP(config)
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, weight_in_fp32=True)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, weight_in_fp32=True)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        forward_batch: ForwardBatch,
        residual: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states, forward_batch)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class GptOssModel(nn.Module):
    """Embedding, decoder layers, final norm: token ids -> hidden states [T, hidden]."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [GptOssDecoderLayer(config, i) for i in range(config.num_hidden_layers)]
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, weight_in_fp32=True)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)  # [T, hidden]
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, forward_batch, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


# checkpoint suffix -> (our parameter suffix, TopKExperts shard_id)
_EXPERT_PARAMS = {
    "experts.gate_up_proj": ("experts.w13_weight", "gate_up_t_interleaved"),
    "experts.gate_up_proj_bias": ("experts.w13_bias", "gate_up_bias_interleaved"),
    "experts.down_proj": ("experts.w2_weight", "down_t"),
    "experts.down_proj_bias": ("experts.w2_bias", "down"),
}
_STACKED = (
    (".qkv_proj", ".q_proj", "q"),
    (".qkv_proj", ".k_proj", "k"),
    (".qkv_proj", ".v_proj", "v"),
)


class GptOssForCausalLM(nn.Module):
    """gpt-oss with its LM head. forward(input_ids, positions, forward_batch) -> logits output."""

    def __init__(self, config: ModelConfig, quant_config: object = None, prefix: str = "") -> None:
        super().__init__()
        if config.num_local_experts <= 0 or config.num_experts_per_tok <= 0:
            raise ValueError("gpt-oss config needs num_local_experts and num_experts_per_tok")
        self.config = config
        self.model = GptOssModel(config)
        if config.tie_word_embeddings:
            self.lm_head = self.model.embed_tokens
        else:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        self.logits_processor = LogitsProcessor(config.vocab_size, config.final_logit_softcapping)

    @torch.no_grad()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch
    ) -> LogitsProcessorOutput:
        """input_ids, positions: int64 [T] -> LogitsProcessorOutput (float32 [B, V])."""
        hidden_states = self.model(input_ids, positions, forward_batch)
        return self.logits_processor(input_ids, hidden_states, self.lm_head, forward_batch)

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
            if self.config.tie_word_embeddings and name.startswith("lm_head."):
                continue
            rest.append((name, w))
        if pending_mxfp4:
            raise ValueError(
                f"MXFP4 tensors without their blocks/scales pair: {list(pending_mxfp4)}"
            )
        loaded |= load_stacked_weights(self, rest, _STACKED)
        if self.config.tie_word_embeddings:
            loaded.add("lm_head.weight")
        return loaded

    def _load_mxfp4_expert(
        self, ckpt_base: str, blocks: torch.Tensor, scales: torch.Tensor
    ) -> set[str]:
        """An MXFP4 expert pair (<prefix>.experts.{gate_up,down}_proj _blocks / _scales) into the
        layer's TopKExperts: packed, or dequantised at load (see TopKExperts.load_mxfp4)."""
        prefix, proj = ckpt_base.rsplit(".", 1)  # "<...>.mlp.experts", "gate_up_proj"
        if proj not in ("gate_up_proj", "down_proj"):
            raise KeyError(f"MXFP4 tensor {ckpt_base!r} matches no model parameter")
        try:
            experts = self.get_submodule(prefix)
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
