"""Test-only stand-in for srt.layers.rotary_embedding.get_rope (until the layers branch has it).

Default and YaRN (HF formula, incl. `truncate`) cos/sin caches, applied with sgl_ext's op.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from sgl_ext import apply_rope_with_cos_sin_cache_inplace


def _yarn_inv_freq(dim, base, s):
    factor = s["factor"]
    orig = s["original_max_position_embeddings"]
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def corr(rot):
        return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = corr(beta_fast), corr(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extra = 1 - ramp
    inv = (1.0 / (factor * pos)) * (1 - extra) + (1.0 / pos) * extra
    mscale = s.get("attention_factor") or (0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0)
    return inv, mscale


class StandInRope(nn.Module):
    def __init__(self, head_size, rotary_dim, max_position, base, is_neox_style, rope_scaling):
        super().__init__()
        self.head_size, self.is_neox_style = head_size, is_neox_style
        if rope_scaling and rope_scaling.get("rope_type") == "yarn":
            inv, mscale = _yarn_inv_freq(rotary_dim, base, rope_scaling)
        elif rope_scaling:
            raise NotImplementedError(rope_scaling)
        else:
            inv = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
            mscale = 1.0
        freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv[None]
        cache = torch.cat([freqs.cos() * mscale, freqs.sin() * mscale], dim=-1)
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def forward(self, positions, query, key, offsets=None, fused_set_kv_buffer_arg=None):
        cache = self.cos_sin_cache.to(query.device)
        apply_rope_with_cos_sin_cache_inplace(
            positions, query, key, self.head_size, cache, self.is_neox_style,
            fused_set_kv_buffer_arg,
        )  # fmt: skip
        return query, key


def get_rope(head_size, rotary_dim, max_position, base, is_neox_style=True, rope_scaling=None,
             dtype=None, partial_rotary_factor=1.0, **kw):  # fmt: skip
    if partial_rotary_factor < 1.0:
        rotary_dim = int(rotary_dim * partial_rotary_factor)
    return StandInRope(head_size, rotary_dim, max_position, base, is_neox_style, rope_scaling)
