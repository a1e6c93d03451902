"""gpt-oss (sinks, sliding window, YaRN, top-k MoE) through the real loader vs HF transformers."""

import pytest
import torch

from srt.layers.mxfp4 import FP4_VALUES, dequantize_mxfp4
from tests.srt.models.hf_compare import (
    compare_with_hf,
    load_ours,
    make_prompts,
    run_model,
    save_hf_checkpoint,
)

transformers = pytest.importorskip("transformers")


def _gpt_oss_config():
    return transformers.GptOssConfig(
        vocab_size=160,
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=5,
        num_experts_per_tok=2,
        sliding_window=5,
        max_position_embeddings=128,
        initializer_range=0.1,
        swiglu_limit=0.5,
        rope_parameters={
            "rope_type": "yarn",
            "factor": 4.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 32,
            "rope_theta": 1000.0,
        },
    )


@pytest.fixture(scope="module")
def gpt_oss_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt_oss")
    hf = save_hf_checkpoint(path, transformers.GptOssForCausalLM, _gpt_oss_config())
    with torch.no_grad():  # non-zero biases and sinks that matter (HF inits biases to 0)
        g = torch.Generator().manual_seed(5)
        for layer in hf.model.layers:
            e = layer.mlp.experts
            # transformers < 5.18 hard-codes the clamp (7.0) and ignores config.swiglu_limit;
            # the oracle must compute what the config says.
            e.limit = hf.config.swiglu_limit
            e.gate_up_proj_bias.copy_(torch.randn(e.gate_up_proj_bias.shape, generator=g) * 0.3)
            e.down_proj_bias.copy_(torch.randn(e.down_proj_bias.shape, generator=g) * 0.1)
            layer.self_attn.sinks.copy_(torch.randn(4, generator=g) * 2)
    hf.save_pretrained(str(path))
    return path, hf


@pytest.fixture(scope="module")
def hf_ref(gpt_oss_ckpt):
    from tests.srt.models.hf_compare import hf_full_logits

    _, hf = gpt_oss_ckpt
    prompts, dec = make_prompts(160)
    return hf_full_logits(hf, [p + [d[i] for d in dec] for i, p in enumerate(prompts)])


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("fused", [True, False])
def test_gpt_oss_matches_hf(gpt_oss_ckpt, hf_ref, page_size, fused):
    path, hf = gpt_oss_ckpt
    model, config = load_ours(path)
    assert config.layer_types == ("sliding_attention", "full_attention", "sliding_attention")
    assert [layer.self_attn.attn.sliding_window_size for layer in model.model.layers] == [4, -1, 4]
    assert config.rope_scaling["rope_type"] == "yarn"
    prompts, dec = make_prompts(config.vocab_size)
    prefill, steps, _ = run_model(model, config, prompts, dec, page_size=page_size, fused=fused)
    compare_with_hf(hf, prompts, dec, prefill, steps, ref=hf_ref)


def test_gpt_oss_fused_equals_unfused_and_fp8(gpt_oss_ckpt, hf_ref):
    path, hf = gpt_oss_ckpt
    model, config = load_ours(path)
    prompts, dec = make_prompts(config.vocab_size)
    a = run_model(model, config, prompts, dec, page_size=16, fused=True)
    b = run_model(model, config, prompts, dec, page_size=16, fused=False)
    assert torch.equal(a[0], b[0])
    assert all(torch.equal(x, y) for x, y in zip(a[1], b[1], strict=True))
    f8 = run_model(
        model,
        config,
        prompts,
        dec,
        page_size=16,
        kv_dtype=torch.float8_e4m3fn,
        k_scale=0.25,
        v_scale=0.25,
    )
    f8u = run_model(
        model,
        config,
        prompts,
        dec,
        page_size=16,
        kv_dtype=torch.float8_e4m3fn,
        k_scale=0.25,
        v_scale=0.25,
        fused=False,
    )
    assert torch.equal(f8[0], f8u[0])
    # Top-k routing is discontinuous: fp8 rounding can flip an expert choice of a few tokens, so
    # bound the typical (median) row error tightly and the worst row loosely.
    errs = _row_errors(prompts, f8[0], f8[1], hf_ref)
    assert errs.median() < 0.08 and errs.max() < 0.6, (errs.median(), errs.max())


