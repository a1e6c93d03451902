"""Stress of the radix cache through the scheduler (issue 48): hundreds of random requests per
configuration sharing a few prefixes (some ending exactly on a page, some namespaced by an
extra key), mid-flight aborts, a pool small enough that the tree is evicted, chunked prefill of
the longer prompts (chunks not a whole number of pages too), page sizes 1 and 16, bf16 and fp8
KV, fused and unfused RoPE + KV, the write check on (SGL_EXT_DEBUG).

Around every scheduler step: every slot someone reads before and after it (a cached prefix's,
a running request's written token's) keeps its K/V bytes, unless its page was freed in between
(evicted, then handed out again); every page is held by exactly one of the free list, the tree
and one running request, with exact sizes and locks. At the end the pool is whole again.
"""

from __future__ import annotations

import random

import pytest

import srt
from sgl_ext import settings
from srt.managers.schedule_batch import Req
from srt.sampling.sampling_params import SamplingParams
from tests.conftest import gpu
from tests.srt.mem_cache.radix_checks import (
    changed_slots,
    check_ownership,
    kv_bytes,
    referenced_slots,
)

CONFIGS = [
    pytest.param(ps, kv, fused, "cpu", id=f"page{ps}-{kv}-{'fused' if fused else 'unfused'}")
    for ps in (1, 16)
    for kv in ("bf16", "fp8_e4m3")
    for fused in (True, False)
] + [
    pytest.param(ps, kv, True, "cuda", id=f"cuda-page{ps}-{kv}", marks=gpu)
    for ps in (1, 16)
    for kv in ("bf16", "fp8_e4m3")
]


class Tally:
    """What the run did (so the test knows it exercised hits, evictions and aborts)."""

    def __init__(self) -> None:
        self.evicted = self.aborted = self.freed_in_step = self.chunked = 0


def _workload(rng: random.Random, ps: int) -> list[list[int]]:
    toks = lambda n: [rng.randrange(3, 999) for _ in range(n)]  # noqa: E731
    return [toks(n) for n in (ps, 2 * ps, 2 * ps + 3, 5, 17, 33)]


def _new_req(rng: random.Random, rid: int, systems: list[list[int]]) -> Req:
    base = rng.choice(systems)
    ids = base[: rng.randrange(len(base) + 1)] + [rng.randrange(3, 999) for _ in range(3)]
    if rng.random() < 0.1:
        ids = list(base)  # exactly a system prompt
    params = SamplingParams(max_new_tokens=rng.randrange(1, 7), temperature=0.0, ignore_eos=True)
    return Req(rid, ids, params, extra_key="salt" if rng.random() < 0.15 else None)


def _stress(ps: int, kv: str, fused: bool, device: str, num_requests: int, seed: int) -> Tally:
    rng = random.Random(seed)
    eng = srt.Engine(
        device=device,
        skip_tokenizer_init=True,
        dtype="bfloat16",
        kv_cache_dtype="auto" if kv == "bf16" else kv,
        page_size=ps,
        enable_fused_rope_kv=fused,
        context_length=128,
        max_total_tokens=48 * 16 if ps == 16 else 384,
        max_running_requests=12,
        chunked_prefill_size=11 if ps == 1 else 24,  # longer prompts go in chunks
    )
    sched, runner = eng.scheduler, eng.model_runner
    tree, alloc, pool = sched.tree_cache, runner.token_to_kv_pool_allocator, runner.token_to_kv_pool
    tally = Tally()
    freed: set[int] = set()
    real_free, real_evict = alloc.free, tree.evict

    def free(idx):
        freed.update((idx.cpu() // ps).tolist())
        return real_free(idx)

    def evict(n):
        got = real_evict(n)
        tally.evicted += got
        return got

    alloc.free, tree.evict = free, evict
    systems = _workload(rng, ps)
    reqs: list[Req] = []
    with settings.override(debug=True):
        while len(reqs) < num_requests or sched.has_work():
            for _ in range(rng.randrange(0, 6) if len(reqs) < num_requests else 0):
                reqs.append(_new_req(rng, len(reqs), systems))
                sched.add_request(reqs[-1])
            live = [r for r in (*sched.waiting, *sched.running) if not r.finished]
            if live and rng.random() < 0.25:  # a client leaves mid-flight
                tally.aborted += sched.abort(rng.choice(live).rid) is not None
            before = kv_bytes(pool)
            read_before = referenced_slots(tree, sched.running, ps)
            freed.clear()
            sched.step()
            tally.chunked += sched.chunked_req is not None
            tally.freed_in_step += len(freed)
            read = read_before & referenced_slots(tree, sched.running, ps)
            read -= {p * ps + i for p in freed for i in range(ps)}
            assert changed_slots(before, kv_bytes(pool), read) == [], "cached K/V changed"
            check_ownership(tree, alloc, sched.running)
    assert all(r.finished and r.error is None for r in reqs), "a request failed"
    assert sched.num_prefill_steps > tally.chunked > 0
    assert tree.protected_size() == 0
    assert sched.available_kv_size() == runner.max_total_num_tokens
    assert runner.req_to_token_pool.available_size() == runner.max_running_requests
    tally.hit_rate = sched.cache_hit_rate()  # type: ignore[attr-defined]
    eng.shutdown()
    return tally


@pytest.mark.parametrize("ps, kv, fused, device", CONFIGS)
def test_random_shared_prefix_requests_keep_cached_kv_unchanged(ps, kv, fused, device):
    seed = random.randrange(2**32)
    num = 2000 if device == "cuda" else 500
    tally = _stress(ps, kv, fused, device, num, seed)
    assert tally.evicted > 0 and tally.aborted > 0, f"seed {seed}: nothing evicted or aborted"
    assert tally.hit_rate > 0.1, f"seed {seed}: too few prefix hits"  # type: ignore[attr-defined]
