"""Llama (and Llama-architecture models: Mistral-style windows, partial rotary) for SRT.

Read top to bottom: MLP -> Attention -> DecoderLayer -> Model -> ForCausalLM -> load_weights.
The attention layer lets RoPE write K and V into the KV cache when the pool allows it
(`enable_fused_set_kv_buffer`), and then runs attention with `save_kv_cache=False`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from srt.configs.model_config import ModelConfig
from srt.layers.activation import SiluAndMul
from srt.layers.layernorm import RMSNorm
from srt.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from srt.layers.logits_processor import LogitsProcessor, LogitsProcessorOutput
from srt.layers.radix_attention import RadixAttention
from srt.layers.rotary_embedding import get_rope
from srt.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from srt.models.utils import create_fused_set_kv_buffer_arg, enable_fused_set_kv_buffer
from srt.models.weight_utils import LLAMA_STACKED_PARAMS, load_stacked_weights

if TYPE_CHECKING:
    from srt.model_executor.forward_batch_info import ForwardBatch


class LlamaMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate and up packed in one matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size] * 2, bias=bias, prefix="gate_up_proj"
        )
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up, _ = self.gate_up_proj(x)  # [T, 2 * I]
        out, _ = self.down_proj(self.act_fn(gate_up))  # [T, I] -> [T, hidden]
        return out


def rope_attention(
    rotary_emb: nn.Module,
    attn: RadixAttention,
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    forward_batch: ForwardBatch,
) -> torch.Tensor:
    """RoPE then attention; RoPE also stores K/V when fusion is enabled (then no second save).

    q [T, Hq*D], k [T, Hkv*D], v [T, Hkv*Dv]: views of the qkv output, rotated in place.
    """
    if enable_fused_set_kv_buffer(forward_batch):
        arg = create_fused_set_kv_buffer_arg(v, attn, forward_batch)
        q, k = rotary_emb(positions, q, k, fused_set_kv_buffer_arg=arg)
        return attn(q, k, v, forward_batch, save_kv_cache=False)
    q, k = rotary_emb(positions, q, k)
    return attn(q, k, v, forward_batch)


class LlamaAttention(nn.Module):
    """Packed qkv projection, RoPE (fused with the KV write when allowed), attention, o_proj."""

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
        self.rotary_emb = get_rope(
            self.head_dim,
            rotary_dim=self.head_dim,
            max_position=config.max_position_embeddings,
            base=config.rope_theta,
            is_neox_style=config.rope_is_neox_style,
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
        )

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        qkv, _ = self.qkv_proj(hidden_states)  # [T, (Hq + 2 Hkv) * D]
        # q [T, Hq*D], k [T, Hkv*D], v [T, Hkv*D]: strided views of qkv
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        out = rope_attention(self.rotary_emb, self.attn, positions, q, k, v, forward_batch)
        out, _ = self.o_proj(out)  # [T, hidden]
        return out


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block; the residual add is fused into the next RMSNorm."""

    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_id)
        self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size, config.mlp_bias)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

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


class LlamaModel(nn.Module):
    """Embedding, decoder layers, final norm: token ids -> hidden states [T, hidden]."""

    layer_cls = LlamaDecoderLayer

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [self.layer_cls(config, i) for i in range(config.num_hidden_layers)]
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)  # [T, hidden]
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, forward_batch, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    """Llama with its LM head. forward(input_ids, positions, forward_batch) -> logits output."""

    model_cls = LlamaModel
    stacked_params_mapping = LLAMA_STACKED_PARAMS

    def __init__(self, config: ModelConfig, quant_config: object = None, prefix: str = "") -> None:
        super().__init__()
        self.config = config
        self.model = self.model_cls(config)
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
        """Load HF-named tensors; q/k/v and gate/up go into the packed parameters.

        Returns the names of the parameters that were loaded.
        """

        def rename(name: str) -> str | None:
            if self.config.tie_word_embeddings and name.startswith("lm_head."):
                return None  # tied: the embedding provides it
            return name

        loaded = load_stacked_weights(self, weights, self.stacked_params_mapping, rename=rename)
        if self.config.tie_word_embeddings:
            loaded.add("lm_head.weight")
        return loaded


EntryClass = LlamaForCausalLM
