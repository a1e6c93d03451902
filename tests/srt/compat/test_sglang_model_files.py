"""SGLang 0.5.23's own llama.py, qwen3.py (+ qwen2.py) and gpt_oss.py, unmodified, through
srt.compat.sglang's import remap and srt's real loader: on CPU in float32 they give srt's own
model files' logits and KV cache bit for bit, extend + decode, and HF's logits (qwen2.py, which
srt has no file for, HF's); gpt_oss.py's RoPE calls all go through srt's fused RoPE + KV-cache
write (counted).

The files are fetched from the package index at test time (`sglang_wheel.py`); these tests skip
when it cannot be reached.
"""

from __future__ import annotations

import sys

import pytest
import torch

from srt.compat import sglang as sglang_compat
from srt.compat.sglang_model import count_rope_calls
from srt.configs.model_config import ModelConfig
from srt.layers.moe.fused_moe_triton.layer import FusedMoE
from srt.model_loader.loader import get_model
from tests.srt.models.hf_compare import (
    compare_with_hf,
    hf_full_logits,
    load_ours,
    make_prompts,
    run_model,
)

MODELS = ("llama", "qwen3", "gpt_oss")
_HF_REFS: dict[str, list[torch.Tensor]] = {}


def load_sglang(sglang_dir, name: str, path, dtype="float32", device="cpu"):
    """SGLang's `name`.py registered through the remap, the model of checkpoint `path` built
    and loaded by srt's loader."""
    sglang_compat.register_model_file(sglang_dir / f"{name}.py")
    config = ModelConfig.from_hf(path, dtype=dtype)
    return get_model(config, device=device, model_impl="sglang"), config


def _hf_ref(name: str, hf, prompts, dec) -> list[torch.Tensor]:
    if name not in _HF_REFS:
        seqs = [p + [d[i] for d in dec] for i, p in enumerate(prompts)]
        _HF_REFS[name] = hf_full_logits(hf, seqs)
    return _HF_REFS[name]


def assert_same_run(a, b, num_layers: int) -> None:
    """Two run_model results: the same logits and the same KV-cache bytes."""
    assert torch.equal(a[0], b[0])
    assert all(torch.equal(x, y) for x, y in zip(a[1], b[1], strict=True))
    for lid in range(num_layers):
        assert torch.equal(a[2].get_key_buffer(lid), b[2].get_key_buffer(lid))
        assert torch.equal(a[2].get_value_buffer(lid), b[2].get_value_buffer(lid))


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("name", MODELS)
def test_sglang_file_equals_srt_file_and_hf(request, sglang_dir, name, page_size, fused):
    path, hf = request.getfixturevalue(f"{name}_ckpt")
    model, config = load_sglang(sglang_dir, name, path)
    assert type(model).__module__ == f"sglang.srt.models.{name}"  # SGLang's class, unedited
    ours, _ = load_ours(path)
    prompts, dec = make_prompts(config.vocab_size)
    with count_rope_calls(model) as rope:
        got = run_model(model, config, prompts, dec, page_size=page_size, fused=fused)
    want = run_model(ours, config, prompts, dec, page_size=page_size, fused=fused)
    assert_same_run(got, want, config.num_hidden_layers)
    compare_with_hf(hf, prompts, dec, got[0], got[1], ref=_hf_ref(name, hf, prompts, dec))
    # one RoPE call a layer and forward: prefill, then each decode step
    assert rope.total == config.num_hidden_layers * (1 + len(dec))
    if name == "gpt_oss":  # its create_fused_set_kv_buffer_arg is srt's: RoPE writes K and V
        assert rope.fused == (rope.total if fused else 0)
    else:  # SGLang's llama.py / qwen3.py never hand RoPE the cache
        assert rope.fused == 0


def test_qwen3_file_imports_its_sibling_qwen2(sglang_dir, qwen3_ckpt):
    model, _ = load_sglang(sglang_dir, "qwen3", qwen3_ckpt[0])
    qwen2 = sys.modules["sglang.srt.models.qwen2"]
    assert qwen2.__file__ == str(sglang_dir / "qwen2.py")
    assert isinstance(model.model, qwen2.Qwen2Model)
    assert model.lm_head is model.model.embed_tokens  # tied embeddings


