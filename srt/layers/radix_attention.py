"""RadixAttention: the attention layer of every model; the math lives in the attention backend.

It holds the layer's static description (head counts, scaling, sliding window, logit cap, sinks,
KV-cache scales) and forwards to `forward_batch.attn_backend.forward(...)`.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

import torch
from torch import nn

from srt.layers.quantization.base_config import QuantizationConfig, require_unquantized

if TYPE_CHECKING:
    from srt.model_executor.forward_batch_info import ForwardBatch

Scale = float | torch.Tensor | None


class AttentionType(enum.Enum):
    """SGLang's attention types; srt serves DECODER (causal self-attention)."""

    DECODER = "decoder"
    ENCODER_ONLY = "encoder_only"


def _refuse_unsupported(
    is_cross_attention: bool,
    pos_encoding_mode: str,
    logit_capping_method: str,
    attn_type: AttentionType,
    use_irope: bool,
) -> None:
    asked = {
        "is_cross_attention": (is_cross_attention, False),
        "pos_encoding_mode": (pos_encoding_mode, "NONE"),
        "logit_capping_method": (logit_capping_method, "tanh"),
        "attn_type": (attn_type, AttentionType.DECODER),
        "use_irope": (use_irope, False),
    }
    for name, (value, served) in asked.items():
        if value != served:
            raise NotImplementedError(
                f"RadixAttention({name}={value!r}) is not supported; srt serves {served!r}"
            )


class RadixAttention(nn.Module):
    """Attention over the paged KV cache.

    Parameters
    ----------
    num_heads : query heads on this rank (Hq).
    head_dim : q/k head size (D).
    scaling : softmax scale, usually D ** -0.5.
    num_kv_heads : K/V heads on this rank (Hkv); Hq % Hkv == 0 (GQA).
    layer_id : index of the layer in the KV pool.
    logit_cap : > 0 applies cap * tanh(logits / cap) before the softmax.
    v_head_dim : V head size (Dv); -1 means head_dim.
    sliding_window_size : -1 for full attention; otherwise SGLang's "window left" W: a query at
        position p sees keys at positions k with p - W <= k <= p (W + 1 keys). HF's
        `sliding_window` S corresponds to W = S - 1.
    is_cross_attention, pos_encoding_mode, logit_capping_method, attn_type, use_irope : SGLang's
        options; srt serves decoder self-attention with tanh capping only ("NONE", "tanh",
        AttentionType.DECODER, False): anything else raises at build time.
    quant_config : None, or a config that leaves attention unquantized (KV-cache scales are
        k_scale / v_scale).
    prefix : the layer's name in the model (messages).
    use_prefill_attention_wrapper : SGLang's prefill-graph option; no effect here.
    sinks : optional [Hq] per-head sink logits (gpt-oss): an extra softmax column with no value.
        Kept as a plain reference (not registered), so the owning module keeps the parameter.
    k_scale, v_scale : (keywords, like sinks) KV-cache scales: None, a positive float or a
        1-element float tensor; an fp8 cache stores x * (1 / scale).
    """

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        scaling: float,
        num_kv_heads: int,
        layer_id: int,
        logit_cap: float = 0.0,
        v_head_dim: int = -1,
        sliding_window_size: int = -1,
        is_cross_attention: bool = False,
        pos_encoding_mode: str = "NONE",
        logit_capping_method: str = "tanh",
        quant_config: QuantizationConfig | None = None,
        attn_type: AttentionType = AttentionType.DECODER,
        use_irope: bool = False,
        prefix: str = "",
        use_prefill_attention_wrapper: bool = True,
        *,
        sinks: torch.Tensor | None = None,
        k_scale: Scale = None,
        v_scale: Scale = None,
    ) -> None:
        super().__init__()
        _refuse_unsupported(
            is_cross_attention, pos_encoding_mode, logit_capping_method, attn_type, use_irope
        )
        require_unquantized(quant_config, "attention", prefix)
        if num_heads <= 0 or num_kv_heads <= 0 or num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads ({num_heads}) must be a positive multiple of num_kv_heads "
                f"({num_kv_heads})"
            )
        if head_dim <= 0:
            raise ValueError(f"head_dim must be positive, got {head_dim}")
        if sliding_window_size == 0 or sliding_window_size is None:
            sliding_window_size = -1
        self.tp_q_head_num = num_heads
        self.tp_k_head_num = num_kv_heads
        self.tp_v_head_num = num_kv_heads
        self.head_dim = head_dim
        self.qk_head_dim = head_dim
        self.v_head_dim = head_dim if v_head_dim == -1 else v_head_dim
        self.scaling = float(scaling)
        self.layer_id = layer_id
        self.sliding_window_size = int(sliding_window_size)
        self.logit_cap = float(logit_cap)
        # Plain attribute (bypasses nn.Module registration): the model owns the parameter.
        self.__dict__["sinks"] = sinks
        self.k_scale: Scale = k_scale
        self.v_scale: Scale = v_scale
        self.attn_type = attn_type
        self.prefix = prefix

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
        **kwargs,
    ) -> torch.Tensor:
        """Attention output for the batch's new tokens.

        Parameters
        ----------
        q : [T, Hq*D] or [T, Hq, D]; k : [T, Hkv*D] or [T, Hkv, D]; v : [T, Hkv*Dv] or
            [T, Hkv, Dv], model dtype (k and v already rotated / ready to cache).
        forward_batch : the batch (its attn_backend does the work).
        save_kv_cache : False when the RoPE kernel already stored K and V (fused path).
        **kwargs : passed to the backend; `sinks=` overrides the constructor's sinks.

        Returns
        -------
        [T, Hq*Dv], q's dtype.
        """
        if forward_batch.attn_backend is None:
            raise ValueError("forward_batch.attn_backend is None; the runner must set it")
        kwargs.setdefault("sinks", self.sinks)
        return forward_batch.attn_backend.forward(
            q, k, v, self, forward_batch, save_kv_cache=save_kv_cache, **kwargs
        )

    def extra_repr(self) -> str:
        return (
            f"layer_id={self.layer_id}, q_heads={self.tp_q_head_num}, "
            f"kv_heads={self.tp_k_head_num}, head_dim={self.head_dim}, "
            f"window={self.sliding_window_size}, sinks={self.sinks is not None}"
        )
