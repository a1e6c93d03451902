"""MXFP4 (OCP microscaling FP4) dequantisation, for gpt-oss checkpoints loaded as bf16/fp32.

A block of 32 values shares one E8M0 scale (2 ** (s - 127)); each value is an E2M1 nibble, two
per byte, low nibble first.
"""

from __future__ import annotations

import torch

FP4_VALUES = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)


def dequantize_mxfp4(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """blocks uint8 [..., G, 16] and scales uint8 [..., G] -> dtype [..., G * 32].

    Parameters
    ----------
    blocks : packed nibbles; byte j of group g holds values 2j (low) and 2j+1 (high).
    scales : E8M0 exponents (biased by 127), one per group of 32 values.
    """
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise TypeError(f"MXFP4 blocks/scales must be uint8, got {blocks.dtype}/{scales.dtype}")
    if blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} disagree"
        )
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    lo = lut[(blocks & 0x0F).long()]  # [..., G, 16]
    hi = lut[(blocks >> 4).long()]  # [..., G, 16]
    vals = torch.stack([lo, hi], dim=-1).flatten(-2)  # [..., G, 32]: lo0 hi0 lo1 hi1 ...
    vals = torch.ldexp(vals, scales.to(torch.int32)[..., None] - 127)
    return vals.flatten(-2).to(dtype)  # [..., G * 32]


def dummy_mxfp4(
    shape: tuple[int, ...], generator: torch.Generator, is_scale: bool, scales: tuple = (118, 122)
) -> torch.Tensor:
    """Random packed MXFP4 data on the generator's device (dummy weights): uint8 [shape], any
    E2M1 pair per byte, or, with is_scale, E8M0 scales in [scales[0], scales[1]) (2**-9 .. 2**-6:
    weights of about N(0, 0.02) magnitude)."""
    lo, hi = (scales[0], scales[1]) if is_scale else (0, 256)
    dev = generator.device
    return torch.randint(lo, hi, shape, generator=generator, device=dev, dtype=torch.uint8)
