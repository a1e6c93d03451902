"""Context-extension variants of RotaryEmbedding: they differ only in how the cache is built.

Linear (position interpolation), dynamic NTK, YaRN (with the attention factor and gpt-oss's
`truncate` flag), DeepSeek-YaRN (`mscale` / `mscale_all_dim`) and Llama 3. Formulas follow HF
transformers' `modeling_rope_utils` and SGLang; everything is computed in float64 and the cache is
stored as float32. Forward (and the fused KV-cache write) is inherited unchanged.
"""

from __future__ import annotations

import math

import torch

from srt.layers.rotary_embedding.base import RotaryEmbedding


class LinearScalingRotaryEmbedding(RotaryEmbedding):
    """Position interpolation: position t uses angle (t / factor) * inv_freq.

    With several factors the caches are concatenated; `scaling_factor_to_offset[f]` is the row
    where factor f's positions start (pass it as `offsets`).
    """

    def __init__(
        self,
        head_size: int,
        rotary_dim: int,
        max_position_embeddings: int,
        base: float,
        is_neox_style: bool,
        scaling_factors: float | list[float],
        dtype: torch.dtype,
    ) -> None:
        factors = (
            [scaling_factors] if isinstance(scaling_factors, (int, float)) else scaling_factors
        )
        if not factors or any(not f > 0 for f in factors):
            raise ValueError(f"scaling_factors must be positive, got {scaling_factors!r}")
        self.scaling_factors = [float(f) for f in factors]
        self.scaling_factor_to_offset: dict[float, int] = {}
        super().__init__(head_size, rotary_dim, max_position_embeddings, base, is_neox_style, dtype)

    def _default_num_positions(self) -> int:
        return sum(int(self.max_position_embeddings * f) for f in self.scaling_factors)

    def _can_grow(self) -> bool:
        return len(self.scaling_factors) == 1  # several factors: rows are laid out by offset

    def _compute_cos_sin_cache(self) -> torch.Tensor:
        inv_freq = self._compute_inv_freq(self.base)  # [rot/2]
        caches, offset = [], 0
        for f in self.scaling_factors:
            n = int(self.max_position_embeddings * f)
            if len(self.scaling_factors) == 1:
                n = self.num_positions
            t = torch.arange(n, dtype=torch.float64) / f  # [n]
            freqs = torch.outer(t, inv_freq)  # [n, rot/2]
            caches.append(torch.cat((freqs.cos(), freqs.sin()), dim=-1))
            self.scaling_factor_to_offset[f] = offset
            offset += n
        return torch.cat(caches, dim=0)  # [sum n, rot]


