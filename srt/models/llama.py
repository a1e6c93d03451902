"""Llama (and Llama-architecture models: Mistral-style windows, partial rotary) for SRT.

The blocks are the shared skeleton of `srt.models.common` under SGLang's names: MLP ->
Attention -> DecoderLayer -> Model -> ForCausalLM. RoPE writes K and V into the KV cache when
the pool allows it, and attention then skips its own save.
"""

from __future__ import annotations

from srt.models.common import CausalLM, DecoderLayer, DecoderModel, GatedMLP, RopeAttention


class LlamaMLP(GatedMLP):
    """down(silu(gate(x)) * up(x)); gate_up_proj packs the checkpoint's gate_proj and up_proj."""


class LlamaAttention(RopeAttention):
    """Packed qkv projection, RoPE (fused with the KV write when allowed), attention, o_proj."""


class LlamaDecoderLayer(DecoderLayer):
    """Pre-norm block; the residual add is fused into the next RMSNorm."""

    attention_cls = LlamaAttention
    mlp_cls = LlamaMLP


class LlamaModel(DecoderModel):
    """Embedding, decoder layers, final norm: token ids -> hidden states [T, hidden]."""

    layer_cls = LlamaDecoderLayer


class LlamaForCausalLM(CausalLM):
    """Llama with its LM head. forward(input_ids, positions, forward_batch) -> logits output."""

    model_cls = LlamaModel


EntryClass = LlamaForCausalLM
