"""Qwen3 (dense) for SRT: Llama's layout plus per-head RMSNorm on q and k before RoPE.

Read top to bottom: MLP -> Attention -> DecoderLayer -> Model -> ForCausalLM -> load_weights.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

import sgl_ext
from srt.configs.model_config import ModelConfig
from srt.layers.layernorm import RMSNorm
from srt.layers.linear import QKVParallelLinear, RowParallelLinear
from srt.layers.radix_attention import RadixAttention
from srt.layers.rotary_embedding import get_rope
from srt.models.llama import LlamaForCausalLM, LlamaMLP, LlamaModel, rope_attention
from srt.models.utils import create_fused_set_kv_buffer_arg, enable_fused_set_kv_buffer

if TYPE_CHECKING:
    from srt.model_executor.forward_batch_info import ForwardBatch

Qwen3MLP = LlamaMLP


class Qwen3Attention(nn.Module):
    """qkv projection -> q_norm / k_norm per head -> RoPE (+ fused KV write) -> attention.

    With the fused KV write enabled, one sgl_ext kernel does the norm, RoPE and the write.
    """

    # With the fused KV write enabled: q/k norm, RoPE and the cache write in one kernel
    # (sgl_ext.apply_qk_norm_rope_with_cos_sin_cache_inplace). False (on a layer or the class)
    # keeps the torch norm followed by the fused RoPE + KV op, for comparison.
    fuse_qk_norm: bool = True

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
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
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

    def _norm_heads(self, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        T = x.shape[0]
        x = norm(x.reshape(-1, self.head_dim))  # [T * H, D] (a copy of the strided view)
        return x.view(T, -1)  # [T, H * D]

    def _fused_qk_norm_rope(self, q: torch.Tensor, forward_batch: ForwardBatch) -> bool:
        """Whether one kernel does q/k norm, RoPE and the KV write (metadata only)."""
        return (
            self.fuse_qk_norm
            and self.q_norm.weight.dtype == q.dtype
            and enable_fused_set_kv_buffer(forward_batch)
        )

    def _qk_norm_rope_attention(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        forward_batch: ForwardBatch,
    ) -> torch.Tensor:
        """q [T, Hq*D], k [T, Hkv*D], v [T, Hkv*D] (views of qkv): q/k normalised and rotated
        in place, K and V stored by the same kernel, then attention without a second save."""
        rope = self.rotary_emb
        sgl_ext.apply_qk_norm_rope_with_cos_sin_cache_inplace(
            positions.reshape(-1),  # [T]
            q,
            k,
            self.head_dim,
            rope._cache_for(q.device),
            self.q_norm.weight,
            self.k_norm.weight,
            self.q_norm.variance_epsilon,
            is_neox=rope.is_neox_style,
            fused_set_kv_buffer_arg=create_fused_set_kv_buffer_arg(v, self.attn, forward_batch),
        )
        return self.attn(q, k, v, forward_batch, save_kv_cache=False)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        qkv, _ = self.qkv_proj(hidden_states)  # [T, (Hq + 2 Hkv) * D]
        # q [T, Hq*D], k [T, Hkv*D], v [T, Hkv*D]: strided views of qkv
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self._fused_qk_norm_rope(q, forward_batch):
            out = self._qk_norm_rope_attention(positions, q, k, v, forward_batch)
        else:
            q = self._norm_heads(q, self.q_norm)
            k = self._norm_heads(k, self.k_norm)
            out = rope_attention(self.rotary_emb, self.attn, positions, q, k, v, forward_batch)
        out, _ = self.o_proj(out)  # [T, hidden]
        return out


class Qwen3DecoderLayer(nn.Module):
    """Pre-norm block with the residual add fused into the next RMSNorm."""

    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.self_attn = Qwen3Attention(config, layer_id)
        self.mlp = Qwen3MLP(config.hidden_size, config.intermediate_size, config.mlp_bias)
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


class Qwen3Model(LlamaModel):
    """Embedding, Qwen3 decoder layers, final norm."""

    layer_cls = Qwen3DecoderLayer


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 with its (possibly tied) LM head; load_weights packs q/k/v and gate/up."""

    model_cls = Qwen3Model


EntryClass = Qwen3ForCausalLM