@pytest.mark.parametrize("page_size", [1, 16])
def test_qwen2_file_matches_hf(sglang_dir, qwen2_ckpt, page_size):
    """qwen2.py as a model of its own (srt has no Qwen2 file): HF's logits, q/k/v biases."""
    path, hf = qwen2_ckpt
    model, config = load_sglang(sglang_dir, "qwen2", path)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert model.model.layers[0].self_attn.qkv_proj.bias is not None
    prompts, dec = make_prompts(config.vocab_size)
    got = run_model(model, config, prompts, dec, page_size=page_size)
    compare_with_hf(hf, prompts, dec, got[0], got[1], ref=_hf_ref("qwen2", hf, prompts, dec))


def test_gpt_oss_file_builds_srt_layers_with_sglang_names(sglang_dir, gpt_oss_ckpt):
    model, config = load_sglang(sglang_dir, "gpt_oss", gpt_oss_ckpt[0])
    layer = model.model.layers[0]
    assert isinstance(layer.mlp.experts, FusedMoE) and layer.mlp.experts.activation == "swiglu_oai"
    names = {n for n, _ in layer.mlp.experts.named_parameters()}
    assert names == {"w13_weight", "w13_weight_bias", "w2_weight", "w2_weight_bias"}
    windows = [lyr.self_attn.attn.sliding_window_size for lyr in model.model.layers]
    assert windows == [4, -1, 4]  # HF's sliding_window 5: 4 keys back, as srt's file
    assert layer.self_attn.sinks.dtype == torch.bfloat16  # SGLang's choice


def test_gpt_oss_file_loads_mxfp4_experts_packed(sglang_dir, gpt_oss_mxfp4_ckpt):
    """The released format: SGLang's MXFP4 loader fills FusedMoE's packed uint8 parameters
    (SGLang's shapes and names); srt's file dequantises them at load on CPU. Same bits."""
    path, hf = gpt_oss_mxfp4_ckpt
    model, config = load_sglang(sglang_dir, "gpt_oss", path)
    experts = model.model.layers[0].mlp.experts
    assert experts.mxfp4 and experts.w13_weight.dtype == torch.uint8
    assert experts.w13_weight.shape == (5, 2 * 64, 64 // 2)
    assert experts.w2_weight_scale.shape == (5, 64, 64 // 32)
    ours, _ = load_ours(path)
    prompts, dec = make_prompts(config.vocab_size, steps=3)
    with count_rope_calls(model) as rope:
        got = run_model(model, config, prompts, dec, page_size=16)
    assert rope.fused == rope.total > 0
    want = run_model(ours, config, prompts, dec, page_size=16)
    assert_same_run(got, want, config.num_hidden_layers)
    compare_with_hf(hf, prompts, dec, got[0], got[1])


def test_fp8_kv_cache_same_bytes_as_srt_file(sglang_dir, gpt_oss_ckpt):
    """fp8 e4m3 caches: SGLang's gpt-oss excludes them from its fused path; here its RoPE
    stores the quantised K and V, the same bytes srt's file stores."""
    path, _ = gpt_oss_ckpt
    model, config = load_sglang(sglang_dir, "gpt_oss", path)
    ours, _ = load_ours(path)
    prompts, dec = make_prompts(config.vocab_size, steps=3)
    kw = dict(page_size=16, kv_dtype=torch.float8_e4m3fn, k_scale=0.5, v_scale=0.25)
    with count_rope_calls(model) as rope:
        got = run_model(model, config, prompts, dec, **kw)
    assert rope.fused == rope.total > 0
    assert_same_run(got, run_model(ours, config, prompts, dec, **kw), config.num_hidden_layers)


def test_unsupported_asks_raise_when_built_not_when_imported(sglang_dir, llama_ckpt, tmp_path):
    """Importing a file never raises for a feature srt lacks; building the model does, naming
    it: another quantization method, tensor parallelism with SGLang files."""
    import json
    import shutil

    (cls,) = sglang_compat.register_model_file(sglang_dir / "llama.py")[:1]
    ckpt = tmp_path / "fp8"
    shutil.copytree(llama_ckpt[0], ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8"}
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="'fp8'"):
        get_model(ModelConfig.from_hf(ckpt, dtype="float32"), model_impl="sglang")
    config = ModelConfig.from_hf(llama_ckpt[0], dtype="float32")
    with pytest.raises(NotImplementedError, match="tensor parallelism"):
        get_model(config, load_format="dummy", model_impl="sglang", tp_rank=0, tp_size=2)
