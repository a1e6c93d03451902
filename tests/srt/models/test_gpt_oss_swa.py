"""gpt-oss on the hybrid sliding-window KV pool (SWAKVPool) through the Engine: HF parity with
prompts longer than the window, fused == unfused, no stale KV from reused window slots, more
requests at once in the same memory, the Triton backend, and (GPU) graph == eager."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import srt
from srt.mem_cache.kv_memory import hybrid_token_capacity
from srt.mem_cache.swa_memory_pool import SWAKVPool
from tests.srt.models.hf_compare import hf_full_logits, save_hf_checkpoint
from tests.srt.models.test_gpt_oss import _gpt_oss_config

transformers = pytest.importorskip("transformers")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

WINDOW_LEFT = 4  # the tiny config's sliding_window 5
LENS = (3, 12, 30)  # two prompts longer than the window


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt_oss_swa")
    hf = save_hf_checkpoint(path, transformers.GptOssForCausalLM, _gpt_oss_config())
    with torch.no_grad():  # sinks and expert biases that matter (HF inits biases to 0)
        g = torch.Generator().manual_seed(7)
        for layer in hf.model.layers:
            layer.mlp.experts.limit = hf.config.swiglu_limit
            b = layer.mlp.experts.gate_up_proj_bias
            b.copy_(torch.randn(b.shape, generator=g) * 0.3)
            layer.self_attn.sinks.copy_(torch.randn(4, generator=g) * 2)
    hf.save_pretrained(str(path))
    return str(path), hf


def _prompts(lens=LENS, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 160, (n,), generator=g).tolist() for n in lens]


def _engine(path, **kw):
    kw.setdefault("device", "cpu")
    kw.setdefault("max_total_tokens", 256)
    kw.setdefault("max_running_requests", 4)
    return srt.Engine(model_path=path, skip_tokenizer_init=True, **kw)


def _generate(eng, prompts, max_new=(10,), **params):
    sp = [
        {"max_new_tokens": max_new[i % len(max_new)], "temperature": 0.0, "ignore_eos": True}
        | params
        for i in range(len(prompts))
    ]
    out = eng.generate(input_ids=prompts, sampling_params=sp, return_logprob=True)
    return [o["output_ids"] for o in out], [torch.tensor(o["output_token_logprobs"]) for o in out]


def _assert_no_leak(eng):
    """With the prefix cache dropped (it keeps both pools' pages of finished requests), every
    page of both pools is free and no full slot maps to a window slot."""
    assert eng.flush_cache()
    a = eng.model_runner.token_to_kv_pool_allocator
    assert a.available_size() == a.size
    if hasattr(a, "swa_available_size"):
        assert a.swa_available_size() == a.size_swa
        pool = eng.model_runner.token_to_kv_pool
        assert (pool.full_to_swa_index_mapping[pool.page_size :] == -1).all()


@pytest.mark.parametrize("page_size", [1, 4])
def test_hybrid_pool_matches_hf_and_the_uniform_pool(ckpt, page_size):
    path, hf = ckpt
    prompts = _prompts()
    with _engine(path, page_size=page_size) as eng:
        pool = eng.model_runner.token_to_kv_pool
        assert isinstance(pool, SWAKVPool) and pool.sliding_window_size == WINDOW_LEFT
        assert pool.swa_attention_layer_ids == (0, 2) and pool.full_attention_layer_ids == (1,)
        assert pool.size_swa < pool.size
        rep = eng.get_kv_memory_report()
        assert rep.shape.num_swa_layers == 2 and rep.swa_max_total_num_tokens == pool.size_swa
        assert "hybrid" in rep.describe()
        ids, lps = _generate(eng, prompts)
        _assert_no_leak(eng)
    ref = hf_full_logits(hf, [p + o[:-1] for p, o in zip(prompts, ids, strict=True)])
    for p, o, lp, logits in zip(prompts, ids, lps, ref, strict=True):
        hf_lp = torch.log_softmax(logits[len(p) - 1 :], dim=-1)  # [new, V] float64
        tok = torch.tensor(o)
        torch.testing.assert_close(lp.double(), hf_lp[torch.arange(len(o)), tok], atol=1e-4, rtol=0)
        assert (hf_lp.argmax(-1) == tok).float().mean() >= 0.9  # greedy, modulo near-ties
    with _engine(path, page_size=page_size, disable_hybrid_swa_memory=True) as eng:
        assert not isinstance(eng.model_runner.token_to_kv_pool, SWAKVPool)
        u_ids, u_lps = _generate(eng, prompts)
    assert u_ids == ids
    for a, b in zip(lps, u_lps, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_hybrid_pool_fused_equals_unfused(ckpt):
    path, _ = ckpt
    prompts = _prompts()
    runs = []
    for fused in (True, False):
        with _engine(path, page_size=4, enable_fused_rope_kv=fused) as eng:
            runs.append(_generate(eng, prompts))
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1], strict=True))


@pytest.mark.parametrize("page_size", [1, 4])
def test_hybrid_pool_overlapped_decode_same_tokens(ckpt, page_size):
    """The overlapped decode evicts window pages while the next step already runs: same tokens
    (stops on produced tokens included) as reading each step back first, nothing leaked."""
    path, _ = ckpt
    prompts = _prompts(lens=(3, 12, 30, 7), seed=5)
    runs = []
    for off in (True, False):
        with _engine(path, page_size=page_size, disable_overlap_schedule=off) as eng:
            sp = [{"max_new_tokens": 16 + 3 * i, "temperature": 0.0} for i in range(4)]
            ref = [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=sp)]
            sp[1]["stop_token_ids"] = [ref[1][6]]  # stops at (or before) its 7th token
            outs = eng.generate(input_ids=prompts, sampling_params=sp)
            runs.append([(o["output_ids"], o["meta_info"]["finish_reason"]) for o in outs])
            assert (eng.scheduler.num_overlapped_steps > 0) == (not off)
            _assert_no_leak(eng)
    assert runs[0] == runs[1]
    assert runs[0][1][1]["type"] == "stop"


@needs_cuda
def test_hybrid_pool_overlapped_decode_never_waits_for_the_device(ckpt):
    """Window eviction and the mapping writes every step: no synchronising call in decode."""
    from tests.srt.managers.test_overlap_schedule import run_decode_without_host_waits

    path, _ = ckpt
    with _engine(path, device="cuda", page_size=1) as eng:
        a = eng.model_runner.token_to_kv_pool_allocator
        prompts = _prompts(lens=(3, 12, 30), seed=6)
        params = [{"max_new_tokens": 14, "temperature": 0.0, "ignore_eos": True}] * 3
        run_decode_without_host_waits(eng, prompts, params)
        assert eng.flush_cache()
        assert a.swa_available_size() == a.size_swa and a.available_size() == a.size


@pytest.mark.parametrize("page_size", [1, 4])
def test_reused_window_slots_leave_no_stale_kv(ckpt, page_size):
    """Freed window slots are poisoned with NaN and handed to other requests; the first
    request's tokens and logprobs are those of running it alone."""
    path, _ = ckpt
    a_prompt = _prompts((9,), seed=11)
    others = _prompts((30, 2, 17), seed=12)
    with _engine(path, page_size=page_size) as eng:
        alone = _generate(eng, a_prompt, max_new=(14,))
        pool = eng.model_runner.token_to_kv_pool
        alloc = eng.model_runner.token_to_kv_pool_allocator
        freed: set[int] = set()
        reused = []
        free_swa, alloc_extend, alloc_decode = (
            alloc.free_swa,
            alloc.alloc_extend,
            alloc.alloc_decode,
        )

        def poisoned_free(swa_index, full_index):
            free_swa(swa_index, full_index)
            pages = swa_index // page_size
            slots = (pages[:, None] * page_size + torch.arange(page_size)).reshape(-1)
            for lid in pool.swa_attention_layer_ids:
                for buf in pool.get_kv_buffer(lid):
                    buf.view(-1, *buf.shape[-2:])[slots] = float("nan")
            freed.update(pages.tolist())

        def watched(alloc_fn):
            def run(*args, **kw):
                got = alloc_fn(*args, **kw)
                if got is not None:
                    reused.extend(p for p in (got.swa // page_size).tolist() if p in freed)
                return got

            return run

        alloc.free_swa = poisoned_free
        alloc.alloc_extend, alloc.alloc_decode = watched(alloc_extend), watched(alloc_decode)
        together = _generate(eng, a_prompt + others, max_new=(14, 3, 9, 5))
        _assert_no_leak(eng)
    assert reused, "no freed window slot was handed out again: the test proves nothing"
    assert together[0][0] == alone[0][0]
    torch.testing.assert_close(together[1][0], alone[1][0], atol=1e-5, rtol=0)
    assert all(torch.isfinite(lp).all() for lp in together[1])


def test_long_context_batch_runs_at_once_only_on_the_hybrid_pool(ckpt):
    """Same KV bytes: the uniform pool fits 2 of these 4 requests and queues the rest; the
    hybrid pool runs all 4 in one prefill."""
    path, _ = ckpt
    prompts = _prompts((20, 20, 20, 20), seed=5)
    common = dict(max_running_requests=4, context_length=64, page_size=1)
    with _engine(path, max_total_tokens=150, disable_hybrid_swa_memory=True, **common) as uni:
        u_rep = uni.model_runner.kv_memory_report
        u_ids, _ = _generate(uni, prompts, max_new=(40,))
        u_steps = uni.scheduler.num_prefill_steps
    budget = u_rep.total_bytes
    assert u_rep.shape.num_full_layers == 3 and u_rep.shape.num_swa_layers == 0
    shape = dataclasses.replace(u_rep.shape, num_full_layers=1, num_swa_layers=2)
    full = hybrid_token_capacity(budget, shape, WINDOW_LEFT, 1, 4, 64).max_total_num_tokens
    with _engine(path, max_total_tokens=full, **common) as hyb:
        h_rep = hyb.model_runner.kv_memory_report
        h_ids, _ = _generate(hyb, prompts, max_new=(40,))
        h_steps = hyb.scheduler.num_prefill_steps
        _assert_no_leak(hyb)
    assert h_rep.total_bytes <= u_rep.total_bytes
    assert u_steps > 1 and h_steps == 1, (u_steps, h_steps)
    assert h_ids == u_ids


@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="exact token equality across backends holds for the interpreter's float32 math; on "
    "the GPU the Triton kernels use TF32 / 16-bit dots (graph == eager is tested there instead)",
)
def test_hybrid_pool_triton_backend_interpreted(ckpt, backend):
    """The Triton attention kernels (interpreted on CPU) read window layers through the window
    pool: same tokens as the torch-native backend."""
    path, _ = ckpt
    prompts = _prompts((3, 12))
    dev = "cpu"
    backend("triton")
    with _engine(path, page_size=4, device=dev, attention_backend="torch_native") as eng:
        ref = _generate(eng, prompts, max_new=(4,))
    with _engine(path, page_size=4, device=dev, attention_backend="triton") as eng:
        got = _generate(eng, prompts, max_new=(4,))
    assert got[0] == ref[0]
    for a, b in zip(got[1], ref[1], strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


@needs_cuda
@pytest.mark.parametrize("page_size", [1, 16])
def test_hybrid_pool_cuda_graph_equals_eager(ckpt, page_size):
    """bf16 on the GPU: decode replayed from CUDA graphs gives the eager tokens and logprobs,
    fused and unfused, with the hybrid pool (the window slots a static input of the graph)."""
    path, _ = ckpt
    prompts = _prompts((3, 12, 30, 70, 1))
    runs = {}
    for graph in (True, False):
        for fused in (True, False):
            with _engine(
                path,
                device="cuda",
                dtype="bfloat16",
                page_size=page_size,
                cuda_graph=graph,
                enable_fused_rope_kv=fused,
                max_running_requests=8,
            ) as eng:
                assert isinstance(eng.model_runner.token_to_kv_pool, SWAKVPool)
                assert (eng.model_runner.cuda_graph_runner is not None) == graph
                runs[graph, fused] = _generate(eng, prompts, max_new=(24, 9))
                _assert_no_leak(eng)
    for fused in (True, False):
        g, e = runs[True, fused], runs[False, fused]
        assert g[0] == e[0], (fused, g[0], e[0])
        assert all(torch.equal(a, b) for a, b in zip(g[1], e[1], strict=True))
    assert runs[True, True][0] == runs[True, False][0]


def test_hybrid_pool_cascade_decode_same_tokens(ckpt, monkeypatch):
    """gpt-oss's full layers (sinks) read a shared prefix once per group, its window layers
    their window as before (Triton backend, float32; CPU: interpreted): the same tokens and
    logprobs as with the cascade off, and the cascade ran."""
    from srt.layers.attention import triton_backend
    from srt.managers import shared_prefix

    path, _ = ckpt
    monkeypatch.setattr(shared_prefix, "MIN_SHARED_TOKENS", 4)
    monkeypatch.setattr(shared_prefix, "MIN_SAVED_TOKENS", 4)
    seen = []
    real = triton_backend.cascade_args

    def counting(shared, batch_size, device):
        seen.append(shared)
        return real(shared, batch_size, device)

    monkeypatch.setattr(triton_backend, "cascade_args", counting)
    system = _prompts((16,), seed=5)[0]
    prompts = [system + q for q in _prompts((2, 5, 3, 7), seed=6)]
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    runs = []
    for off in (True, False):
        kw = dict(page_size=4, device=dev, dtype="float32", attention_backend="triton")
        kw["disable_cascade_attn"] = off
        with _engine(path, disable_cuda_graph=True, **kw) as eng:
            _generate(eng, prompts[:1], max_new=(2,))  # the system prompt into the tree
            runs.append(_generate(eng, prompts[1:], max_new=(5,)))
        assert (len(seen) > 0) is not off
    (ids_off, lp_off), (ids_on, lp_on) = runs
    assert ids_on == ids_off
    for a, b in zip(lp_on, lp_off, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
