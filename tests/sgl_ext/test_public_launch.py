"""sgl_ext.launch: the public surface other packages' Triton kernels use (srt's)."""

import re

import pytest
import torch

from sgl_ext import FusedSetKVBufferArg, launch


def test_every_name_is_documented():
    """Each exported name has its line in the module docstring, and every name is defined."""
    doc = launch.__doc__ or ""
    for name in launch.__all__:
        assert re.search(rf"^\s+{name}\b", doc, re.M), f"{name} is not in launch's docstring"
        assert getattr(launch, name) is not None


def test_kv_checks_name_the_argument():
    """The KV checks srt's pool runs: a bad buffer or argument raises naming it, a good one
    gives its layout."""
    buf = torch.zeros(5, 4, 2, 8)  # [pages, page_size, H, D]
    lay = launch.kv_layout("k_buffer", buf, 2, 8)
    assert (lay.num_slots, lay.page_size) == (20, 4)
    with pytest.raises(ValueError, match="my_buf has 2 heads"):
        launch.kv_layout("my_buf", buf, 3, 8)
    key = torch.randn(3, 2 * 8)
    with pytest.raises(TypeError, match="fused_set_kv_buffer_arg"):
        launch.check_fused_arg(key, object(), 8)
    v, loc = torch.randn(3, 2 * 8), torch.tensor([1, 2, 7])
    kv = launch.check_fused_arg(key, FusedSetKVBufferArg(v, buf, buf.clone(), None, None, loc), 8)
    assert kv.k_layout == lay


def test_next_pow2():
    assert [launch.next_pow2(n) for n in (0, 1, 2, 3, 17, 64, 65)] == [1, 1, 2, 4, 32, 64, 128]
