"""Qwen3 (dense) for SRT: Llama's skeleton plus per-head RMSNorm on q and k before RoPE
(`has_qk_norm`; the step is `RopeAttention.norm_and_rope`)."""

from __future__ import annotations

from srt.models.common import CausalLM, DecoderLayer, DecoderModel, GatedMLP, RopeAttention


class Qwen3MLP(GatedMLP):
    """down(silu(gate(x)) * up(x)), as Llama's."""


class Qwen3Attention(RopeAttention):
    """qkv projection -> q_norm / k_norm per head -> RoPE (+ fused KV write) -> attention."""

    has_qk_norm = True


class Qwen3DecoderLayer(DecoderLayer):
    """Pre-norm block with the residual add fused into the next RMSNorm."""

    attention_cls = Qwen3Attention
    mlp_cls = Qwen3MLP


class Qwen3Model(DecoderModel):
    """Embedding, Qwen3 decoder layers, final norm."""

    layer_cls = Qwen3DecoderLayer


class Qwen3ForCausalLM(CausalLM):
    """Qwen3 with its (possibly tied) LM head; load_weights packs q/k/v and gate/up."""

    model_cls = Qwen3Model


EntryClass = Qwen3ForCausalLM
