"""Tiny HF checkpoints for the SGLang model-file tests (random weights, float32), each with the
HF model that is their reference.

gpt-oss: SGLang's gpt_oss.py keeps the attention sinks in bfloat16 (its choice for every
attention backend but trtllm_mha), srt's file in float32; the checkpoints hold sinks that
bfloat16 represents exactly, so both files hold the same values and can agree bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from tests.srt.models.hf_compare import save_hf_checkpoint


def llama_checkpoint(root: Path) -> tuple[Path, Any]:
    """Llama with GQA, untied embeddings and Llama-3 RoPE scaling."""
    import transformers

    cfg = transformers.LlamaConfig(
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
        rope_scaling={
            "rope_type": "llama3",
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    )
    return root, save_hf_checkpoint(root, transformers.LlamaForCausalLM, cfg)


def qwen3_checkpoint(root: Path) -> tuple[Path, Any]:
    """Qwen3: per-head q/k RMSNorm (non-trivial weights), tied embeddings."""
    import transformers

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
    hf = save_hf_checkpoint(root, transformers.Qwen3ForCausalLM, cfg)
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.self_attn.q_norm.weight.normal_(1.0, 0.3)
            layer.self_attn.k_norm.weight.normal_(1.0, 0.3)
    hf.save_pretrained(str(root))
    return root, hf


def qwen2_checkpoint(root: Path) -> tuple[Path, Any]:
    """Qwen2: biases on q/k/v (none on o_proj), untied embeddings."""
    import transformers

    cfg = transformers.Qwen2Config(
        vocab_size=160,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        initializer_range=0.1,
        tie_word_embeddings=False,
        rope_theta=1000.0,
    )
    hf = save_hf_checkpoint(root, transformers.Qwen2ForCausalLM, cfg)
    with torch.no_grad():  # HF starts the biases at 0
        for layer in hf.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0.0, 0.2)
    hf.save_pretrained(str(root))
    return root, hf


def gpt_oss_config(intermediate_size: int = 32) -> Any:
    """Sliding window on even layers, YaRN, 5 experts top-2, biases, clamped SwiGLU."""
    import transformers

    return transformers.GptOssConfig(
        vocab_size=160,
        hidden_size=64,
        intermediate_size=intermediate_size,
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


def _gpt_oss_weights(hf: Any) -> None:
    """Non-zero expert biases, sinks that matter and that bfloat16 holds exactly."""
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for layer in hf.model.layers:
            e = layer.mlp.experts
            e.limit = hf.config.swiglu_limit  # older transformers hard-code the clamp
            e.gate_up_proj_bias.copy_(torch.randn(e.gate_up_proj_bias.shape, generator=g) * 0.3)
            e.down_proj_bias.copy_(torch.randn(e.down_proj_bias.shape, generator=g) * 0.1)
            sinks = layer.self_attn.sinks
            sinks.copy_((torch.randn(sinks.shape, generator=g) * 2).bfloat16().float())


def gpt_oss_checkpoint(root: Path) -> tuple[Path, Any]:
    """gpt-oss in HF's bf16 layout (float32 here)."""
    import transformers

    hf = save_hf_checkpoint(root, transformers.GptOssForCausalLM, gpt_oss_config())
    _gpt_oss_weights(hf)
    hf.save_pretrained(str(root))
    return root, hf


def _mxfp4(w: torch.Tensor, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random representable MXFP4 values shaped like w [..., N]: (blocks, scales, exact)."""
    from srt.layers.mxfp4 import FP4_VALUES

    *lead, n = w.shape
    codes = torch.randint(0, 16, (*lead, n), generator=g, dtype=torch.uint8)
    exps = torch.randint(120, 128, (*lead, n // 32), generator=g, dtype=torch.uint8)
    vals = torch.tensor(FP4_VALUES)[codes.long()].view(*lead, n // 32, 32)
    exact = (vals * torch.pow(2.0, exps.float() - 127)[..., None]).view(*lead, n)
    c = codes.view(*lead, n // 32, 16, 2)
    return (c[..., 0] | (c[..., 1] << 4)).to(torch.uint8), exps, exact


def gpt_oss_mxfp4_checkpoint(root: Path) -> tuple[Path, Any]:
    """gpt-oss as released: MXFP4 experts (`*_blocks` / `*_scales`, quant_method "mxfp4").
    Returns the MXFP4 folder and the HF model of the same weights dequantised."""
    import transformers
    from safetensors.torch import load_file, save_file

    plain = root / "plain"
    hf = save_hf_checkpoint(plain, transformers.GptOssForCausalLM, gpt_oss_config(64))
    _gpt_oss_weights(hf)
    hf.save_pretrained(str(plain))
    sd = load_file(str(plain / "model.safetensors"))
    g = torch.Generator().manual_seed(1)
    exact, mx = dict(sd), dict(sd)
    for k in [k for k in sd if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        del mx[k]
        blocks, scales, w = _mxfp4(sd[k].transpose(1, 2).contiguous(), g)  # [E, out, in]
        mx[k + "_blocks"], mx[k + "_scales"] = blocks, scales
        exact[k] = w.transpose(1, 2).contiguous()
    save_file(exact, str(plain / "model.safetensors"))
    (root / "mx").mkdir()
    save_file(mx, str(root / "mx" / "model.safetensors"))
    config = json.loads((plain / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (root / "mx" / "config.json").write_text(json.dumps(config))
    ref = transformers.GptOssForCausalLM.from_pretrained(str(plain)).float().eval()
    for layer in ref.model.layers:
        layer.mlp.experts.limit = ref.config.swiglu_limit
    return root / "mx", ref
