"""KVPoolConfig / KVPoolCache: a pool is reused only for its full configuration, always zeroed."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from srt.mem_cache.pool_reuse import KVPoolCache, KVPoolConfig

BASE = KVPoolConfig(
    size=8,
    page_size=2,
    kv_cache_dtype=torch.float8_e4m3fn,
    model_dtype=torch.bfloat16,
    head_num=2,
    head_dim=4,
    layer_num=2,
    device="cpu",
    k_scale=0.5,
    v_scale=0.25,
)

# One change per field: every one of them must give a different pool.
VARIANTS = {
    "size": 10,
    "page_size": 4,
    "kv_cache_dtype": torch.float8_e5m2,
    "model_dtype": torch.float16,
    "head_num": 3,
    "head_dim": 8,
    "layer_num": 3,
    "v_head_dim": 2,
    "start_layer": 1,
    "cross_layer_layout": True,
    "k_scale": 0.75,
    "v_scale": (0.25, 0.5),
    "extra": (("attention_layout", "HND"),),
}


def test_variants_cover_every_field():
    assert set(VARIANTS) == {f.name for f in dataclasses.fields(KVPoolConfig)} - {"device"}


def test_same_config_reuses_the_pool_zeroed():
    cache = KVPoolCache(max_pools=2)
    pool = cache.get(BASE)
    for b in pool.k_buffer + pool.v_buffer:
        b.fill_(0x5A)  # a previous run's data
    pool.set_stream_overlap(True)
    again = cache.get(dataclasses.replace(BASE))  # equal, distinct object
    assert again is pool
    assert all(not b.any() for b in again.k_buffer + again.v_buffer)
    assert again._stream_overlap is False  # the new runner must opt in again


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_any_field_change_gives_a_different_pool(name):
    other = dataclasses.replace(BASE, **{name: VARIANTS[name]})
    assert other != BASE
    cache = KVPoolCache(max_pools=2)
    a, b = cache.get(BASE), cache.get(other)
    assert a is not b
    assert cache.get(BASE) is a  # still cached, not confused with `other`


def test_pool_matches_its_config():
    cfg = dataclasses.replace(BASE, cross_layer_layout=True, start_layer=3)
    pool = KVPoolCache().get(cfg)
    assert pool.dtype == torch.float8_e4m3fn and pool.page_size == 2 and pool.cross_layer_layout
    assert tuple(pool.get_key_buffer(4).shape) == (5, 2, 2, 4)


def test_eviction_and_normalisation():
    cache = KVPoolCache(max_pools=1)
    a = cache.get(BASE)
    b = cache.get(dataclasses.replace(BASE, k_scale=1.0))
    assert BASE not in cache and len(cache) == 1 and a is not b
    # device strings and int scales normalise, so equal configurations compare equal
    assert dataclasses.replace(BASE, device=torch.device("cpu"), k_scale=1) == dataclasses.replace(
        BASE, k_scale=1.0
    )


def test_bad_configs_raise():
    with pytest.raises(TypeError, match="kv_cache_dtype"):
        dataclasses.replace(BASE, kv_cache_dtype=torch.int8)
    with pytest.raises(TypeError, match="model_dtype"):
        dataclasses.replace(BASE, model_dtype=torch.int32)
    with pytest.raises(ValueError, match="k_scale"):
        dataclasses.replace(BASE, k_scale=-1.0)
    with pytest.raises(TypeError, match="v_scale"):
        dataclasses.replace(BASE, v_scale=torch.ones(1))
    with pytest.raises(TypeError, match="KVPoolConfig"):
        KVPoolCache().get({"size": 8})
    with pytest.raises(dataclasses.FrozenInstanceError):
        BASE.size = 3  # type: ignore[misc]
