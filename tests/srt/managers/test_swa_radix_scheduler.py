"""The scheduler with the prefix cache on the hybrid sliding-window pool (tiny gpt-oss: one
window layer with window-left 4, one full layer; CPU): greedy tokens identical with and without
the cache (page 1 and 16, fused and unfused, chunked and not), a conversation continued past
the window matched whole, a prefix whose window pages were freed matched shorter, both pools
and the mapping exact afterwards, and the debug check stopping a write into a window page of
the tree."""

from __future__ import annotations

import json
import random

import pytest
import torch

import srt
from sgl_ext import settings
from srt.managers.schedule_batch import Req
from srt.mem_cache.swa_radix_cache import SWARadixCache
from srt.mem_cache.write_check import KVWriteViolation
from srt.sampling.sampling_params import SamplingParams
from tests.conftest import gpu
from tests.srt.distributed.tp_harness import TINY_GPT_OSS
from tests.srt.mem_cache.radix_checks import changed_slots, kv_bytes
from tests.srt.mem_cache.swa_radix_checks import check_swa_ownership, swa_referenced_slots

SP = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
W = 4  # TINY_GPT_OSS: sliding_window 5


def _engine(page_size: int = 1, fused: bool = True, device: str = "cpu", **kw) -> srt.Engine:
    kw.setdefault("max_total_tokens", 2048)
    return srt.Engine(
        device=device,
        skip_tokenizer_init=True,
        page_size=page_size,
        enable_fused_rope_kv=fused,
        context_length=256,
        json_model_override_args=json.dumps(TINY_GPT_OSS),
        **kw,
    )