def _row_errors(prompts, prefill, steps, ref):
    """Relative L2 error of every logits row (prefill positions and decode steps) vs ref."""
    ours, theirs, start = [], [], 0
    for i, p in enumerate(prompts):
        ours.append(prefill[start : start + len(p)])
        theirs.append(ref[i][: len(p)])
        start += len(p)
        for s, logits in enumerate(steps):
            ours.append(logits[i : i + 1])
            theirs.append(ref[i][len(p) + s][None])
    a, b = torch.cat(ours).double(), torch.cat(theirs)
    return (a - b).norm(dim=-1) / b.norm(dim=-1)


def _quantize_mxfp4(w: torch.Tensor, g: torch.Generator):
    """Encode w [..., N] whose values we choose to be representable: returns (blocks, scales, w)."""
    *lead, n = w.shape
    codes = torch.randint(0, 16, (*lead, n), generator=g, dtype=torch.uint8)
    exps = torch.randint(120, 130, (*lead, n // 32), generator=g, dtype=torch.uint8)
    vals = torch.tensor(FP4_VALUES)[codes.long()].view(*lead, n // 32, 32)
    exact = (vals * torch.pow(2.0, exps.float() - 127)[..., None]).view(*lead, n)
    c = codes.view(*lead, n // 32, 16, 2)
    blocks = (c[..., 0] | (c[..., 1] << 4)).to(torch.uint8)
    return blocks, exps, exact


def test_mxfp4_dequantize_roundtrip():
    g = torch.Generator().manual_seed(0)
    blocks, scales, exact = _quantize_mxfp4(torch.empty(3, 5, 64), g)
    out = dequantize_mxfp4(blocks, scales, torch.float32)
    assert torch.equal(out, exact)
    with pytest.raises(ValueError, match="disagree"):
        dequantize_mxfp4(blocks, scales[..., :1])
    with pytest.raises(TypeError):
        dequantize_mxfp4(blocks.int(), scales)


def test_gpt_oss_mxfp4_checkpoint_loads_like_bf16(gpt_oss_ckpt, tmp_path):
    """Experts stored as MXFP4 blocks/scales load to the same weights as their dequantised HF
    layout."""
    from safetensors.torch import load_file, save_file

    path, _ = gpt_oss_ckpt
    sd = load_file(str(path / "model.safetensors"))
    g = torch.Generator().manual_seed(1)
    plain = dict(sd)
    for k in [k for k in sd if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        w = sd.pop(k)  # HF layout [E, in, out]
        blocks, scales, exact = _quantize_mxfp4(w.transpose(1, 2).contiguous(), g)  # [E, out, in]
        sd[k + "_blocks"], sd[k + "_scales"] = blocks, scales
        plain[k] = exact.transpose(1, 2).contiguous()
    for d, tensors in (("mx", sd), ("plain", plain)):
        (tmp_path / d).mkdir()
        save_file(tensors, str(tmp_path / d / "model.safetensors"))
        (tmp_path / d / "config.json").write_text((path / "config.json").read_text())
    m_mx, _ = load_ours(tmp_path / "mx")
    m_plain, _ = load_ours(tmp_path / "plain")
    for (n1, p1), (n2, p2) in zip(m_mx.named_parameters(), m_plain.named_parameters(), strict=True):
        assert n1 == n2 and torch.equal(p1, p2), n1


def test_gpt_oss_triton_backend_interpreted(gpt_oss_ckpt, hf_ref):
    """Our Triton attention kernels (interpreted on CPU) inside the full model."""
    from srt.layers.attention.triton_backend import TritonAttnBackend

    dev = "cuda" if torch.cuda.is_available() else "cpu"  # compiled on GPU machines
    path, hf = gpt_oss_ckpt
    model, config = load_ours(path, device=dev)
    prompts, dec = make_prompts(config.vocab_size)
    dec = dec[:3]  # the interpreter is slow: 3 decode steps
    prefill, steps, _ = run_model(
        model, config, prompts, dec, page_size=16, device=dev, backend_cls=TritonAttnBackend
    )
    compare_with_hf(hf, prompts, dec, prefill, steps, ref=hf_ref)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpt_oss_cuda_bf16_triton(gpt_oss_ckpt):
    """bf16 on CUDA with the Triton attention backend agrees with CPU fp32 within bf16
    tolerance; fused equals unfused bit for bit (logits and caches)."""
    from tests.srt.models.hf_compare import gpu_bf16_check

    gpu_bf16_check(
        gpt_oss_ckpt[0], **dict(max_err=0.5, median_err=0.03)
    )  # top-k routing may flip for a few bf16 tokens
