"""srt.Engine with the embedded tiny Llama (random seeded weights) on CPU."""

from __future__ import annotations

import os

import pytest
import torch

import srt

# Runs the Triton kernels in the interpreter on CPU tensors (CI); on a CUDA machine the GPU tests
# cover the compiled kernels, and TRITON_INTERPRET is off there.
interpreter_only = pytest.mark.skipif(torch.cuda.is_available(), reason="Triton interpreter test")

PROMPTS = ["Hello world", "The capital of France is", "a", "1 2 3 4 5 6 7 8 9 10 11 12 13"]
GREEDY = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine():
    eng = srt.Engine(device="cpu", max_total_tokens=1024)
    yield eng
    eng.shutdown()


def test_lazy_export():
    from srt.entrypoints.engine import Engine

    assert srt.Engine is Engine
    with pytest.raises(AttributeError):
        srt.NotAThing  # noqa: B018


def test_fused_and_unfused_give_same_tokens(engine):
    ids = [engine.tokenizer.encode(p) for p in PROMPTS] if engine.tokenizer else None
    kw = {"prompt": PROMPTS} if ids else {"input_ids": [[5, 6, 7], [9] * 20, [3], [11, 12]]}
    fused = engine.generate(sampling_params=GREEDY, **kw)
    unfused_eng = srt.Engine(device="cpu", max_total_tokens=1024, enable_fused_rope_kv=False)
    unfused = unfused_eng.generate(sampling_params=GREEDY, **kw)
    assert [o["output_ids"] for o in fused] == [o["output_ids"] for o in unfused]
    assert all(len(o["output_ids"]) == 12 for o in fused)
    paged = srt.Engine(device="cpu", max_total_tokens=1024, page_size=16)
    assert [o["output_ids"] for o in paged.generate(sampling_params=GREEDY, **kw)] == [
        o["output_ids"] for o in fused
    ]


def test_single_vs_batch_and_outputs(engine):
    one = engine.generate(input_ids=[5, 6, 7, 8], sampling_params=GREEDY, return_logprob=True)
    assert isinstance(one, dict)
    assert one["meta_info"]["prompt_tokens"] == 4
    assert len(one["output_token_logprobs"]) == 12
    assert all(lp <= 0 for lp in one["output_token_logprobs"])
    many = engine.generate(input_ids=[[5, 6, 7, 8], [1, 2]], sampling_params=GREEDY)
    assert isinstance(many, list) and many[0]["output_ids"] == one["output_ids"]


@pytest.mark.skipif(
    not os.path.isdir(os.path.join(os.path.dirname(srt.__file__), "assets", "tiny_tokenizer")),
    reason="tiny tokenizer not shipped",
)
def test_text_with_tiny_tokenizer(engine):
    assert engine.tokenizer is not None
    out = engine.generate(prompt="Hello", sampling_params=GREEDY)
    assert isinstance(out["text"], str)
    assert out["text"] == engine.tokenizer.decode(out["output_ids"], skip_special_tokens=True)


def test_missing_tokenizer_is_graceful(monkeypatch, tmp_path):
    from srt.entrypoints import engine as engine_mod

    monkeypatch.setattr(engine_mod, "TINY_TOKENIZER_DIR", str(tmp_path / "nope"))
    eng = srt.Engine(device="cpu", max_total_tokens=256)
    assert eng.tokenizer is None
    out = eng.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 2})
    assert "text" not in out and len(out["output_ids"]) <= 2
    with pytest.raises(ValueError, match="no tokenizer"):
        eng.generate(prompt="hi")


def test_progress_bar_for_long_batches(engine, capsys):
    engine.generate(
        input_ids=[[i + 3] for i in range(40)],
        sampling_params={"max_new_tokens": 2, "temperature": 0.0},
    )
    assert "generate" in capsys.readouterr().err


