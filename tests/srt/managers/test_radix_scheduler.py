"""The scheduler with the radix cache (issue 48), on the embedded tiny Llama (CPU): greedy tokens
identical with and without the cache (page 1 and 16, fused and unfused RoPE + KV), cached_tokens
exact, a poison or aborted request sharing a prefix never inserts and always unlocks, the debug
check stops a write into a cached prefix before it happens, and the switch / hybrid-pool cases
(the hybrid pool's own: test_swa_radix_scheduler.py).
"""

from __future__ import annotations

import json
import logging
import random

import pytest
import torch

import srt
from sgl_ext import settings
from srt.managers.schedule_batch import Req
from srt.mem_cache.radix_cache import RadixKey
from srt.mem_cache.swa_radix_cache import SWARadixCache
from srt.mem_cache.write_check import KVWriteViolation
from srt.sampling.sampling_params import SamplingParams
from tests.conftest import gpu
from tests.srt.mem_cache.radix_checks import (
    changed_slots,
    check_ownership,
    kv_bytes,
    referenced_slots,
)

MARK = 1000  # first token after the shared prefix of a poison request
SP = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}


def _engine(page_size: int = 1, fused: bool = True, device: str = "cpu", **kw) -> srt.Engine:
    kw.setdefault("max_total_tokens", 2048)
    return srt.Engine(
        device=device,
        skip_tokenizer_init=True,
        page_size=page_size,
        enable_fused_rope_kv=fused,
        context_length=256,
        **kw,
    )


