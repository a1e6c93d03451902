"""ModelConfig.from_hf: every HF quirk resolved in one place."""

import dataclasses
import json

import pytest
import torch

from srt.configs.model_config import ModelConfig
from srt.configs.tiny import TINY_LLAMA_CONFIG, tiny_llama_config

BASE = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    hidden_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    vocab_size=100,
)


def cfg(**kw):
    return ModelConfig.from_hf({**BASE, **kw})


def test_defaults_head_dim_kv_heads_dtype():
    c = cfg()
    assert c.head_dim == 16 and c.num_key_value_heads == 4 and c.rotary_dim == 16
    assert c.dtype == torch.bfloat16  # auto, config names none
    assert c.rope_theta == 10000.0 and c.rope_scaling is None
    assert c.layer_types == ("full_attention",) * 3 and c.sliding_window is None
    assert cfg(head_dim=None).head_dim == 16
    assert cfg(head_dim=8).head_dim == 8


@pytest.mark.parametrize(
    "kw, dtype",
    [
        (dict(torch_dtype="float32"), torch.float32),
        (dict(dtype="float16"), torch.float16),
        (dict(torch_dtype="torch.bfloat16"), torch.bfloat16),
    ],
)
def test_dtype_auto_reads_config(kw, dtype):
    assert cfg(**kw).dtype == dtype
    assert ModelConfig.from_hf({**BASE, **kw}, dtype="float32").dtype == torch.float32


def test_bad_dtype_and_overrides():
    with pytest.raises(ValueError, match="dtype"):
        ModelConfig.from_hf(BASE, dtype="int8")
    with pytest.raises(TypeError, match="unknown"):
        ModelConfig.from_hf(BASE, not_a_field=1)
    assert ModelConfig.from_hf(BASE, max_position_embeddings=77).max_position_embeddings == 77
    with pytest.raises(ValueError, match="lacks"):
        ModelConfig.from_hf({k: v for k, v in BASE.items() if k != "vocab_size"})
    with pytest.raises(ValueError, match="architectures"):
        ModelConfig.from_hf({**BASE, "architectures": None})
    with pytest.raises(ValueError, match="multiple"):
        cfg(num_key_value_heads=3)


def test_rope_legacy_and_v5_forms():
    legacy = cfg(rope_theta=5e5, rope_scaling={"type": "linear", "factor": 2.0})
    assert legacy.rope_theta == 5e5 and legacy.rope_scaling == {
        "rope_type": "linear",
        "factor": 2.0,
    }
    v5 = cfg(
        rope_parameters={
            "rope_type": "yarn",
            "factor": 4.0,
            "rope_theta": 1e6,
            "original_max_position_embeddings": 32,
        }
    )
    assert v5.rope_theta == 1e6
    assert v5.rope_scaling == {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 32,
    }
    assert cfg(rope_parameters={"rope_type": "default", "rope_theta": 3.0}).rope_scaling is None
    assert cfg(partial_rotary_factor=0.5).rotary_dim == 8
    assert (
        cfg(rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.25}).rotary_dim == 4
    )


def test_sliding_window_forms():
    mistral = cfg(sliding_window=8)
    assert mistral.layer_types == ("sliding_attention",) * 3
    assert [mistral.get_window_left(i) for i in range(3)] == [7, 7, 7]
    qwen = cfg(sliding_window=8, use_sliding_window=True, max_window_layers=2)
    assert qwen.layer_types == ("full_attention", "full_attention", "sliding_attention")
    off = cfg(sliding_window=8, use_sliding_window=False)
    assert off.sliding_window is None and off.get_window_left(0) == -1
    oss = cfg(model_type="gpt_oss", sliding_window=128)
    assert [oss.get_window_left(i) for i in range(3)] == [127, -1, 127]
    explicit = cfg(sliding_window=4, layer_types=["full_attention", "sliding_attention"] * 2)
    assert [explicit.get_window_left(i) for i in range(3)] == [-1, 3, -1]
    with pytest.raises(ValueError, match="layer_types"):
        cfg(layer_types=["full_attention"])


def test_moe_eos_tie_fields():
    c = cfg(
        num_local_experts=8, num_experts_per_tok=2, eos_token_id=[1, 5], tie_word_embeddings=True
    )
    assert (c.num_local_experts, c.num_experts_per_tok) == (8, 2)
    assert c.eos_token_id == (1, 5) and c.tie_word_embeddings
    assert cfg(num_experts=4).num_local_experts == 4
    assert cfg(experts_per_token=3).num_experts_per_tok == 3  # original gpt-oss key
    assert cfg(eos_token_id=3).eos_token_id == (3,)


def test_from_path_and_file_errors(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(BASE))
    c = ModelConfig.from_hf(tmp_path)
    assert c.path == str(tmp_path) and c.hidden_size == 64
    assert ModelConfig.from_hf(tmp_path / "config.json").path == str(tmp_path)
    with pytest.raises(FileNotFoundError, match="config.json"):
        ModelConfig.from_hf(tmp_path / "nope")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"malformed model config .*config\.json"):
        ModelConfig.from_hf(bad)


def test_tiny_config():
    c = ModelConfig.from_hf(tiny_llama_config())
    assert (c.vocab_size, c.hidden_size, c.num_hidden_layers) == (1024, 64, 2)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (4, 2, 16)
    assert (c.intermediate_size, c.max_position_embeddings) == (128, 2048)
    d = tiny_llama_config()
    d["vocab_size"] = 1
    assert TINY_LLAMA_CONFIG["vocab_size"] == 1024  # copies are independent


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ({"rms_norm_eps": -1}, "rms_norm_eps"),
        ({"rms_norm_eps": float("inf")}, "rms_norm_eps"),
        ({"vocab_size": 0}, "vocab_size"),
        ({"hidden_size": -64}, "hidden_size"),
        ({"num_hidden_layers": 0}, "num_hidden_layers"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"head_dim": -4}, "head_dim"),
        ({"max_position_embeddings": -5}, "max_position_embeddings"),
        ({"rope_theta": -1.0}, "rope_theta"),
        ({"partial_rotary_factor": 1.5}, "partial_rotary_factor"),
        ({"head_dim": 7}, "rotary dim"),
        ({"sliding_window": -2, "layer_types": ["sliding_attention"] * 3}, "sliding_window"),
        ({"num_local_experts": 4, "num_experts_per_tok": 5}, "num_experts_per_tok"),
    ],
)
def test_values_no_model_runs_with_are_rejected(override, field):
    """A config.json or json_model_override_args value that would build a model failing every
    request is a ValueError naming the field, from from_hf and from a direct replace alike."""
    with pytest.raises(ValueError, match=field):
        cfg(**override)
    good = cfg()
    direct = {k: v for k, v in override.items() if k in {f.name for f in dataclasses.fields(good)}}
    if direct and "layer_types" not in direct:
        with pytest.raises(ValueError, match=field):
            dataclasses.replace(good, **direct)


def test_tiny_config_with_bad_overrides_fails_before_weights():
    from srt.model_executor.model_builder import build_model_config
    from srt.server_args import ServerArgs

    cases = (('{"rms_norm_eps": -1}', "rms_norm_eps"), ('{"vocab_size": 0}', "vocab_size"))
    for override, field in cases:
        args = ServerArgs(device="cpu", json_model_override_args=override)
        with pytest.raises(ValueError, match=field):
            build_model_config(args)
