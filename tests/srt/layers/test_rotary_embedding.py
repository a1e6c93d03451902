"""Rotary embeddings vs HF transformers' rope functions for every rope_type; the fused KV write."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.gptj.modeling_gptj import apply_rotary_pos_emb as gptj_apply
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as llama_apply

import sgl_ext
from srt.layers.rotary_embedding import (
    DeepseekScalingRotaryEmbedding,
    DynamicNTKScalingRotaryEmbedding,
    LinearScalingRotaryEmbedding,
    Llama3RotaryEmbedding,
    RotaryEmbedding,
    YaRNScalingRotaryEmbedding,
    get_rope,
)

# Runs the Triton kernels in the interpreter on CPU tensors (CI); on a CUDA machine the GPU tests
# cover the compiled kernels, and TRITON_INTERPRET is off there.
interpreter_only = pytest.mark.skipif(torch.cuda.is_available(), reason="Triton interpreter test")

D, HQ, HKV, THETA, MAXP = 16, 3, 1, 10000.0, 64

# name -> (HF rope_parameters extras, our rope_scaling, expected class, is_neox, partial factor)
CASES = {
    "default": ({"rope_type": "default"}, None, RotaryEmbedding, True, 1.0),
    "default_gptj": ({"rope_type": "default"}, None, RotaryEmbedding, False, 1.0),
    "partial": ({"rope_type": "default"}, None, RotaryEmbedding, True, 0.5),
    "linear": (
        {"rope_type": "linear", "factor": 2.0},
        {"type": "linear", "factor": 2.0},
        LinearScalingRotaryEmbedding,
        True,
        1.0,
    ),
    "dynamic": (
        {"rope_type": "dynamic", "factor": 3.0},
        {"rope_type": "dynamic", "factor": 3.0},
        DynamicNTKScalingRotaryEmbedding,
        True,
        1.0,
    ),
    "yarn": (
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
        None,
        YaRNScalingRotaryEmbedding,
        True,
        1.0,
    ),
    "yarn_gpt_oss": (
        {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 16,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
        },
        None,
        YaRNScalingRotaryEmbedding,
        True,
        1.0,
    ),
    "yarn_attention_factor": (
        {
            "rope_type": "yarn",
            "factor": 2.0,
            "attention_factor": 1.3,
            "original_max_position_embeddings": 32,
        },
        None,
        YaRNScalingRotaryEmbedding,
        True,
        1.0,
    ),
    "yarn_partial": (
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
        None,
        YaRNScalingRotaryEmbedding,
        True,
        0.5,
    ),
    "deepseek_yarn": (
        {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 16,
            "mscale": 1.0,
            "mscale_all_dim": 0.5,
            "beta_fast": 32,
            "beta_slow": 1,
        },
        {
            "rope_type": "deepseek_yarn",
            "factor": 4.0,
            "mscale": 1.0,
            "mscale_all_dim": 0.5,
            "original_max_position_embeddings": 16,
            "beta_fast": 32,
            "beta_slow": 1,
        },
        DeepseekScalingRotaryEmbedding,
        False,
        1.0,
    ),
    "llama3": (
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
        None,
        Llama3RotaryEmbedding,
        True,
        1.0,
    ),
}


def hf_cos_sin(name: str) -> tuple[torch.Tensor, torch.Tensor, int]:
    """float64 HF-derived (cos, sin) [N, rot/2] and N, from ROPE_INIT_FUNCTIONS."""
    params, _, cls, _, prf = CASES[name]
    rope_type = params["rope_type"]
    cfg = LlamaConfig(
        hidden_size=HQ * D,
        num_attention_heads=HQ,
        num_key_value_heads=HKV,
        head_dim=D,
        max_position_embeddings=MAXP,
        rope_parameters={**params, "rope_theta": THETA, "partial_rotary_factor": prf},
    )
    if rope_type == "default":
        rot = int(D * prf)
        inv = 1.0 / THETA ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot)
        att, n = 1.0, MAXP
    else:
        factor = params["factor"]
        n = {"linear": int(MAXP * factor), "dynamic": int(MAXP * factor), "llama3": MAXP}.get(
            rope_type, int(params.get("original_max_position_embeddings", 0) * factor)
        )
        seq_len = n if rope_type == "dynamic" else None
        inv, att = ROPE_INIT_FUNCTIONS[rope_type](cfg, "cpu", seq_len=seq_len)
    freqs = torch.outer(torch.arange(n, dtype=torch.float64), inv.double())  # [N, rot/2]
    return freqs.cos() * att, freqs.sin() * att, n


def our_rope(name: str) -> RotaryEmbedding:
    params, ours, cls, neox, prf = CASES[name]
    scaling = ours if ours is not None else params
    rope = get_rope(D, D, MAXP, THETA, neox, scaling, torch.float32, partial_rotary_factor=prf)
    assert type(rope) is cls
    return rope


@pytest.mark.parametrize("name", sorted(CASES))
def test_cos_sin_cache_matches_hf(name):
    rope = our_rope(name)
    cos, sin, n = hf_cos_sin(name)
    cache = rope.cos_sin_cache
    assert cache.dtype == torch.float32 and tuple(cache.shape) == (n, 2 * cos.shape[1])
    half = cache.shape[1] // 2
    torch.testing.assert_close(cache[:, :half].double(), cos, atol=3e-5, rtol=1e-5)
    torch.testing.assert_close(cache[:, half:].double(), sin, atol=3e-5, rtol=1e-5)


def hf_rotate(x: torch.Tensor, pos: torch.Tensor, name: str) -> torch.Tensor:
    """HF's rotation of x [T, H*D] (float64), via a model's apply_rotary_pos_emb."""
    _, _, _, neox, _ = CASES[name]
    cos, sin, _ = hf_cos_sin(name)
    rot = 2 * cos.shape[1]
    xs = x.double().view(x.shape[0], -1, D)  # [T, H, D]
    xr = xs[..., :rot]
    if neox:
        c = torch.cat((cos, cos), -1)[pos][None]  # [1, T, rot]
        s = torch.cat((sin, sin), -1)[pos][None]
        out, _ = llama_apply(xr.transpose(0, 1)[None], xr.transpose(0, 1)[None], c, s)
        out = out[0].transpose(0, 1)  # [T, H, rot]
    else:
        out = gptj_apply(xr[None], sin[pos][None], cos[pos][None])[0]  # [T, H, rot]
    return torch.cat((out, xs[..., rot:]), -1).reshape(x.shape)


@pytest.mark.parametrize("path", ["forward", "forward_native"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_rotated_q_k_match_hf(name, path):
    torch.manual_seed(hash(name) % 1000)
    rope = our_rope(name)
    n = rope.cos_sin_cache.shape[0]
    T = 7
    pos = torch.randint(0, n, (T,))
    pos[0] = n - 1
    q, k = torch.randn(T, HQ * D), torch.randn(T, HKV, D)  # 2-D query, 3-D key
    want_q, want_k = hf_rotate(q, pos, name), hf_rotate(k.view(T, -1), pos, name)
    out_q, out_k = getattr(rope, path)(pos, q, k)
    assert out_q is q and out_k is k  # in place
    torch.testing.assert_close(q.double(), want_q, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(k.view(T, -1).double(), want_k, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("path", ["forward", "forward_native"])
def test_bf16_strided_qkv_views_and_offsets(path):
    torch.manual_seed(3)
    rope = our_rope("llama3")
    T = 33
    qkv = torch.randn(T, (HQ + 2 * HKV) * D, dtype=torch.bfloat16)
    q, k, _ = qkv.split([HQ * D, HKV * D, HKV * D], dim=-1)  # strided views of qkv
    pos, off = torch.randint(0, 60, (T,)), torch.randint(0, 4, (T,))
    want_q, want_k = (
        hf_rotate(q.float(), pos + off, "llama3"),
        hf_rotate(k.float(), pos + off, "llama3"),
    )
    getattr(rope, path)(pos, q, k, offsets=off)
    torch.testing.assert_close(q.double(), want_q, atol=2e-2, rtol=1.6e-2)
    torch.testing.assert_close(k.double(), want_k, atol=2e-2, rtol=1.6e-2)


def make_fused(T: int, page_size: int, kv_dtype: torch.dtype, in_dtype=torch.float32):
    slots = 4 * page_size + 8
    shape = (slots, HKV, D) if page_size == 1 else (slots // page_size, page_size, HKV, D)
    kbuf = torch.full(shape, 7.0).to(kv_dtype)  # poison
    vbuf = torch.full(shape, 7.0).to(kv_dtype)
    loc = torch.randperm(slots)[:T]
    loc[1] = -1
    v = torch.randn(T, HKV * D, dtype=in_dtype)
    scale = 0.5 if kv_dtype == torch.float8_e4m3fn else None
    return sgl_ext.FusedSetKVBufferArg(v, kbuf, vbuf, scale, scale, loc)


def rows(buf: torch.Tensor, loc: torch.Tensor) -> torch.Tensor:
    if buf.ndim == 3:
        return buf[loc]
    ps = buf.shape[1]
    return buf[loc // ps, loc % ps]


def quant(x: torch.Tensor, dtype: torch.dtype, scale: float | None) -> torch.Tensor:
    if scale is None:
        return x.to(dtype)
    m = torch.finfo(dtype).max
    return (x.double() / scale).clamp(-m, m).float().to(dtype)


@pytest.mark.parametrize("path", ["forward", "forward_native"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_fused_arg_writes_the_cache_in_every_forward(name, path):
    torch.manual_seed(5)
    rope = our_rope(name)
    T = 7
    for page_size, kv_dtype in ((1, torch.float32), (4, torch.float8_e4m3fn)):
        arg = make_fused(T, page_size, kv_dtype)
        pos = torch.randint(0, rope.cos_sin_cache.shape[0], (T,))
        q, k = torch.randn(T, HQ * D), torch.randn(T, HKV * D)
        q_ref, k_ref = q.clone(), k.clone()
        rope.forward_native(pos, q_ref, k_ref)  # rotation alone
        v0 = arg.value.clone()
        getattr(rope, path)(pos, q, k, fused_set_kv_buffer_arg=arg)
        torch.testing.assert_close(k, k_ref, atol=1e-6, rtol=1e-6)
        assert torch.equal(arg.value, v0)
        w = arg.cache_loc >= 0
        k_rows = k.view(T, HKV, D)[w]
        v_rows = arg.value.view(T, HKV, D)[w]
        got_k, got_v = rows(arg.k_buffer, arg.cache_loc[w]), rows(arg.v_buffer, arg.cache_loc[w])
        assert torch.equal(
            got_v.view(torch.uint8), quant(v_rows, kv_dtype, arg.v_scale).view(torch.uint8)
        )
        assert torch.equal(
            got_k.view(torch.uint8), quant(k_rows, kv_dtype, arg.k_scale).view(torch.uint8)
        )
        written = torch.zeros(arg.k_buffer.numel() // (HKV * D), dtype=torch.bool)
        written[arg.cache_loc[w]] = True
        untouched = arg.k_buffer.reshape(-1, HKV, D)[~written].float()
        assert (untouched == 7.0).all()  # nothing else was written


@interpreter_only
@pytest.mark.parametrize("name", ["yarn_gpt_oss", "default_gptj", "partial"])
def test_triton_backend_fused(name, backend):
    backend("triton")
    torch.manual_seed(6)
    rope = our_rope(name)
    T = 5
    arg = make_fused(T, 4, torch.bfloat16, torch.bfloat16)
    pos = torch.randint(0, rope.cos_sin_cache.shape[0], (T,))
    q = torch.randn(T, HQ * D, dtype=torch.bfloat16)
    k = torch.randn(T, HKV * D, dtype=torch.bfloat16)
    want_q, want_k = hf_rotate(q.float(), pos, name), hf_rotate(k.float(), pos, name)
    rope.forward(pos, q, k, fused_set_kv_buffer_arg=arg)
    torch.testing.assert_close(q.double(), want_q, atol=2e-2, rtol=1.6e-2)
    torch.testing.assert_close(k.double(), want_k, atol=2e-2, rtol=1.6e-2)
    w = arg.cache_loc >= 0
    assert torch.equal(rows(arg.k_buffer, arg.cache_loc[w]), k.view(T, HKV, D)[w])
    assert torch.equal(rows(arg.v_buffer, arg.cache_loc[w]), arg.value.view(T, HKV, D)[w])


@pytest.mark.parametrize("path", ["forward", "forward_native"])
def test_bad_fused_arg_raises_before_rotating(path):
    rope = our_rope("default")
    q, k = torch.randn(3, HQ * D), torch.randn(3, HKV * D)
    q0 = q.clone()
    with pytest.raises(TypeError, match="FusedSetKVBufferArg"):
        getattr(rope, path)(torch.arange(3), q, k, fused_set_kv_buffer_arg=(1, 2))
    arg = make_fused(3, 1, torch.float32)
    arg.cache_loc = arg.cache_loc[:2]  # wrong length
    with pytest.raises(ValueError, match="cache_loc"):
        getattr(rope, path)(torch.arange(3), q, k, fused_set_kv_buffer_arg=arg)
    assert torch.equal(q, q0)


def test_get_rope_sharing_dtype_cast_and_errors():
    a = get_rope(D, D, MAXP, THETA, True, {"rope_type": "linear", "factor": 2.0})
    assert get_rope(D, D, MAXP, THETA, True, {"type": "linear", "factor": 2.0}) is not a
    assert get_rope(D, D, MAXP, THETA, True, {"rope_type": "linear", "factor": 2.0}) is a
    assert get_rope(D, D, MAXP, THETA, True, {"rope_type": "linear", "factor": 3.0}) is not a
    r = RotaryEmbedding(D, D, MAXP, THETA, True, torch.float32)
    before = r.cos_sin_cache.clone()
    r.to(torch.bfloat16)
    assert r.cos_sin_cache.dtype == torch.float32 and torch.equal(r.cos_sin_cache, before)
    with pytest.raises(ValueError, match="unsupported rope_type"):
        get_rope(D, D, MAXP, THETA, True, {"rope_type": "longrope"})
    with pytest.raises(ValueError, match="original_max_position_embeddings"):
        get_rope(D, D, MAXP, THETA, True, {"rope_type": "yarn", "factor": 2.0})
    with pytest.raises(ValueError, match="rotary_dim"):
        RotaryEmbedding(D, D + 2, MAXP, THETA, True, torch.float32)
    with pytest.raises(ValueError, match="rotary_dim"):
        RotaryEmbedding(D, 5, MAXP, THETA, True, torch.float32)
    ds = get_rope(
        D,
        D,
        MAXP,
        THETA,
        False,
        {
            "rope_type": "yarn",
            "factor": 4.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 16,
        },
    )
    assert isinstance(ds, DeepseekScalingRotaryEmbedding) and math.isclose(ds.mscale, 1.0)


def test_linear_multiple_factors_offsets():
    r = LinearScalingRotaryEmbedding(D, D, 8, THETA, True, [1.0, 2.0], torch.float32)
    assert r.scaling_factor_to_offset == {1.0: 0, 2.0: 8}
    assert r.cos_sin_cache.shape[0] == 8 + 16
    single = LinearScalingRotaryEmbedding(D, D, 8, THETA, True, 2.0, torch.float32)
    torch.testing.assert_close(r.cos_sin_cache[8:], single.cos_sin_cache)


def test_torch_compile_fullgraph_with_fused_arg():
    rope = our_rope("yarn")
    T = 4
    arg = make_fused(T, 1, torch.float32)
    pos = torch.randint(0, 64, (T,))
    q, k = torch.randn(T, HQ * D), torch.randn(T, HKV * D)
    q2, k2 = q.clone(), k.clone()
    arg2 = sgl_ext.FusedSetKVBufferArg(
        arg.value, arg.k_buffer.clone(), arg.v_buffer.clone(), None, None, arg.cache_loc
    )

    def f(p, q, k, a):
        return rope(p, q, k, fused_set_kv_buffer_arg=a)

    torch.compile(f, backend="aot_eager", fullgraph=True)(pos, q, k, arg)
    f(pos, q2, k2, arg2)
    assert torch.equal(q, q2) and torch.equal(k, k2)
    assert torch.equal(arg.k_buffer, arg2.k_buffer) and torch.equal(arg.v_buffer, arg2.v_buffer)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["llama3", "yarn_gpt_oss", "deepseek_yarn"])
def test_cuda_forward_matches_native_and_writes_cache(name):
    rope = copy.deepcopy(our_rope(name)).to("cuda")  # get_rope's shared instance stays on the CPU
    T = 33
    pos = torch.randint(0, rope.cos_sin_cache.shape[0], (T,), device="cuda")
    q = torch.randn(T, HQ * D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(T, HKV * D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(T, HKV * D, device="cuda", dtype=torch.bfloat16)
    kb = torch.zeros(64, HKV, D, device="cuda", dtype=torch.bfloat16)
    vb = torch.zeros_like(kb)
    loc = torch.randperm(64, device="cuda")[:T]
    q2, k2 = q.clone(), k.clone()
    rope.forward(
        pos, q, k, fused_set_kv_buffer_arg=sgl_ext.FusedSetKVBufferArg(v, kb, vb, None, None, loc)
    )
    rope.forward_native(pos, q2, k2)
    torch.testing.assert_close(q, q2, atol=2e-2, rtol=1.6e-2)
    assert torch.equal(kb[loc], k.view(T, HKV, D)) and torch.equal(vb[loc], v.view(T, HKV, D))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_shared_rope_serves_both_devices():
    """get_rope shares instances; moving one model's copy to CUDA must not break a CPU user."""
    rope = get_rope(D, D, MAXP, THETA, True, {"rope_type": "dynamic", "factor": 2.0})
    q, k = torch.randn(5, HQ * D), torch.randn(5, HKV * D)
    want_q, want_k = q.clone(), k.clone()
    rope(torch.arange(5), want_q, want_k)
    rope.to("cuda")
    rope(torch.arange(5), q, k)  # CPU inputs, module on CUDA
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    qc, kc = q.cuda(), k.cuda()
    rope(torch.arange(5, device="cuda"), qc, kc)
    rope.to("cpu")