def _workload(ps: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    toks = lambda n: [rng.randrange(3, 999) for _ in range(n)]  # noqa: E731
    systems = [toks(n) for n in (2 * ps, 2 * ps + 5, 37)]
    prompts = [systems[i % 3] + toks(rng.randrange(1, 12)) for i in range(12)]
    prompts.append(list(prompts[0]))
    prompts.append(systems[0] + [5])  # the cached prefix ends exactly on a page boundary
    prompts.append(toks(1))
    return prompts


def _ids(outs: list[dict]) -> list[list[int]]:
    assert not any("error" in o for o in outs)
    return [o["output_ids"] for o in outs]


def _check_idle(eng: srt.Engine) -> None:
    """Nothing runs: both pools are free or the tree's (unlocked), each page and mapping entry
    has one owner."""
    sched, alloc = eng.scheduler, eng.model_runner.token_to_kv_pool_allocator
    tree = sched.tree_cache
    check_swa_ownership(tree, alloc, [])
    assert tree.protected_size() == tree.swa_protected_size() == 0
    assert sched.available_kv_size() == alloc.size
    assert alloc.swa_available_size() + tree.swa_evictable_size() == alloc.size_swa


@pytest.mark.parametrize("chunk", [None, 7], ids=["whole", "chunked"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
@pytest.mark.parametrize("ps", [1, 16])
def test_greedy_tokens_identical_with_and_without_cache(ps, fused, chunk):
    prompts = _workload(ps, seed=ps + fused)
    kw = {} if chunk is None else {"chunked_prefill_size": chunk}
    on = _engine(ps, fused, max_running_requests=2, **kw)
    off = _engine(ps, fused, disable_radix_cache=True, **kw)
    assert isinstance(on.scheduler.tree_cache, SWARadixCache) and off.scheduler.tree_cache is None
    want = _ids(off.generate(input_ids=prompts, sampling_params=SP))
    half = len(prompts) // 2
    got = _ids(on.generate(input_ids=prompts[:half], sampling_params=SP))
    got += _ids(on.generate(input_ids=prompts[half:], sampling_params=SP))
    assert got == want
    again = on.generate(input_ids=prompts, sampling_params=SP)
    assert _ids(again) == want
    cached = [o["meta_info"]["cached_tokens"] for o in again]
    assert all(c <= (len(p) - 1) // ps * ps for c, p in zip(cached, prompts, strict=True))
    assert sum(cached) > 0 and on.scheduler.cache_hit_rate() > 0.1
    if chunk is not None:
        assert on.scheduler.policy.chunked_prefill_size == chunk
    _check_idle(on)
    for eng in (on, off):
        eng.shutdown()


# (page size, prompt length, new tokens, shared tokens -> cached tokens): the first request's
# prompt keeps its window pages (inserted after its prefill); of its outputs only the last
# window's pages still have window slots when it finishes (the rest left its window and were
# freed: tombstones). A conversation continued at its end matches it whole; one continued
# inside the tombstones is cut back to the end of the prompt.
CASES = [
    (1, 30, 10, 39, 39),  # kv 39: window pages of tokens 35 .. 38 live
    (1, 30, 10, 36, 30),  # tokens 32 .. 35 need 32 .. 34: freed -> back to the prompt
    (4, 32, 12, 40, 40),  # kv 43: page 9 (tokens 36 .. 39) live, page 8 freed
    (4, 32, 12, 38, 32),  # whole pages: 36, whose window 32 .. 35 is page 8: freed
]


@pytest.mark.parametrize("ps, prompt_len, new, shared, want", CASES)
def test_window_tombstones_shorten_the_match(ps, prompt_len, new, shared, want):
    rng = random.Random(prompt_len + shared)
    prompt = [rng.randrange(3, 999) for _ in range(prompt_len)]
    sp = dict(SP, max_new_tokens=new)
    on, off = _engine(ps), _engine(ps, disable_radix_cache=True)
    first = on.generate(input_ids=prompt, sampling_params=sp)
    assert first["output_ids"] == off.generate(input_ids=prompt, sampling_params=sp)["output_ids"]
    follow = (prompt + first["output_ids"])[:shared] + [7, 8]
    out = on.generate(input_ids=follow, sampling_params=SP)
    assert out["meta_info"]["cached_tokens"] == want
    assert want > W  # a prefix far longer than the window, matched
    assert out["output_ids"] == off.generate(input_ids=follow, sampling_params=SP)["output_ids"]
    # every unlocked window page tombstoned: nothing is usable any more, tokens still right
    tree = on.scheduler.tree_cache
    tree.evict_swa(tree.swa_evictable_size())
    _check_idle(on)
    out = on.generate(input_ids=follow, sampling_params=SP)
    assert out["meta_info"]["cached_tokens"] == 0
    assert out["output_ids"] == off.generate(input_ids=follow, sampling_params=SP)["output_ids"]
    _check_idle(on)
    for eng in (on, off):
        eng.shutdown()


@pytest.mark.parametrize("debug", [True, False], ids=["checked", "unchecked"])
def test_debug_check_stops_a_write_into_a_cached_window_page(debug, monkeypatch):
    """A batch whose window slot (the mapping of a new token's full slot, planted here) is a
    window slot of the tree is stopped before the forward with SGL_EXT_DEBUG: the request
    fails alone, the tree's window bytes unchanged. Unchecked, the same batch overwrites them
    (the plant is real: window layers write where the mapping points)."""
    eng = _engine(4, max_total_tokens=512)
    sched, runner = eng.scheduler, eng.model_runner
    pool = runner.token_to_kv_pool
    system = list(range(10, 30))
    eng.generate(input_ids=system + [9], sampling_params=SP)
    tree = sched.tree_cache
    target = min(tree.held_swa_pages()) * 4 + 1  # a window slot of a cached page
    real = sched.batch.prepare_for_extend

    def prepare(reqs, *a):
        fb = real(reqs, *a)
        if any(r.rid == "bad" for r in reqs):
            pool.full_to_swa_index_mapping[int(fb.out_cache_loc[-1])] = target
        return fb

    monkeypatch.setattr(sched.batch, "prepare_for_extend", prepare)
    before = kv_bytes(pool.swa_kv_pool)
    cached = swa_referenced_slots(tree, [], 4)
    sp = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    reqs = [Req("good", system + [3, 4], sp), Req("bad", system + [5, 6], sp)]
    with settings.override(debug=debug):
        for r in reqs:
            sched.add_request(r)
        sched.run_until_idle()
    changed = changed_slots(before, kv_bytes(pool.swa_kv_pool), cached)
    if debug:
        assert isinstance(reqs[1].error, KVWriteViolation)
        assert f"window slot {target}" in str(reqs[1].error) and "radix tree" in str(reqs[1].error)
        assert reqs[0].error is None and len(reqs[0].output_ids) == 8
        assert changed == []
    else:
        assert changed == [target]
    eng.shutdown()


@gpu
@pytest.mark.parametrize("kv", ["auto", "fp8_e4m3"])
def test_gpu_graphs_greedy_identical_with_and_without_cache(kv):
    """CUDA graphs, bf16 / fp8 KV, the hybrid pool: the same greedy tokens with the cache as
    without (unrun here: no GPU on CI)."""
    prompts = _workload(16, seed=3)
    kw = dict(device="cuda", kv_cache_dtype=kv, max_total_tokens=8192)
    on, off = _engine(16, **kw), _engine(16, disable_radix_cache=True, **kw)
    assert isinstance(on.scheduler.tree_cache, SWARadixCache)
    want = _ids(off.generate(input_ids=prompts, sampling_params=SP))
    assert _ids(on.generate(input_ids=prompts, sampling_params=SP)) == want
    again = on.generate(input_ids=prompts, sampling_params=SP)
    assert _ids(again) == want and sum(o["meta_info"]["cached_tokens"] for o in again) > 0
    torch.cuda.synchronize()
    _check_idle(on)
    for eng in (on, off):
        eng.shutdown()
