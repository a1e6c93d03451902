"""One bad request never hurts another (issue 50): a request that fails inside a step fails
alone, the step is retried without it, the others' tokens are those of their solo runs, and
both pools are back to full afterwards.

A poison request joins a running batch (the tiny Llama, CPU, overlapped decode on and off,
page sizes 1 and 4): its forward rows raise after it produced a few tokens, or its sampling
raises.
"""

from __future__ import annotations

import random
import threading

import pytest

import srt
import srt.managers.scheduler as scheduler_mod
from tests.conftest import gpu
from tests.srt.mem_cache.swa_radix_checks import check_swa_ownership

MARK = 1000  # first prompt token of the poison request


def _free(eng) -> tuple[int, int]:
    r = eng.model_runner
    return eng.scheduler.available_kv_size(), r.req_to_token_pool.available_size()


@pytest.fixture(
    scope="module",
    params=[
        ("cpu", 1, False),
        ("cpu", 4, True),
        pytest.param(("cuda", 1, False), marks=gpu),
    ],
    ids=["page1-overlap", "page4-no-overlap", "cuda-graphs"],
)
def engine(request):
    device, page_size, no_overlap = request.param
    eng = srt.Engine(
        device=device,
        max_total_tokens=512,
        page_size=page_size,
        skip_tokenizer_init=True,
        disable_overlap_schedule=no_overlap,
    )
    yield eng
    eng.shutdown()


def _good_calls(seed: int) -> list[tuple[list[int], dict]]:
    rng = random.Random(seed)
    calls = []
    for i in range(5):
        prompt = [rng.randrange(3, 999) for _ in range(rng.randrange(1, 20))]
        sp = {"max_new_tokens": rng.randrange(6, 14), "ignore_eos": True, "temperature": 0.0}
        if i == 4:  # a seeded sampled one too: its draws do not depend on the batch
            sp.update(temperature=0.8, top_k=20, sampling_seed=rng.randrange(2**31))
        calls.append((prompt, sp))
    return calls


