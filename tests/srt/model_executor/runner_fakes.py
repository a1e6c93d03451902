"""A tiny stand-in model (real RadixAttention, real sgl_ext RoPE/KV op) for runner tests.

Lets the runner/scheduler tests run before, and independently of, the real model files: it has
the `XForCausalLM.forward(input_ids, positions, forward_batch)` interface, fuses the KV write into
RoPE when `forward_batch.enable_fused_rope_kv`, and returns [T, V] logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from sgl_ext import FusedSetKVBufferArg, apply_rope_with_cos_sin_cache_inplace
from srt.layers.radix_attention import RadixAttention


@dataclass(frozen=True)
class FakeConfig:
    vocab_size: int = 61
    hidden_size: int = 32
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 8
    context_len: int = 96
    eos_token_id: int | None = None


class FakeModel(nn.Module):
    def __init__(self, cfg: FakeConfig, dtype: torch.dtype, device: torch.device, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        H, Hq, D = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
        Hkv = cfg.num_key_value_heads
        self.cfg, self.D, self.Hq, self.Hkv = cfg, D, Hq, Hkv

        def w(*shape):
            return nn.Parameter((torch.randn(*shape, generator=g) / shape[-1] ** 0.5).to(dtype))

        self.embed = w(cfg.vocab_size, H)
        L = cfg.num_hidden_layers
        self.qkv = nn.ParameterList([w((Hq + 2 * Hkv) * D, H) for _ in range(L)])
        self.o = nn.ParameterList([w(H, Hq * D) for _ in range(cfg.num_hidden_layers)])
        self.lm_head = w(cfg.vocab_size, H)
        self.attn = nn.ModuleList(
            RadixAttention(Hq, D, D**-0.5, Hkv, i) for i in range(cfg.num_hidden_layers)
        )
        inv = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
        f = torch.outer(torch.arange(cfg.context_len + 8, dtype=torch.float32), inv)
        self.register_buffer("cos_sin_cache", torch.cat((f.cos(), f.sin()), dim=-1))
        self.to(device)

    def forward(self, input_ids, positions, forward_batch):
        fb = forward_batch
        h = self.embed[input_ids]  # [T, H]
        D, Hq, Hkv = self.D, self.Hq, self.Hkv
        for i, attn in enumerate(self.attn):
            x = h / (h.float().pow(2).mean(-1, keepdim=True) + 1e-6).sqrt().to(h.dtype)
            qkv = x @ self.qkv[i].t()  # [T, (Hq + 2 Hkv) D]
            q, k, v = qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1)  # strided views
            arg = None
            if fb.enable_fused_rope_kv:
                pool = fb.token_to_kv_pool
                arg = FusedSetKVBufferArg(
                    v,
                    pool.get_key_buffer(i),
                    pool.get_value_buffer(i),
                    None,
                    None,
                    fb.out_cache_loc,
                )
            apply_rope_with_cos_sin_cache_inplace(
                positions, q, k, D, self.cos_sin_cache, True, fused_set_kv_buffer_arg=arg
            )
            o = attn(q, k, v, fb, save_kv_cache=arg is None)  # [T, Hq*D]
            h = h + torch.tanh(o @ self.o[i].t())
        return h @ self.lm_head.t()  # [T, V]


def patch_builder(monkeypatch, cfg: FakeConfig = FakeConfig()) -> None:
    """Make ModelRunner build FakeModel instead of the registry's model."""
    from srt.model_executor import model_builder

    monkeypatch.setattr(model_builder, "build_model_config", lambda args: cfg)
    monkeypatch.setattr(
        model_builder,
        "build_model",
        lambda mc, args, dtype, device, *tp: FakeModel(mc, dtype, device, args.random_seed),
    )
