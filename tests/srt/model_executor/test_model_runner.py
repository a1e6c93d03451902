"""ModelRunner on CPU with the stand-in model: pools, extend/decode forwards, fused == unfused."""

from __future__ import annotations

import pytest
import torch

from srt.managers.schedule_batch import Req, ScheduleBatch
from srt.model_executor.model_runner import ModelRunner
from srt.sampling.sampling_params import SamplingParams
from srt.server_args import ServerArgs
from tests.srt.model_executor.runner_fakes import FakeConfig, patch_builder


def _runner(monkeypatch, **kw) -> ModelRunner:
    patch_builder(monkeypatch)
    kw.setdefault("max_total_tokens", 203)
    return ModelRunner(ServerArgs(device="cpu", **kw))


def _batch(runner: ModelRunner, fused: bool) -> ScheduleBatch:
    return ScheduleBatch.from_runner(runner, fused)


def test_pools_sized_from_args(monkeypatch):
    r = _runner(monkeypatch, page_size=4, max_running_requests=5)
    assert r.max_total_num_tokens == 200  # rounded down to whole pages
    assert r.token_to_kv_pool_allocator.available_size() == 200
    assert r.req_to_token_pool.req_to_token.shape == (5, FakeConfig.context_len + 4)
    k = r.token_to_kv_pool.get_key_buffer(0)
    assert k.shape == (51, 4, FakeConfig.num_key_value_heads, FakeConfig.head_dim)  # + pad page
    assert r.dtype == torch.float32 and r.kv_dtype == torch.float32
    assert r.cuda_graph_runner is None and r.server_args.attention_backend == "torch_native"
    r8 = _runner(monkeypatch, kv_cache_dtype="fp8_e4m3")
    assert r8.kv_dtype == torch.float8_e4m3fn


@pytest.mark.parametrize("page_size", [1, 4])
def test_fused_and_unfused_forwards_are_identical(monkeypatch, page_size):
    """Same logits (bitwise) and same cache bytes, extend then 6 decode steps, B = 3."""
    g = torch.Generator().manual_seed(0)
    V = FakeConfig.vocab_size
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in (1, 7, 33)]
    results = {}
    for fused in (True, False):
        r = _runner(monkeypatch, page_size=page_size, max_total_tokens=256)
        sb = _batch(r, fused)
        reqs = [Req(i, p, SamplingParams(max_new_tokens=8)) for i, p in enumerate(prompts)]
        logits = [r.forward(sb.prepare_for_extend(reqs)).clone()]  # [3, V]
        assert logits[0].shape == (3, FakeConfig.vocab_size)
        for _ in range(6):
            for req, t in zip(reqs, logits[-1].argmax(-1).tolist(), strict=True):
                req.output_ids.append(t)
            logits.append(r.forward(sb.prepare_for_decode(reqs)).clone())
        kv = [b.clone() for b in r.token_to_kv_pool.k_buffer + r.token_to_kv_pool.v_buffer]
        results[fused] = (logits, kv, [x.kv_len for x in reqs])
    (lf, kvf, lenf), (lu, kvu, lenu) = results[True], results[False]
    assert lenf == lenu == [7, 13, 39]
    for a, b in zip(lf, lu, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(kvf, kvu, strict=True):
        assert torch.equal(a, b)
    # The padding slot / page 0 was never written and real slots were.
    for b in kvf:
        assert not b[0].any()
        assert b.flatten(0, -3).abs().sum(dim=(-1, -2)).count_nonzero() == sum(lenf)


def test_extend_matches_incremental_decode(monkeypatch):
    """Prefilling n tokens gives the same last logits as prefilling 1 and decoding n-1."""
    r = _runner(monkeypatch)
    sb = _batch(r, True)
    prompt = torch.randint(0, FakeConfig.vocab_size, (7,), generator=torch.Generator()).tolist()
    full = r.forward(sb.prepare_for_extend([Req(0, prompt, SamplingParams())])).double()
    req = Req(1, prompt[:1], SamplingParams())
    out = r.forward(sb.prepare_for_extend([req]))
    for t in prompt[1:]:
        req.output_ids.append(t)
        out = r.forward(sb.prepare_for_decode([req]))
    torch.testing.assert_close(out.double(), full, rtol=1e-5, atol=1e-5)


def test_server_args_validation():
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        ServerArgs(kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="page_size"):
        ServerArgs(page_size=0)
    with pytest.raises(ValueError, match="attention_backend"):
        ServerArgs(attention_backend="flashinfer")
    with pytest.raises(ValueError, match="tp_size"):
        ServerArgs(tp_size=0)
    with pytest.raises(ValueError, match="json_model_override_args"):
        ServerArgs(json_model_override_args="{nope")
    a = ServerArgs(device="cpu").resolved()
    assert a.disable_cuda_graph and a.attention_backend == "torch_native"


@pytest.mark.parametrize(
    "preset, shape",
    [
        ("llama3-8b", (32, 4096, 32, 8, 128, 14336, 0)),
        ("gpt-oss-20b", (24, 2880, 64, 8, 64, 2880, 32)),
    ],
)
def test_bench_presets_have_the_real_shapes(preset, shape):
    from srt.model_executor.model_builder import (
        build_model_config,
        kv_cache_shape,
        preset_overrides,
    )

    cfg = build_model_config(ServerArgs(json_model_override_args=preset_overrides(preset)))
    names = (
        "num_hidden_layers",
        "hidden_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "intermediate_size",
        "num_local_experts",
    )
    got = tuple(getattr(cfg, n) for n in names)
    assert got == shape
    assert kv_cache_shape(cfg) == (shape[0], shape[3], shape[4], shape[4])
    if preset == "gpt-oss-20b":
        assert cfg.get_window_left(0) == 127 and cfg.get_window_left(1) == -1
    with pytest.raises(ValueError, match="unknown model preset"):
        preset_overrides("llama-70b")