class DynamicNTKScalingRotaryEmbedding(RotaryEmbedding):
    """Dynamic NTK: a larger base, fixed at the extended length max_position * factor."""

    def __init__(
        self,
        head_size: int,
        rotary_dim: int,
        max_position_embeddings: int,
        base: float,
        is_neox_style: bool,
        scaling_factor: float,
        dtype: torch.dtype,
    ) -> None:
        if not scaling_factor > 0:
            raise ValueError(f"scaling_factor must be positive, got {scaling_factor!r}")
        self.scaling_factor = float(scaling_factor)
        super().__init__(head_size, rotary_dim, max_position_embeddings, base, is_neox_style, dtype)

    def _default_num_positions(self) -> int:
        return int(self.max_position_embeddings * self.scaling_factor)

    def _compute_cos_sin_cache(self) -> torch.Tensor:
        f, rot = self.scaling_factor, self.rotary_dim
        max_len = int(self.max_position_embeddings * f)  # fixes the base, not the rows
        base = self.base * ((f * max_len / self.max_position_embeddings) - (f - 1)) ** (
            rot / (rot - 2)
        )
        inv_freq = self._compute_inv_freq(base)  # [rot/2]
        t = torch.arange(self.num_positions, dtype=torch.float64)  # [num_positions]
        freqs = torch.outer(t, inv_freq)  # [num_positions, rot/2]
        return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    """YaRN's attention-temperature factor 0.1 * mscale * ln(scale) + 1 (1 for scale <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_find_correction_range(
    low_rot: float, high_rot: float, dim: int, base: float, max_position: int, truncate: bool
) -> tuple[float, float]:
    """Dims whose wavelength lies between high_rot and low_rot rotations over max_position."""

    def correction_dim(num_rot: float) -> float:
        return (dim * math.log(max_position / (num_rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(low_rot), correction_dim(high_rot)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def yarn_linear_ramp_mask(low: float, high: float, dim: int) -> torch.Tensor:
    """float64 [dim]: 0 below low, 1 above high, linear in between."""
    if low == high:
        high += 0.001  # avoid a division by zero
    return ((torch.arange(dim, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)


class YaRNScalingRotaryEmbedding(RotaryEmbedding):
    """YaRN: blend of interpolated (low-frequency) and extrapolated (high-frequency) dims, with
    cos/sin scaled by the attention factor.

    `max_position_embeddings` is the ORIGINAL (pre-training) context; the cache covers
    max_position_embeddings * scaling_factor positions. The attention factor is
    `attention_factor` if given (HF), else yarn_get_mscale(scaling_factor) * attn_factor.
    `truncate=False` (gpt-oss) keeps the correction range unrounded.
    """

    def __init__(
        self,
        head_size: int,
        rotary_dim: int,
        max_position_embeddings: int,
        base: float,
        is_neox_style: bool,
        scaling_factor: float,
        dtype: torch.dtype,
        *,
        extrapolation_factor: float = 1.0,
        attn_factor: float = 1.0,
        beta_fast: float = 32,
        beta_slow: float = 1,
        truncate: bool = True,
        attention_factor: float | None = None,
    ) -> None:
        if not scaling_factor > 0:
            raise ValueError(f"scaling_factor must be positive, got {scaling_factor!r}")
        self.scaling_factor = float(scaling_factor)
        self.extrapolation_factor = extrapolation_factor
        self.beta_fast, self.beta_slow = beta_fast, beta_slow
        self.truncate = bool(truncate)
        self.mscale = float(
            attention_factor
            if attention_factor is not None
            else yarn_get_mscale(self.scaling_factor) * attn_factor
        )
        super().__init__(head_size, rotary_dim, max_position_embeddings, base, is_neox_style, dtype)

    def _yarn_inv_freq(self) -> torch.Tensor:
        rot = self.rotary_dim
        pos_freqs = self.base ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot)  # [rot/2]
        extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (self.scaling_factor * pos_freqs)
        low, high = yarn_find_correction_range(
            self.beta_fast,
            self.beta_slow,
            rot,
            self.base,
            self.max_position_embeddings,
            self.truncate,
        )
        extra_mask = (1 - yarn_linear_ramp_mask(low, high, rot // 2)) * self.extrapolation_factor
        return interpolation * (1 - extra_mask) + extrapolation * extra_mask

    def _default_num_positions(self) -> int:
        return int(self.max_position_embeddings * self.scaling_factor)

    def _compute_cos_sin_cache(self) -> torch.Tensor:
        inv_freq = self._yarn_inv_freq()  # [rot/2]
        t = torch.arange(self.num_positions, dtype=torch.float64)  # [num_positions]
        freqs = torch.outer(t, inv_freq)  # [num_positions, rot/2]
        return torch.cat((freqs.cos(), freqs.sin()), dim=-1) * self.mscale


class DeepseekScalingRotaryEmbedding(YaRNScalingRotaryEmbedding):
    """DeepSeek's YaRN: attention factor
    yarn_get_mscale(f, mscale) / yarn_get_mscale(f, mscale_all_dim) * attn_factor.

    DeepSeek models usually use is_neox_style=False.
    """

    def __init__(
        self,
        head_size: int,
        rotary_dim: int,
        max_position_embeddings: int,
        base: float,
        is_neox_style: bool,
        scaling_factor: float,
        dtype: torch.dtype,
        *,
        extrapolation_factor: float = 1.0,
        attn_factor: float = 1.0,
        beta_fast: float = 32,
        beta_slow: float = 1,
        mscale: float = 1.0,
        mscale_all_dim: float = 0.0,
        truncate: bool = True,
    ) -> None:
        self.mscale_param, self.mscale_all_dim = float(mscale), float(mscale_all_dim)
        factor = (
            yarn_get_mscale(scaling_factor, mscale)
            / yarn_get_mscale(scaling_factor, mscale_all_dim)
            * attn_factor
        )
        super().__init__(
            head_size,
            rotary_dim,
            max_position_embeddings,
            base,
            is_neox_style,
            scaling_factor,
            dtype,
            extrapolation_factor=extrapolation_factor,
            beta_fast=beta_fast,
            beta_slow=beta_slow,
            truncate=truncate,
            attention_factor=factor,
        )


class Llama3RotaryEmbedding(RotaryEmbedding):
    """Llama 3.1: low frequencies divided by `scaling_factor`, high ones kept, smooth between."""

    def __init__(
        self,
        head_size: int,
        rotary_dim: int,
        max_position_embeddings: int,
        base: float,
        is_neox_style: bool,
        dtype: torch.dtype,
        scaling_factor: float,
        low_freq_factor: float,
        high_freq_factor: float,
        original_max_position: int,
    ) -> None:
        if not scaling_factor > 0 or high_freq_factor == low_freq_factor:
            raise ValueError("llama3 rope needs factor > 0 and high_freq_factor != low_freq_factor")
        self.scaling_factor = float(scaling_factor)
        self.low_freq_factor, self.high_freq_factor = low_freq_factor, high_freq_factor
        self.original_max_position = original_max_position
        super().__init__(head_size, rotary_dim, max_position_embeddings, base, is_neox_style, dtype)

    def _compute_inv_freq(self, base: float) -> torch.Tensor:
        inv_freq = super()._compute_inv_freq(base)  # [rot/2]
        low_wavelen = self.original_max_position / self.low_freq_factor
        high_wavelen = self.original_max_position / self.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        smooth = (self.original_max_position / wavelen - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor
        )
        smoothed = (1 - smooth) * inv_freq / self.scaling_factor + smooth * inv_freq
        out = torch.where(wavelen > low_wavelen, inv_freq / self.scaling_factor, inv_freq)
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, out)
