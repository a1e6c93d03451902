"""enable_fused_set_kv_buffer / create_fused_set_kv_buffer_arg and the model registry."""

import pytest
import torch

from sgl_ext import FusedSetKVBufferArg
from srt.layers.radix_attention import RadixAttention
from srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from srt.models.registry import get_model_class, supported_architectures
from srt.models.utils import create_fused_set_kv_buffer_arg, enable_fused_set_kv_buffer
from tests.srt.models.fb_harness import StandInKVPool, make_kv_pool


def _fb(pool, fused=True):
    return ForwardBatch(
        ForwardMode.DECODE,
        2,
        torch.zeros(2, dtype=torch.int64),
        torch.arange(2),
        torch.tensor([3, 4]),
        torch.tensor([5, -1]),
        7,
        token_to_kv_pool=pool,
        enable_fused_rope_kv=fused,
    )


@pytest.mark.parametrize(
    "dtype",
    [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2],
)
@pytest.mark.parametrize("page_size", [1, 16])
def test_enabled_for_supported_pools(dtype, page_size):
    pool = make_kv_pool(64, page_size, dtype, 2, 8, 2, "cpu")
    assert enable_fused_set_kv_buffer(_fb(pool))
    assert not enable_fused_set_kv_buffer(_fb(pool, fused=False))


def test_disabled_for_unsupported_pools():
    assert not enable_fused_set_kv_buffer(_fb(None))

    class MLAPool:  # no per-layer K/V buffers
        dtype = torch.bfloat16

    assert not enable_fused_set_kv_buffer(_fb(MLAPool()))
    odd = StandInKVPool(64, 1, torch.float32, 2, 8, 1, "cpu")
    odd.dtype = torch.float64
    assert not enable_fused_set_kv_buffer(_fb(odd))
    cols = StandInKVPool(64, 1, torch.float32, 2, 8, 1, "cpu")
    cols.k_buffer = [b.transpose(1, 2) for b in cols.k_buffer]  # last dim not contiguous
    assert not enable_fused_set_kv_buffer(_fb(cols))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn])
def test_create_arg_uses_layer_buffers_scales_and_out_cache_loc(dtype):
    pool = make_kv_pool(64, 16, dtype, 2, 8, 3, "cpu")
    layer = RadixAttention(4, 8, 0.3, 2, layer_id=2, k_scale=0.5, v_scale=torch.tensor([2.0]))
    fb = _fb(pool)
    v = torch.randn(2, 16)
    arg = create_fused_set_kv_buffer_arg(v, layer, fb)
    assert isinstance(arg, FusedSetKVBufferArg)
    assert arg.value is v and arg.cache_loc is fb.out_cache_loc
    kb, vb = pool.get_key_buffer(2), pool.get_value_buffer(2)
    assert arg.k_buffer.data_ptr() == kb.data_ptr() and arg.k_buffer.shape == kb.shape
    assert arg.v_buffer.data_ptr() == vb.data_ptr()
    if dtype == torch.float32:  # non-fp8 pools ignore scales, as their set_kv_buffer does
        assert arg.k_scale is None and arg.v_scale is None
    else:
        assert arg.k_scale == 0.5 and arg.v_scale is layer.v_scale


def test_registry():
    assert {"LlamaForCausalLM", "Qwen3ForCausalLM", "GptOssForCausalLM"} <= set(
        supported_architectures()
    )
    assert get_model_class("Qwen3ForCausalLM").__name__ == "Qwen3ForCausalLM"
    assert get_model_class("MistralForCausalLM").__name__ == "LlamaForCausalLM"
    with pytest.raises(ValueError, match="unsupported architecture"):
        get_model_class("Foo")