def _run_with_poison(eng, calls, poison_prompt, poison_sp):
    """The good calls in one thread each, streaming; the poison submitted once they run."""
    results: dict[int, dict] = {}
    started = threading.Barrier(len(calls) + 1)

    def good(i: int) -> None:
        prompt, sp = calls[i]
        it = eng.generate(input_ids=prompt, sampling_params=sp, stream=True)
        results[i] = next(it)
        started.wait(timeout=60)
        for chunk in it:
            results[i] = chunk

    threads = [threading.Thread(target=good, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    started.wait(timeout=60)  # every good request has its first token: the batch runs
    poisoned = eng.generate(input_ids=[poison_prompt, [5, 6, 7]], sampling_params=poison_sp)
    for t in threads:
        t.join(timeout=120)
    return [results[i] for i in range(len(calls))], poisoned


@pytest.mark.parametrize("where", ["forward", "sampler"])
def test_poison_request_fails_alone_in_a_running_batch(engine, monkeypatch, where):
    seed = random.randrange(2**32)
    calls = _good_calls(seed)
    start = _free(engine)
    solo = [engine.generate(input_ids=p, sampling_params=sp)["output_ids"] for p, sp in calls]
    near_sp = {"max_new_tokens": 9, "temperature": 0.0, "ignore_eos": True}
    neighbour = engine.generate(input_ids=[5, 6, 7], sampling_params=near_sp)
    sched, runner = engine.scheduler, engine.model_runner
    poison_prompt = [MARK, 4, 4, 4]
    poison_sp = {"max_new_tokens": 9, "temperature": 0.0}
    poison_solo = engine.generate(input_ids=poison_prompt, sampling_params=poison_sp)
    if where == "forward":  # its rows raise once it has 2 tokens (a decode step)
        real = runner.forward

        def forward(fb):
            rows = set(fb.req_pool_indices.tolist())
            for r in sched.running:
                if r.origin_input_ids[0] == MARK and r.req_pool_idx in rows:
                    if len(r.output_ids) >= 2:
                        raise RuntimeError("poisoned row")
            return real(fb)

        monkeypatch.setattr(runner, "forward", forward)
    else:  # its sampling raises, after drawing (min_p marks it; the neighbour is greedy)
        poison_sp = {**poison_sp, "temperature": 0.5, "min_p": 0.0123, "sampling_seed": 3}
        real_sample = scheduler_mod.sample

        def sample(logits, params, *a, **k):
            out = real_sample(logits, params, *a, **k)
            if any(p.min_p == 0.0123 for p in params):
                raise ValueError("probability tensor contains either inf, nan")
            return out

        monkeypatch.setattr(scheduler_mod, "sample", sample)
    sp_list = [poison_sp, near_sp]
    finals, (bad, ok) = _run_with_poison(engine, calls, poison_prompt, sp_list)
    assert [f["output_ids"] for f in finals] == solo, f"seed {seed}"
    assert all(f["meta_info"]["finish_reason"]["type"] == "length" for f in finals)
    assert ok["output_ids"] == neighbour["output_ids"] and "error" not in ok
    reason = bad["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and reason["status_code"] == 500
    assert "poisoned row" in bad["error"] or "probability tensor" in bad["error"]
    if where == "forward":  # the tokens it had are kept (the overlapped decode launches
        # a step before the previous one's token is counted: one more)
        n = len(bad["output_ids"])
        assert n in (2, 3) and bad["output_ids"] == poison_solo["output_ids"][:n]
    with pytest.raises((RuntimeError, ValueError)):  # alone, the call raises its error
        engine.generate(input_ids=poison_prompt, sampling_params=poison_sp)
    monkeypatch.undo()
    assert _free(engine) == start and not sched.has_work()


def test_step_isolation_undoes_the_slots_a_failed_decode_took(engine, monkeypatch):
    """Scheduler level: every decode attempt that raises gives back the slot it allocated
    (page boundaries included), so the pool is full after the poisoned run."""
    sched, runner = engine.scheduler, engine.model_runner
    start = _free(engine)
    batch = engine.make_requests(
        input_ids=[[MARK] + [2] * k for k in (3, 4, 7)],
        sampling_params={"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True},
    )
    reqs = batch.reqs
    real = runner.forward
    calls = {"n": 0}

    def forward(fb):
        calls["n"] += 1
        if calls["n"] > 3:  # the prefill and two decodes pass, then every step fails
            raise RuntimeError("device lost")
        return real(fb)

    monkeypatch.setattr(runner, "forward", forward)
    for r in reqs:
        sched.add_request(r)
    sched.run_until_idle()
    assert all(r.finished_reason["type"] == "abort" for r in reqs)
    assert all(isinstance(r.error, RuntimeError) for r in reqs)
    assert all(r.req_pool_idx is None and not r.kv_pages for r in reqs)
    assert _free(engine) == start and not sched.has_work()


@pytest.mark.parametrize("radix", [True, False], ids=["cache", "nocache"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_failed_decode_gives_back_window_pages_too(monkeypatch, page_size, radix):
    """The hybrid sliding-window pool (tiny gpt-oss, window 5): a request whose decode steps
    fail after its window pages were evicted, each failing step taking a new page (position
    16 starts one at page sizes 1 and 4), is undone page-exactly in both pools, and the
    others match their solo runs (with the prefix cache: what is not free is the tree's,
    unlocked, and every page and mapping entry has one owner)."""
    import json

    from tests.srt.distributed.tp_harness import TINY_GPT_OSS

    eng = srt.Engine(
        device="cpu",
        skip_tokenizer_init=True,
        json_model_override_args=json.dumps(TINY_GPT_OSS),
        max_total_tokens=256,
        page_size=page_size,
        disable_radix_cache=not radix,
    )
    sched, runner = eng.scheduler, eng.model_runner
    assert sched.is_swa and (sched.tree_cache is not None) == radix
    alloc, tree = runner.token_to_kv_pool_allocator, sched.tree_cache

    def free() -> tuple[int, int, int]:
        full, swa = alloc.available_size(), alloc.swa_available_size()
        if tree is not None:
            full, swa = full + tree.evictable_size(), swa + tree.swa_evictable_size()
        return full, swa, _free(eng)[1]

    start = free()
    sp = {"max_new_tokens": 14, "temperature": 0.0, "ignore_eos": True}
    prompts = [[MARK] + [7] * 9, [3, 4, 5], [9] * 13]
    solo = [eng.generate(input_ids=p, sampling_params=sp)["output_ids"] for p in prompts[1:]]
    real = runner.forward

    def forward(fb):
        rows = set(fb.req_pool_indices.tolist())
        for r in sched.running:
            if r.origin_input_ids[0] == MARK and r.req_pool_idx in rows and r.kv_len >= 16:
                raise RuntimeError("poisoned row")
        return real(fb)

    monkeypatch.setattr(runner, "forward", forward)
    outs = eng.generate(input_ids=prompts, sampling_params=sp)
    assert "poisoned row" in outs[0]["error"] and len(outs[0]["output_ids"]) >= 5
    assert [o["output_ids"] for o in outs[1:]] == solo
    assert free() == start and not sched.has_work()
    check_swa_ownership(tree, alloc, [])
    eng.shutdown()


def _logprob_view(out: dict) -> tuple:
    """The ids and every logprob list of an output (values apart, to compare them approx)."""
    meta = out["meta_info"]
    keys = ("input_token_logprobs", "output_token_logprobs")
    ids = tuple(tuple(t for _, t, _ in meta[k]) for k in keys)
    tops = tuple(
        tuple(None if row is None else tuple(t for _, t, _ in row) for row in meta[k])
        for k in ("input_top_logprobs", "output_top_logprobs")
    )
    values = [lp for k in keys for lp, _, _ in meta[k] if lp is not None]
    values += [
        lp
        for k in ("input_top_logprobs", "output_top_logprobs")
        for row in meta[k]
        if row is not None
        for lp, _, _ in row
    ]
    return (out["output_ids"], ids, tops), values


@pytest.mark.parametrize("at", [1, 3], ids=["prefill", "decode"])
def test_poison_beside_logprob_requests_keeps_their_logprobs(engine, monkeypatch, at):
    """Logprob requests sharing a step with a request that fails inside it (after the rows
    before it recorded their token's logprob and top list): the step is undone and retried,
    and each logprob request's prompt and output logprobs and top lists are its solo run's,
    none duplicated and none lost (ReqSnapshot restores every logprob list)."""
    rng = random.Random(random.randrange(2**32))
    prompts = [[rng.randrange(3, 999) for _ in range(n)] for n in (5, rng.randrange(2, 12))]
    sp = {"max_new_tokens": 7, "temperature": 0.0, "ignore_eos": True}
    lp_args = dict(top_logprobs_num=3, logprob_start_len=0)
    start = _free(engine)
    solo = [
        engine.generate(input_ids=p, sampling_params=sp, return_logprob=True, **lp_args)
        for p in prompts
    ]
    real = scheduler_mod.record_output_logprob

    def record(req, lp):  # the poison raises once its token is appended (the others' are)
        real(req, lp)
        if req.origin_input_ids[0] == MARK and len(req.output_ids) >= at:
            raise RuntimeError("poisoned row")

    monkeypatch.setattr(scheduler_mod, "record_output_logprob", record)
    outs = engine.generate(
        input_ids=[prompts[0], [MARK, 4, 4, 4], prompts[1]],
        sampling_params=sp,
        return_logprob=[True, False, True],
        **lp_args,
    )
    monkeypatch.undo()
    assert "poisoned row" in outs[1]["error"] and len(outs[1]["output_ids"]) == at - 1
    for got, want in zip([outs[0], outs[2]], solo, strict=True):
        (got_view, got_values), (want_view, want_values) = _logprob_view(got), _logprob_view(want)
        assert got_view == want_view
        assert got_values == pytest.approx(want_values, abs=1e-5)
    assert _free(engine) == start and not engine.scheduler.has_work()