def _workload(ps: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    toks = lambda n: [rng.randrange(3, 999) for _ in range(n)]  # noqa: E731
    systems = [toks(n) for n in (2 * ps, 2 * ps + 5, 37)]
    prompts = [systems[i % 3] + toks(rng.randrange(1, 12)) for i in range(12)]
    prompts.append(list(prompts[0]))  # a repeat: all but its last token can be cached
    prompts.append(systems[0] + [5])  # the cached prefix ends exactly on a page boundary
    prompts.append(toks(1))  # a one-token prompt: nothing to match
    return prompts


def _ids(outs: list[dict]) -> list[list[int]]:
    assert not any("error" in o for o in outs)
    return [o["output_ids"] for o in outs]


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
@pytest.mark.parametrize("ps", [1, 16])
def test_greedy_tokens_identical_with_and_without_cache(ps, fused):
    prompts = _workload(ps, seed=ps + fused)
    # two at a time: later requests of a call find the earlier ones' prefixes
    on = _engine(ps, fused, max_running_requests=2)
    off = _engine(ps, fused, disable_radix_cache=True)
    assert on.scheduler.tree_cache is not None and off.scheduler.tree_cache is None
    half = len(prompts) // 2
    want = _ids(off.generate(input_ids=prompts, sampling_params=SP))
    got = _ids(on.generate(input_ids=prompts[:half], sampling_params=SP))
    got += _ids(on.generate(input_ids=prompts[half:], sampling_params=SP))
    assert got == want
    again = on.generate(input_ids=prompts, sampling_params=SP)  # every prompt cached now
    assert _ids(again) == want
    cached = [o["meta_info"]["cached_tokens"] for o in again]
    assert cached == [(len(p) - 1) // ps * ps for p in prompts]
    outs = off.generate(input_ids=prompts, sampling_params=dict(SP, max_new_tokens=1))
    assert all(o["meta_info"]["cached_tokens"] == 0 for o in outs)
    assert on.scheduler.cache_hit_rate() > 0.3
    sched = on.scheduler
    check_ownership(sched.tree_cache, on.model_runner.token_to_kv_pool_allocator, [])
    assert sched.tree_cache.protected_size() == 0
    assert sched.available_kv_size() == on.model_runner.max_total_num_tokens
    for eng in (on, off):
        eng.shutdown()


def _req(rid: str, ids: list[int], n: int = 8) -> Req:
    return Req(rid, list(ids), SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True))


def _run(sched, reqs: list[Req]) -> None:
    for r in reqs:
        sched.add_request(r)
    sched.run_until_idle()


@pytest.mark.parametrize("where", ["prefill", "decode", "abort"])
@pytest.mark.parametrize("ps", [1, 4])
def test_failed_or_aborted_request_sharing_a_prefix(ps, where, monkeypatch):
    """A poison request matches a cached prefix beside good ones: it fails (or is aborted)
    alone, unlocks its prefix, inserts nothing; the others' tokens are their solo runs'."""
    eng = _engine(ps, max_total_tokens=512)
    sched, runner = eng.scheduler, eng.model_runner
    rng = random.Random(ps)
    system = [rng.randrange(3, 999) for _ in range(3 * ps + 2)]
    eng.generate(input_ids=system + [9], sampling_params=SP)  # the prefix is cached
    goods = [system + [rng.randrange(3, 999) for _ in range(k)] for k in (1, 4, 7)]
    solo = [eng.generate(input_ids=p, sampling_params=SP)["output_ids"] for p in goods]
    poison_ids = system + [MARK, 4, 4]
    reqs = [_req(f"g{i}", p) for i, p in enumerate(goods)] + [_req("poison", poison_ids)]
    real = runner.forward

    def forward(fb):
        rows = set(fb.req_pool_indices.tolist())
        for r in sched.running:
            if r.rid == "poison" and r.req_pool_idx in rows:
                assert r.cached_tokens == len(system) // ps * ps  # it did match the prefix
                if where == "prefill" or len(r.output_ids) >= 2:
                    raise RuntimeError("poisoned row")
        return real(fb)

    if where == "abort":
        for r in reqs:
            sched.add_request(r)
        while len(reqs[-1].output_ids) < 3:
            sched.step()
        assert sched.tree_cache.protected_size() > 0
        assert sched.abort("poison") is reqs[-1]
        sched.run_until_idle()
    else:
        monkeypatch.setattr(runner, "forward", forward)
        _run(sched, reqs)
        assert "poisoned row" in str(reqs[-1].error)
    assert [r.output_ids for r in reqs[:3]] == solo
    assert reqs[-1].finished_reason["type"] == "abort"
    tree = sched.tree_cache
    # nothing of the poison past its computed prompt entered the tree: a prompt is inserted
    # after its prefill succeeded (complete K/V), never its decoded tokens; a failed prefill
    # inserts nothing past the shared prefix
    m = tree.match_prefix(RadixKey(tuple(poison_ids + reqs[-1].output_ids)))
    inserted = system if where == "prefill" else poison_ids
    assert m.prefix_len == len(inserted) // ps * ps
    check_ownership(tree, runner.token_to_kv_pool_allocator, [])
    assert tree.protected_size() == 0
    assert sched.available_kv_size() == runner.max_total_num_tokens
    assert runner.req_to_token_pool.available_size() == runner.max_running_requests
    eng.shutdown()


@pytest.mark.parametrize("debug", [True, False], ids=["checked", "unchecked"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
def test_debug_check_stops_a_write_into_a_cached_prefix(fused, debug, monkeypatch):
    """A batch whose slot list names a slot of the tree (here: planted for one request) is
    stopped before the forward with SGL_EXT_DEBUG: that request fails alone with the holder
    named, and the cached K/V bytes are unchanged. Unchecked, the same batch overwrites them:
    the plant is real, and both the fused and the unfused path write exactly out_cache_loc."""
    eng = _engine(4, fused, max_total_tokens=512)
    sched, runner = eng.scheduler, eng.model_runner
    system = list(range(10, 30))
    eng.generate(input_ids=system + [9], sampling_params=SP)
    tree = sched.tree_cache
    target = min(tree.held_pages()) * 4 + 1  # a slot of a cached page
    real = sched.batch.prepare_for_extend

    def prepare(reqs):
        fb = real(reqs)
        if any(r.rid == "bad" for r in reqs):
            loc = fb.out_cache_loc.clone()
            loc[-1] = target  # the bad request's last prompt token
            fb.out_cache_loc = loc
        return fb

    monkeypatch.setattr(sched.batch, "prepare_for_extend", prepare)
    before = kv_bytes(runner.token_to_kv_pool)
    cached = referenced_slots(tree, [], 4)
    reqs = [_req("good", system + [3, 4]), _req("bad", system + [5, 6])]
    with settings.override(debug=debug):
        _run(sched, reqs)
    changed = changed_slots(before, kv_bytes(runner.token_to_kv_pool), cached)
    if debug:
        assert isinstance(reqs[1].error, KVWriteViolation)
        assert f"slot {target}" in str(reqs[1].error) and "radix tree" in str(reqs[1].error)
        assert reqs[0].error is None and len(reqs[0].output_ids) == SP["max_new_tokens"]
        assert changed == []
    else:
        assert changed == [target]
    eng.shutdown()


def test_disable_radix_cache_and_the_hybrid_pool(caplog):
    """--disable-radix-cache turns the cache off; the hybrid sliding-window pool has it (and
    chunked prefill) by default, with no "disabled" log line, and can turn it off too."""
    off = _engine(disable_radix_cache=True)
    outs = off.generate(input_ids=[[5, 6, 7, 8]] * 2, sampling_params=SP)
    assert [o["meta_info"]["cached_tokens"] for o in outs] == [0, 0]
    assert off.get_server_info()["internal_states"][0]["cache_hit_rate"] == 0.0
    off.shutdown()
    from tests.srt.distributed.tp_harness import TINY_GPT_OSS

    hybrid = {"json_model_override_args": json.dumps(TINY_GPT_OSS), "max_total_tokens": 256}
    with caplog.at_level(logging.INFO, logger="srt"):
        swa = _engine(**hybrid)
    assert swa.scheduler.is_swa and isinstance(swa.scheduler.tree_cache, SWARadixCache)
    assert swa.scheduler.policy.chunked_prefill_size > 0
    assert not any("disabled" in r.getMessage() for r in caplog.records)
    outs = swa.generate(input_ids=[[5, 6, 7, 8]] * 2, sampling_params=SP)
    assert [o["meta_info"]["cached_tokens"] for o in outs] == [0, 0]  # one batch: none yet
    outs = swa.generate(input_ids=[[5, 6, 7, 8]], sampling_params=SP)
    assert [o["meta_info"]["cached_tokens"] for o in outs] == [3]
    swa.shutdown()
    swa_off = _engine(disable_radix_cache=True, **hybrid)
    assert swa_off.scheduler.is_swa and swa_off.scheduler.tree_cache is None
    outs = swa_off.generate(input_ids=[[5, 6, 7, 8]] * 2, sampling_params=SP)
    outs += swa_off.generate(input_ids=[[5, 6, 7, 8]], sampling_params=SP)
    assert [o["meta_info"]["cached_tokens"] for o in outs] == [0, 0, 0]
    swa_off.shutdown()


@gpu
@pytest.mark.parametrize("kv", ["auto", "fp8_e4m3"])
def test_gpu_graphs_greedy_identical_with_and_without_cache(kv):
    """CUDA graphs, bf16 / fp8 KV: the same greedy tokens with the cache as without (unrun
    here: no GPU on CI)."""
    prompts = _workload(16, seed=3)
    kw = dict(device="cuda", kv_cache_dtype=kv, max_total_tokens=8192)
    on, off = _engine(16, **kw), _engine(16, disable_radix_cache=True, **kw)
    want = _ids(off.generate(input_ids=prompts, sampling_params=SP))
    assert _ids(on.generate(input_ids=prompts, sampling_params=SP)) == want
    assert _ids(on.generate(input_ids=prompts, sampling_params=SP)) == want
    torch.cuda.synchronize()
    for eng in (on, off):
        eng.shutdown()
