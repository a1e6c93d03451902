"""The checkpoint loader: single/sharded safetensors, dummy weights, tokenizer, clear errors."""

import json
import os

import pytest
import torch

from srt.configs.model_config import ModelConfig
from srt.model_loader.loader import get_model, load_model, load_tokenizer, safetensors_files

transformers = pytest.importorskip("transformers")


def _hf_llama(**kw):
    cfg = dict(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
    )
    cfg.update(kw)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg)).float()


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    hf = _hf_llama()
    hf.save_pretrained(str(root / "single"))
    hf.save_pretrained(str(root / "sharded"), max_shard_size="20KB")
    return root, hf


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_sharded_equals_single_and_hf(ckpts):
    root, hf = ckpts
    files = safetensors_files(str(root / "sharded"))
    assert len(files) > 1 and os.path.isfile(root / "sharded" / "model.safetensors.index.json")
    a, _ = load_model(str(root / "single"), dtype="float32")
    b, _ = load_model(str(root / "sharded"), dtype="float32")
    pa, pb = _params(a), _params(b)
    assert pa.keys() == pb.keys()
    assert all(torch.equal(pa[k], pb[k]) for k in pa)
    # packed parameters hold HF's q | k | v and gate | up rows
    hl = hf.model.layers[1]
    qkv = pa["model.layers.1.self_attn.qkv_proj.weight"]
    ref = torch.cat(
        [hl.self_attn.q_proj.weight, hl.self_attn.k_proj.weight, hl.self_attn.v_proj.weight]
    )
    assert torch.equal(qkv, ref)
    gu = pa["model.layers.1.mlp.gate_up_proj.weight"]
    assert torch.equal(gu, torch.cat([hl.mlp.gate_proj.weight, hl.mlp.up_proj.weight]))


def test_dtype_auto_and_explicit(ckpts):
    root, _ = ckpts
    m, c = load_model(str(root / "single"), dtype="bfloat16")
    assert c.dtype == torch.bfloat16
    assert all(p.dtype == torch.bfloat16 for n, p in m.named_parameters())
    rope = m.model.layers[0].self_attn.rotary_emb
    assert rope.cos_sin_cache.dtype == torch.float32
    assert torch.get_default_dtype() == torch.float32  # restored after construction


def test_missing_shard_and_bad_index(ckpts, tmp_path):
    root, _ = ckpts
    import shutil

    d = tmp_path / "c"
    shutil.copytree(root / "sharded", d)
    shard = sorted(p for p in os.listdir(d) if p.endswith(".safetensors"))[0]
    os.remove(d / shard)
    with pytest.raises(FileNotFoundError, match=shard):
        load_model(str(d), dtype="float32")
    (d / "model.safetensors.index.json").write_text("{oops")
    with pytest.raises(ValueError, match="model.safetensors.index.json"):
        load_model(str(d), dtype="float32")


def test_corrupt_and_missing_weights(ckpts, tmp_path):
    root, _ = ckpts
    import shutil

    d = tmp_path / "c"
    shutil.copytree(root / "single", d)
    (d / "model.safetensors").write_bytes(b"\x10\x00garbage")
    with pytest.raises(ValueError, match="model.safetensors"):
        load_model(str(d), dtype="float32")
    os.remove(d / "model.safetensors")
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors"):
        load_model(str(d), dtype="float32")


def test_incomplete_or_extra_tensors(ckpts, tmp_path):
    from safetensors.torch import load_file, save_file

    root, _ = ckpts
    sd = load_file(str(root / "single" / "model.safetensors"))
    cfg = (root / "single" / "config.json").read_text()
    for name, tensors, err, pattern in [
        (
            "missing",
            {k: v for k, v in sd.items() if "layers.1.mlp.up_proj" not in k},
            ValueError,
            "lacks 1 parameter",
        ),
        ("extra", {**sd, "model.bogus.weight": torch.zeros(2)}, KeyError, "bogus"),
        ("shape", {**sd, "model.norm.weight": torch.zeros(3)}, ValueError, "model.norm.weight"),
    ]:
        d = tmp_path / name
        d.mkdir()
        save_file(tensors, str(d / "model.safetensors"))
        (d / "config.json").write_text(cfg)
        with pytest.raises(err, match=pattern):
            load_model(str(d), dtype="float32")


def test_dummy_weights_seeded_and_tiny_default():
    m1, c = load_model(None, dtype="float32")
    assert c.vocab_size == 1024 and c.architecture == "LlamaForCausalLM"
    m2, _ = load_model(None, dtype="float32")
    m3 = get_model(c, "dummy", seed=1)
    p1, p2, p3 = _params(m1), _params(m2), _params(m3)
    assert all(torch.equal(p1[k], p2[k]) for k in p1)
    assert not torch.equal(p1["model.embed_tokens.weight"], p3["model.embed_tokens.weight"])
    norm = p1["model.norm.weight"]
    assert (norm - 1).abs().max() < 0.2 and norm.std() > 0
    w = p1["model.layers.0.self_attn.qkv_proj.weight"]
    assert 0.01 < w.std() < 0.04
    with pytest.raises(ValueError, match="load_format"):
        get_model(c, "bogus")
    with pytest.raises(ValueError, match="dummy"):
        get_model(c, "auto")  # no path


def test_unsupported_architecture():
    c = ModelConfig.from_hf(
        {
            "architectures": ["NopeForCausalLM"],
            "hidden_size": 8,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "vocab_size": 4,
        }
    )
    with pytest.raises(ValueError, match="NopeForCausalLM"):
        get_model(c, "dummy")


def test_tokenizer(tmp_path, ckpts):
    root, _ = ckpts
    assert load_tokenizer(None) is None
    assert load_tokenizer(str(root / "single")) is None
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "hello": 1, "world": 2}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    fast.save_pretrained(str(tmp_path))
    loaded = load_tokenizer(str(tmp_path))
    assert loaded("hello world")["input_ids"] == [1, 2]
    (tmp_path / "tokenizer.json").write_text("{broken")
    with pytest.raises(ValueError, match=str(tmp_path)):
        load_tokenizer(str(tmp_path))


def test_index_lists_all_files(ckpts):
    root, _ = ckpts
    index = json.loads((root / "sharded" / "model.safetensors.index.json").read_text())
    files = {os.path.basename(f) for f in safetensors_files(str(root / "sharded"))}
    assert files == set(index["weight_map"].values())
