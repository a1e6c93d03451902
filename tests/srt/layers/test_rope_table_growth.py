"""RotaryEmbedding.ensure_cos_sin_cache_length: a grown table holds the formula's values."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from srt.layers.rotary_embedding import LinearScalingRotaryEmbedding, get_rope

D, THETA, MAXP = 16, 10000.0, 64

# rope_scaling -> rows of the table as built
CASES = {
    "default": (None, MAXP),
    "linear": ({"rope_type": "linear", "factor": 2.0}, 2 * MAXP),
    "dynamic": ({"rope_type": "dynamic", "factor": 3.0}, 3 * MAXP),
    "yarn": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}, 64),
    "llama3": (
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
        MAXP,
    ),
}


def hf_table(name: str, rows: int) -> torch.Tensor:
    """float64 [rows, D]: cos | sin of t * inv_freq (times the attention factor), HF's inv_freq."""
    scaling, built = CASES[name]
    params = dict(scaling or {"rope_type": "default"}, rope_theta=THETA)
    cfg = LlamaConfig(
        hidden_size=2 * D,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=D,
        max_position_embeddings=MAXP,
        rope_parameters=params,
    )
    if params["rope_type"] == "default":  # not in ROPE_INIT_FUNCTIONS on transformers 5
        inv, att = 1.0 / THETA ** (torch.arange(0, D, 2, dtype=torch.float64) / D), 1.0
    else:
        seq_len = built if params["rope_type"] == "dynamic" else None  # our fixed NTK base
        inv, att = ROPE_INIT_FUNCTIONS[params["rope_type"]](cfg, "cpu", seq_len=seq_len)
    t = torch.arange(rows, dtype=torch.float64)
    if params["rope_type"] == "linear":
        t = t / params["factor"]  # HF folds the factor into inv_freq; same angle
        inv = inv * params["factor"]
    freqs = torch.outer(t, inv.double())  # [rows, D/2]
    return torch.cat((freqs.cos(), freqs.sin()), -1) * att


@pytest.mark.parametrize("name", sorted(CASES))
def test_grown_table_extends_the_formula(name):
    scaling, built = CASES[name]
    rope = copy.deepcopy(get_rope(D, D, MAXP, THETA, True, scaling, torch.float32))
    before = rope.cos_sin_cache.clone()
    assert before.shape == (built, D)
    rope.ensure_cos_sin_cache_length(built - 5)  # shorter: nothing changes
    assert rope.cos_sin_cache.shape == (built, D)
    rows = built + 37
    rope.ensure_cos_sin_cache_length(rows)
    grown = rope.cos_sin_cache
    assert grown.dtype == torch.float32 and grown.shape == (rows, D) and grown.is_contiguous()
    torch.testing.assert_close(grown[:built], before, rtol=0, atol=1e-7)
    torch.testing.assert_close(grown.double(), hf_table(name, rows), rtol=1e-5, atol=3e-5)


def test_grown_table_rotates_past_the_old_end():
    rope = copy.deepcopy(get_rope(D, D, MAXP, THETA, True, None, torch.float32))
    rope.ensure_cos_sin_cache_length(2 * MAXP + 1)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(3, 2 * D, generator=g), torch.randn(3, D, generator=g)
    pos = torch.tensor([0, MAXP + 1, 2 * MAXP])
    q_ref, k_ref = q.double().clone(), k.double().clone()
    rope.forward(pos, q, k)
    table = hf_table("default", 2 * MAXP + 1)[pos]  # [3, D]
    cos, sin = table[:, None, : D // 2], table[:, None, D // 2 :]  # [3, 1, D/2]
    for got, x in ((q, q_ref), (k, k_ref)):
        x1, x2 = x.view(3, -1, D).chunk(2, -1)  # [3, H, D/2]
        want = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1).view(3, -1)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_table_that_cannot_grow_is_rejected_naming_both_numbers():
    rope = LinearScalingRotaryEmbedding(D, D, MAXP, THETA, True, [1.0, 2.0], torch.float32)
    rows = rope.cos_sin_cache.shape[0]
    assert rows == 3 * MAXP
    with pytest.raises(ValueError, match=rf"context length 1000 .*{rows}-row"):
        rope.ensure_cos_sin_cache_length(1000)
    assert rope.cos_sin_cache.shape[0] == rows
    rope.ensure_cos_sin_cache_length(rows)  # fits: fine
    with pytest.raises(TypeError, match="num_positions"):
        rope.ensure_cos_sin_cache_length(10.0)
