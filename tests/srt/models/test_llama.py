"""Llama through the real loader vs HF transformers: prefill + 8 decode steps."""

import pytest
import torch

from tests.srt.models.hf_compare import (
    compare_with_hf,
    load_ours,
    make_prompts,
    run_model,
    save_hf_checkpoint,
)

transformers = pytest.importorskip("transformers")


def _llama_config(**kw):
    base = dict(
        vocab_size=160,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        initializer_range=0.1,
        rms_norm_eps=1e-5,
    )
    base.update(kw)
    return transformers.LlamaConfig(**base)


@pytest.fixture(scope="module")
def llama_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    hf = save_hf_checkpoint(path, transformers.LlamaForCausalLM, _llama_config())
    return path, hf


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("fused", [True, False])
def test_llama_matches_hf(llama_ckpt, page_size, fused):
    path, hf = llama_ckpt
    model, config = load_ours(path)
    prompts, dec = make_prompts(config.vocab_size)
    prefill, steps, _ = run_model(model, config, prompts, dec, page_size=page_size, fused=fused)
    assert prefill.abs().max() > 0.1  # logits are not trivially small
    compare_with_hf(hf, prompts, dec, prefill, steps, atol=1e-4, rtol=1e-4)


def test_llama_fused_equals_unfused_exactly(llama_ckpt):
    path, _ = llama_ckpt
    model, config = load_ours(path)
    prompts, dec = make_prompts(config.vocab_size)
    a = run_model(model, config, prompts, dec, page_size=16, fused=True)
    b = run_model(model, config, prompts, dec, page_size=16, fused=False)
    assert torch.equal(a[0], b[0])
    for x, y in zip(a[1], b[1], strict=True):
        assert torch.equal(x, y)
    for lid in range(config.num_hidden_layers):  # identical caches
        assert torch.equal(a[2].get_key_buffer(lid), b[2].get_key_buffer(lid))
        assert torch.equal(a[2].get_value_buffer(lid), b[2].get_value_buffer(lid))


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_llama_fp8_kv(llama_ckpt, kv_dtype):
    path, hf = llama_ckpt
    model, config = load_ours(path)
    prompts, dec = make_prompts(config.vocab_size)
    fused = run_model(
        model,
        config,
        prompts,
        dec,
        page_size=16,
        kv_dtype=kv_dtype,
        k_scale=0.5,
        v_scale=torch.tensor([0.25]),
    )
    unfused = run_model(
        model,
        config,
        prompts,
        dec,
        page_size=16,
        fused=False,
        kv_dtype=kv_dtype,
        k_scale=0.5,
        v_scale=torch.tensor([0.25]),
    )
    assert torch.equal(fused[0], unfused[0])
    tol = 0.1 if kv_dtype == torch.float8_e4m3fn else 0.2
    compare_with_hf(hf, prompts, dec, fused[0], fused[1], norm_tol=tol)
    with pytest.raises(AssertionError):  # the tolerance is tighter than "anything goes"
        compare_with_hf(hf, prompts, dec, fused[0], fused[1], norm_tol=tol / 50)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_llama_cuda_bf16_triton(llama_ckpt):
    """bf16 on CUDA with the Triton attention backend agrees with CPU fp32 within bf16
    tolerance; fused equals unfused bit for bit (logits and caches)."""
    from tests.srt.models.hf_compare import gpu_bf16_check

    gpu_bf16_check(llama_ckpt[0])


def test_llama_all_triton_interpreted(llama_ckpt, backend):
    """sgl_ext's Triton RoPE+KV kernel and our Triton attention kernels (interpreted on CPU):
    fused equals unfused exactly and both match HF."""
    from srt.layers.attention.triton_backend import TritonAttnBackend

    backend("triton")
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # compiled on GPU machines
    path, hf = llama_ckpt
    model, config = load_ours(path, device=dev)
    prompts, dec = make_prompts(config.vocab_size)
    dec = dec[:2]  # the interpreter is slow
    runs = [
        run_model(
            model,
            config,
            prompts,
            dec,
            page_size=16,
            fused=f,
            device=dev,
            backend_cls=TritonAttnBackend,
        )
        for f in (True, False)
    ]
    assert torch.equal(runs[0][0], runs[1][0])
    assert all(torch.equal(x, y) for x, y in zip(runs[0][1], runs[1][1], strict=True))
    compare_with_hf(hf, prompts, dec, runs[0][0], runs[0][1])


def test_llama_bf16_dummy_fused_equals_unfused():
    """The embedded tiny config with dummy weights in bf16 on the native path: fused and
    unfused give identical logits."""
    from srt.model_loader.loader import load_model

    model, config = load_model(None, dtype="bfloat16")
    prompts, dec = make_prompts(config.vocab_size)
    a = run_model(model, config, prompts, dec, page_size=16, fused=True)
    b = run_model(model, config, prompts, dec, page_size=16, fused=False)
    assert torch.isfinite(a[0]).all() and a[0].std() > 0
    assert torch.equal(a[0], b[0])
    assert all(torch.equal(x, y) for x, y in zip(a[1], b[1], strict=True))
