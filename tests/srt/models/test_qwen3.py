"""Qwen3 (q/k norm, tied embeddings) through the real loader vs HF transformers; the fused
q/k-norm + RoPE + KV-write op against the unfused path."""

import pytest
import torch

import sgl_ext
from tests.srt.models.hf_compare import (
    compare_with_hf,
    load_ours,
    make_prompts,
    row_errors,
    run_model,
    save_hf_checkpoint,
)

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def qwen3_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3")
    cfg = transformers.Qwen3Config(
        vocab_size=160,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=128,
        initializer_range=0.1,
        tie_word_embeddings=True,
        rope_theta=1000.0,
    )
    hf = save_hf_checkpoint(path, transformers.Qwen3ForCausalLM, cfg)
    with torch.no_grad():  # non-trivial q/k norm weights (HF inits them to 1)
        for layer in hf.model.layers:
            layer.self_attn.q_norm.weight.normal_(1.0, 0.3)
            layer.self_attn.k_norm.weight.normal_(1.0, 0.3)
    hf.save_pretrained(str(path))
    return path, hf


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("fused", [True, False])
def test_qwen3_matches_hf(qwen3_ckpt, page_size, fused):
    path, hf = qwen3_ckpt
    model, config = load_ours(path)
    assert config.tie_word_embeddings and model.lm_head is model.model.embed_tokens
    prompts, dec = make_prompts(config.vocab_size)
    prefill, steps, _ = run_model(model, config, prompts, dec, page_size=page_size, fused=fused)
    compare_with_hf(hf, prompts, dec, prefill, steps)


def test_qwen3_fused_equals_unfused_and_fp8(qwen3_ckpt):
    path, hf = qwen3_ckpt
    model, config = load_ours(path)
    prompts, dec = make_prompts(config.vocab_size)
    a = run_model(model, config, prompts, dec, page_size=16, fused=True)
    b = run_model(model, config, prompts, dec, page_size=16, fused=False)
    assert torch.equal(a[0], b[0])
    assert all(torch.equal(x, y) for x, y in zip(a[1], b[1], strict=True))
    f8 = run_model(model, config, prompts, dec, page_size=1, kv_dtype=torch.float8_e4m3fn)
    # q/k-normed keys are O(1) per element and scores O(sqrt(D)): e4m3's ~6% rounding of K
    # moves the softmax more than for Llama, hence the looser bound.
    compare_with_hf(hf, prompts, dec, f8[0], f8[1], norm_tol=0.25)


def _set_fuse_qk_norm(model, on: bool) -> None:
    for layer in model.model.layers:
        layer.self_attn.fuse_qk_norm = on


def _count_calls(monkeypatch) -> list:
    """Count the model's calls of the q/k-norm op (still running it)."""
    calls = []
    real = sgl_ext.apply_qk_norm_rope_with_cos_sin_cache_inplace

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(sgl_ext, "apply_qk_norm_rope_with_cos_sin_cache_inplace", spy)
    return calls


def test_qwen3_qk_norm_op_equals_torch_norm_paths(qwen3_ckpt, monkeypatch):
    """Fused (one op: q/k norm + RoPE + KV write) on the native path gives the same bits as
    torch norm + fused RoPE/KV and as the unfused path (the op without the write, then the
    pool's set_kv_buffer): logits and KV caches. The op runs once per layer and step whenever
    the q/k norm is fused, with or without the KV write."""
    path, _ = qwen3_ckpt
    model, config = load_ours(path)
    prompts, dec = make_prompts(config.vocab_size, steps=3)
    calls = _count_calls(monkeypatch)
    runs = {}
    for name, fused, qk in (("op", True, True), ("rope_kv", True, False), ("unfused", False, True)):
        _set_fuse_qk_norm(model, qk)
        n0 = len(calls)
        runs[name] = run_model(model, config, prompts, dec, page_size=16, fused=fused)
        expect = config.num_hidden_layers * (1 + len(dec)) if qk else 0
        assert len(calls) - n0 == expect, name
    a = runs["op"]
    for name in ("rope_kv", "unfused"):
        b = runs[name]
        assert torch.equal(a[0], b[0]), name
        assert all(torch.equal(x, y) for x, y in zip(a[1], b[1], strict=True)), name
        for lid in range(config.num_hidden_layers):
            assert torch.equal(a[2].get_key_buffer(lid), b[2].get_key_buffer(lid)), name
            assert torch.equal(a[2].get_value_buffer(lid), b[2].get_value_buffer(lid)), name


def test_qwen3_triton_qk_norm_op_interpreted_matches_hf(qwen3_ckpt, backend):
    """The q/k-norm op's Triton kernel (interpreted on CPU) inside the model matches HF (fp32)
    and the unfused path, with a paged and a token-granular pool."""
    backend("triton")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    path, hf = qwen3_ckpt
    model, config = load_ours(path, device=dev)
    prompts, dec = make_prompts(config.vocab_size, steps=2)  # the interpreter is slow
    for page_size in (1, 16):
        f = run_model(model, config, prompts, dec, page_size=page_size, fused=True, device=dev)
        u = run_model(model, config, prompts, dec, page_size=page_size, fused=False, device=dev)
        compare_with_hf(hf, prompts, dec, f[0], f[1])
        assert row_errors(f[0], f[1], u[0], u[1]).max() < 1e-5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_qwen3_cuda_bf16_triton(qwen3_ckpt, monkeypatch):
    """bf16 on CUDA with the Triton attention backend agrees with CPU fp32 within bf16
    tolerance; with the torch q/k norm, fused RoPE/KV equals unfused bit for bit (logits and
    caches)."""
    from srt.models.qwen3 import Qwen3Attention
    from tests.srt.models.hf_compare import gpu_bf16_check

    monkeypatch.setattr(Qwen3Attention, "fuse_qk_norm", False)  # the models it loads
    gpu_bf16_check(qwen3_ckpt[0])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kv_dtype", [None, torch.float8_e4m3fn])
def test_qwen3_cuda_bf16_qk_norm_op_tokens_equal_unfused(qwen3_ckpt, kv_dtype):
    """bf16 on CUDA, Triton attention: the one-kernel q/k norm + RoPE + KV write against the
    unfused path (torch norm, RoPE op, pool set_kv_buffer). The norm's reduction order and
    rsqrt differ from torch's, so the bits may differ by a rounding step; the greedy tokens
    must not (where the top two logits are not within bf16 noise), and the logits agree within
    bf16 tolerance."""
    from srt.layers.attention.triton_backend import TritonAttnBackend

    model, cfg = load_ours(qwen3_ckpt[0], dtype="bfloat16", device="cuda")
    prompts, dec = make_prompts(cfg.vocab_size)
    kw = dict(backend_cls=TritonAttnBackend, device="cuda", kv_dtype=kv_dtype)
    for page_size in (1, 16):
        f = run_model(model, cfg, prompts, dec, page_size=page_size, fused=True, **kw)
        u = run_model(model, cfg, prompts, dec, page_size=page_size, fused=False, **kw)
        err = row_errors(f[0], f[1], u[0], u[1])
        assert err.max() < 0.02, (page_size, err.max())
        fl = torch.cat([f[0], *f[1]]).float()
        ul = torch.cat([u[0], *u[1]]).float()
        top2 = ul.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 0.05 * ul.abs().amax(-1)
        same = fl.argmax(-1) == ul.argmax(-1)
        assert same[clear].all(), (page_size, (~same).nonzero().flatten().tolist())
