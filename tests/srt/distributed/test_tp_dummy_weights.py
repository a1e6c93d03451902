"""Dummy weights are the same model at every TP size: each rank's parameters are its shard of
the TP-1 tensors (the CPU-generated path and the on-device path of big models). Single process:
each rank's model is built with its tp_rank / tp_size; loading does no collective."""

from __future__ import annotations

import json

import pytest
import torch

from srt.configs.model_config import ModelConfig
from srt.model_loader.loader import full_parameter_shapes, init_dummy_weights
from srt.models.registry import get_model_class
from tests.srt.distributed.tp_harness import TINY_GPT_OSS


def _config(arch: str) -> ModelConfig:
    from srt.configs.tiny import tiny_llama_config

    cfg = tiny_llama_config() if arch == "llama" else dict(TINY_GPT_OSS)
    cfg["vocab_size"] = 1023  # not divisible by 2: padded vocab slices
    return ModelConfig.from_hf(json.loads(json.dumps(cfg)), dtype="float32")


def _build(config: ModelConfig, rank: int, tp: int, on_device: bool) -> dict[str, torch.Tensor]:
    cls = get_model_class(config.architecture)
    model = cls(config, tp_rank=rank, tp_size=tp)
    for p in model.parameters():
        p.data.fill_(float("nan"))  # poison: every element must be written
    full = full_parameter_shapes(cls, config) if tp > 1 else None
    init_dummy_weights(model, seed=3, full_shapes=full, on_device=on_device)
    return dict(model.named_parameters())


@pytest.mark.parametrize("arch", ["llama", "gpt_oss"])
@pytest.mark.parametrize("on_device", [False, True])
def test_tp2_dummy_shards_are_slices_of_tp1(arch, on_device):
    config = _config(arch)
    full = _build(config, 0, 1, on_device)
    ranks = [_build(config, r, 2, on_device) for r in range(2)]
    for p in ranks:
        assert not any(t.isnan().any() for t in p.values()), "unwritten parameter elements"
    a = "model.layers.0.self_attn."
    q_rows = config.num_attention_heads * config.head_dim // 2
    for r, p in enumerate(ranks):
        assert torch.equal(
            p[a + "qkv_proj.weight"][:q_rows],
            full[a + "qkv_proj.weight"][r * q_rows : (r + 1) * q_rows],
        )
        cols = p[a + "o_proj.weight"].shape[1]
        assert torch.equal(
            p[a + "o_proj.weight"], full[a + "o_proj.weight"][:, r * cols : (r + 1) * cols]
        )
        assert torch.equal(p["model.norm.weight"], full["model.norm.weight"])  # replicated
    emb = torch.cat([p["model.embed_tokens.weight"] for p in ranks])  # [1024, H], 1 padding row
    assert torch.equal(emb[:1023], full["model.embed_tokens.weight"])
    assert torch.equal(emb[1023:], torch.zeros_like(emb[1023:]))
    if arch == "gpt_oss":
        e = "model.layers.1.mlp.experts."
        i_loc = config.intermediate_size // 2
        for r, p in enumerate(ranks):
            f13, p13 = full[e + "w13_weight"], p[e + "w13_weight"]
            assert torch.equal(p13[:, :i_loc], f13[:, r * i_loc : (r + 1) * i_loc])  # gate
            up = f13[:, config.intermediate_size + r * i_loc :][:, :i_loc]
            assert torch.equal(p13[:, i_loc:], up)
            assert torch.equal(p[e + "w2_bias"], full[e + "w2_bias"])
            sinks = full[a + "sinks"]
            assert torch.equal(p[a + "sinks"], sinks[r * 2 : (r + 1) * 2])
