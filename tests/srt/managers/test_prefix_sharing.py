"""How requests come to share a prefix (issue 48): a prompt goes into the radix cache right after
its prefill, so a request admitted while it still decodes matches it; requests that arrive
together with a common prefix are not all computed in full (the in-batch check defers the others
one step, then they match). Tokens are always the solo runs' (embedded tiny Llama, CPU)."""

from __future__ import annotations

import random

import pytest

import srt
from srt.managers.schedule_batch import Req
from srt.managers.schedule_policy import IN_BATCH_PREFIX_THRESHOLD
from srt.sampling.sampling_params import SamplingParams
from tests.srt.mem_cache.radix_checks import check_ownership

SP = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}


def _engine(ps: int, **kw) -> srt.Engine:
    kw.update(device="cpu", skip_tokenizer_init=True, context_length=512, max_total_tokens=4096)
    return srt.Engine(page_size=ps, **kw)


def _req(rid: str, ids: list[int], n: int = 6) -> Req:
    return Req(rid, list(ids), SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True))


def _solo(eng: srt.Engine, prompts: list[list[int]]) -> list[list[int]]:
    outs = [eng.generate(input_ids=p, sampling_params=SP)["output_ids"] for p in prompts]
    assert eng.flush_cache()
    return outs


@pytest.mark.parametrize("ps", [1, 16])
def test_prompt_is_cached_while_it_still_decodes(ps):
    eng = _engine(ps)
    sched = eng.scheduler
    rng = random.Random(ps)
    system = [rng.randrange(3, 999) for _ in range(70)]
    a_ids, b_ids = system + [5, 6, 7], system + [8, 9]
    want = _solo(eng, [a_ids, b_ids])
    a = _req("a", a_ids, n=12)
    sched.add_request(a)
    sched.step()  # a's prefill: its whole prompt pages go into the tree now
    assert not a.finished and a.cache_protected_len == len(a_ids) // ps * ps
    b = _req("b", b_ids)
    sched.add_request(b)
    sched.run_until_idle()
    assert b.cached_tokens == len(system) // ps * ps  # matched a prompt still decoding
    assert [a.output_ids[:6], b.output_ids] == want
    check_ownership(sched.tree_cache, eng.model_runner.token_to_kv_pool_allocator, [])
    assert sched.tree_cache.protected_size() == 0
    eng.shutdown()


@pytest.mark.parametrize("ps", [1, 4])
def test_requests_arriving_together_compute_their_common_prefix_once(ps):
    eng = _engine(ps)
    sched = eng.scheduler
    rng = random.Random(7 + ps)
    toks = lambda n: [rng.randrange(3, 999) for _ in range(n)]  # noqa: E731
    groups = [toks(IN_BATCH_PREFIX_THRESHOLD + 45), toks(IN_BATCH_PREFIX_THRESHOLD + 3)]
    prompts = [groups[i % 2] + toks(1 + i) for i in range(8)] + [toks(40), toks(9)]
    want = _solo(eng, prompts)
    reqs = [_req(f"r{i}", p) for i, p in enumerate(prompts)]
    for r in reqs:
        sched.add_request(r)
    steps = sched.num_prefill_steps
    sched.run_until_idle()
    assert [r.output_ids for r in reqs] == want
    # the first of each group computes the group's prefix; the other three match it
    for i, r in enumerate(reqs[:8]):
        common = len(groups[i % 2]) // ps * ps
        assert r.cached_tokens == (0 if i < 2 else common), (i, r.cached_tokens)
    assert [r.cached_tokens for r in reqs[8:]] == [0, 0]  # nothing shared: never deferred
    assert sched.num_prefill_steps - steps == 2  # the group leaders, then everyone else
    eng.shutdown()


def test_without_the_cache_nothing_is_deferred():
    eng = _engine(1, disable_radix_cache=True)
    sched = eng.scheduler
    shared = list(range(10, 10 + 2 * IN_BATCH_PREFIX_THRESHOLD))
    reqs = [_req(f"r{i}", shared + [i + 3]) for i in range(4)]
    for r in reqs:
        sched.add_request(r)
    steps = sched.num_prefill_steps
    sched.run_until_idle()
    assert sched.num_prefill_steps - steps == 1 and all(r.cached_tokens == 0 for r in reqs)
    eng.shutdown()
