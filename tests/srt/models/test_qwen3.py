"""Qwen3 (q/k norm, tied embeddings) through the real loader vs HF transformers."""

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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_qwen3_cuda_bf16_triton(qwen3_ckpt):
    """bf16 on CUDA with the Triton attention backend agrees with CPU fp32 within bf16
    tolerance; fused equals unfused bit for bit (logits and caches)."""
    from tests.srt.models.hf_compare import gpu_bf16_check

    gpu_bf16_check(qwen3_ckpt[0])