def test_shutdown_releases_the_runner_and_pool():
    """After shutdown nothing keeps the model runner or the KV pool (on CUDA their memory is
    what test_cuda_graph_engine_matches_eager_and_frees_memory measures): the request builder
    held the scheduler's bound pool check."""
    import gc
    import weakref

    eng = srt.Engine(device="cpu", dtype="float32", max_total_tokens=4096, skip_tokenizer_init=True)
    runner, pool = weakref.ref(eng.model_runner), weakref.ref(eng.model_runner.token_to_kv_pool)
    eng.generate(input_ids=[[5, 6, 7], [8, 9]], sampling_params=GREEDY)
    eng.shutdown()
    gc.collect()
    assert runner() is None and pool() is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_engine_matches_eager_and_frees_memory():
    base = torch.cuda.memory_allocated()
    # A 512 MiB KV pool (2**20 tokens), so that "released" is measurable.
    kw = dict(
        device="cuda",
        dtype="float32",
        max_total_tokens=2**20,
        cuda_graph_max_bs=8,
        skip_tokenizer_init=True,
    )
    prompts = [[5 + i] * (3 + 7 * i) for i in range(5)]  # B = 5 replays the bucket of 8
    outs, after = {}, []
    for graph in (True, False, True):
        eng = srt.Engine(cuda_graph=graph, **kw)
        assert (eng.model_runner.cuda_graph_runner is not None) == graph
        assert torch.cuda.memory_allocated() - base > 2**29
        outs[graph] = [
            o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=GREEDY)
        ]
        eng.shutdown()
        after.append(torch.cuda.memory_allocated() - base)
    assert outs[True] == outs[False]
    # Model, KV pool (512 MiB) and graphs are released after every shutdown. What stays is
    # library state such as cuBLAS workspaces of the streams used (64.1 MiB measured on an H100
    # after the first engine; no large tensor survived in a gc scan of live CUDA tensors).
    assert max(after) < 128 * 2**20, after


TINY_GPT_OSS = {
    "architectures": ["GptOssForCausalLM"],
    "model_type": "gpt_oss",
    "hidden_size": 64,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "vocab_size": 1024,
    "sliding_window": 8,
    "max_position_embeddings": 2048,
    "layer_types": ["sliding_attention", "full_attention"],
    "rope_theta": 150000.0,
    "rope_scaling": {
        "rope_type": "yarn",
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 4096,
    },
    "attention_bias": True,
    "eos_token_id": 2,
}


def test_gpt_oss_shape_fused_unfused_paged_agree():
    """Sinks, a sliding window shorter than the prompts, YaRN and MoE: every path agrees."""
    import json

    prompts = [[5] * 20, [7, 8, 9], list(range(3, 40))]
    outs = set()
    for fused, ps in ((True, 1), (False, 1), (True, 4), (False, 4)):
        eng = srt.Engine(
            device="cpu",
            json_model_override_args=json.dumps(TINY_GPT_OSS),
            enable_fused_rope_kv=fused,
            page_size=ps,
            max_total_tokens=256,
            skip_tokenizer_init=True,
        )
        out = eng.generate(input_ids=prompts, sampling_params=GREEDY)
        outs.add(tuple(tuple(o["output_ids"]) for o in out))
    assert len(outs) == 1


def test_real_model_continuous_batching_matches_alone(engine):
    prompts = [[5, 6, 7, 8], [9] * 33, [3], list(range(10, 17))]
    params = [dict(GREEDY, max_new_tokens=n) for n in (4, 12, 7, 1)]
    batched = engine.generate(input_ids=prompts, sampling_params=params)
    alone = [
        engine.generate(input_ids=p, sampling_params=s)
        for p, s in zip(prompts, params, strict=True)
    ]
    assert [o["output_ids"] for o in batched] == [o["output_ids"] for o in alone]


@interpreter_only
def test_triton_attention_backend_agrees_with_torch_native(engine):
    """The GPU default backend (Triton kernels; interpreted on CPU) gives the same tokens."""
    prompts = [[5, 6, 7], [9] * 11]
    sp = dict(GREEDY, max_new_tokens=4)
    ref = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=sp)]
    eng = srt.Engine(
        device="cpu", attention_backend="triton", max_total_tokens=256, skip_tokenizer_init=True
    )
    assert type(eng.model_runner.attn_backend).__name__ == "TritonAttnBackend"
    assert [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=sp)] == ref
