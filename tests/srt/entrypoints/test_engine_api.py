"""The SGLang-facing Engine API: context limits, per-request errors, ids, n, streaming, async.

Uses the stand-in model of tests/srt/model_executor/runner_fakes.py (vocab 61, context 96, no
tokenizer) so each engine is cheap; text features are in test_engine_text.py.
"""

from __future__ import annotations

import asyncio
import logging
import math

import pytest
import torch

import srt
from tests.srt.model_executor.runner_fakes import FakeConfig, patch_builder

GREEDY = {"temperature": 0.0, "ignore_eos": True}
CTX = FakeConfig.context_len


@pytest.fixture
def make_engine(monkeypatch):
    patch_builder(monkeypatch)

    def make(**kw):
        kw.setdefault("max_total_tokens", 512)
        return srt.Engine(device="cpu", skip_tokenizer_init=True, **kw)

    return make


def _free(eng):
    r = eng.model_runner
    return eng.scheduler.available_kv_size(), r.req_to_token_pool.available_size()


def test_over_long_request_is_rejected_with_the_three_numbers(make_engine):
    eng = make_engine()
    with pytest.raises(ValueError) as e:
        eng.generate(input_ids=[1] * 50, sampling_params={"max_new_tokens": 50})
    msg = str(e.value)
    assert "\n" not in msg
    assert "50 tokens" in msg and "max_new_tokens 50" in msg and f"context length {CTX}" in msg
    # Exactly the context still runs, to its full length.
    out = eng.generate(input_ids=[1] * 50, sampling_params=dict(GREEDY, max_new_tokens=CTX - 50))
    assert out["meta_info"]["completion_tokens"] == CTX - 50
    assert "truncation" not in out["meta_info"]


def test_allow_auto_truncate_caps_and_reports(make_engine):
    eng = make_engine(allow_auto_truncate=True)
    out = eng.generate(input_ids=[2] * 50, sampling_params=dict(GREEDY, max_new_tokens=70))
    assert out["meta_info"]["completion_tokens"] == CTX - 50
    assert out["meta_info"]["truncation"] == {
        "prompt_tokens": 50,
        "kept_prompt_tokens": 50,
        "max_new_tokens": 70,
        "capped_max_new_tokens": CTX - 50,
    }
    long = eng.generate(input_ids=[3] * (CTX + 7), sampling_params=dict(GREEDY, max_new_tokens=4))
    assert long["meta_info"]["prompt_tokens"] == CTX - 1
    assert long["meta_info"]["completion_tokens"] == 1
    assert long["meta_info"]["truncation"]["prompt_tokens"] == CTX + 7


@pytest.mark.parametrize(
    "bad, exc, match",
    [
        ({"temperature": math.nan}, ValueError, "temperature must be finite"),
        ({"top_p": math.inf}, ValueError, "top_p must be finite"),
        ({"min_p": math.nan}, ValueError, "min_p must be finite"),
        ({"top_k": 2.5}, ValueError, "top_k must be an integer"),
        ({"top_k": "0.5"}, TypeError, "top_k must be an int"),
        ({"repetition_penalty": math.nan}, ValueError, "repetition_penalty"),
        ({"repetition_penalty": 1e-300}, ValueError, "repetition_penalty=1e-300 underflows"),
        ({"temperature": 1e39}, ValueError, "temperature=1e\\+39 overflows"),
        ({"stop_token_ids": {"a": 1}}, TypeError, "stop_token_ids must be an int or a list"),
        ({"seed": 2**64}, ValueError, "sampling_seed must be in"),
        ({"n": 1000}, ValueError, "n must be in \\[1, 128\\]"),
    ],
)
def test_bad_request_in_a_batch_refuses_the_call_before_any_runs(make_engine, bad, exc, match):
    """Issue 50: every request is checked before any is scheduled; the call raises naming the
    bad request's index (what srt/eval/engine_io.py expects: it retries one by one)."""
    eng = make_engine()
    start = _free(eng)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    params = [dict(GREEDY, max_new_tokens=4), dict(GREEDY, **bad), dict(GREEDY, max_new_tokens=6)]
    steps = eng.scheduler.num_prefill_steps
    with pytest.raises(exc, match="request 1: " + match) as e:
        eng.generate(input_ids=prompts, sampling_params=params)
    assert "\n" not in str(e.value)
    with pytest.raises(exc, match="request 1: " + match):
        list(eng.generate(input_ids=prompts, sampling_params=params, stream=True))
    with pytest.raises(exc, match="request 1: " + match):
        asyncio.run(eng.async_generate(input_ids=prompts, sampling_params=params))
    assert eng.scheduler.num_prefill_steps == steps  # nothing ran
    with pytest.raises(exc, match=match) as e:  # a single bad request raises its own error
        eng.generate(input_ids=prompts[1], sampling_params=params[1])
    assert "request 1" not in str(e.value)
    good = eng.generate(input_ids=[prompts[0], prompts[2]], sampling_params=[params[0], params[2]])
    assert [len(o["output_ids"]) for o in good] == [4, 6]
    assert _free(eng) == start and not eng.scheduler.has_work()


@pytest.mark.parametrize("ids, name", [([3.7], "float"), ([True, 2], "bool"), (["4"], "str")])
def test_input_ids_must_be_ints(make_engine, ids, name):
    eng = make_engine()
    with pytest.raises(TypeError, match=f"input_ids must be ints, got {name}") as e:
        eng.generate(input_ids=ids, sampling_params={"max_new_tokens": 2})
    assert "\n" not in str(e.value)
    with pytest.raises(TypeError, match=f"request 1: input_ids must be ints, got {name}"):
        eng.generate(input_ids=[[1, 2], ids], sampling_params=dict(GREEDY, max_new_tokens=2))


def test_make_requests_keeps_per_request_errors(make_engine):
    """The HTTP loop builds with make_requests: a bad request is a RequestError in its place."""
    eng = make_engine()
    batch = eng.make_requests(
        input_ids=[[1, 2], [3]],
        sampling_params=[dict(GREEDY, max_new_tokens=2), dict(GREEDY, temperature=math.nan)],
    )
    assert [type(x).__name__ for x in batch.items] == ["Req", "RequestError"]
    assert batch.items[1].index == 1 and "temperature" in eng.output(batch.items[1])["error"]


def test_meta_info_ids_and_latency(make_engine):
    eng = make_engine()
    outs = eng.generate(
        input_ids=[[1, 2], [3], [4, 5]], sampling_params=dict(GREEDY, max_new_tokens=4)
    )
    assert not any("error" in o for o in outs)
    ids = [o["meta_info"]["id"] for o in outs]
    assert all(isinstance(i, str) and i for i in ids) and len(set(ids)) == 3
    for o in outs:
        m = o["meta_info"]
        assert m["cached_tokens"] == 0 and 0 < m["e2e_latency"] < 60


def test_n_outputs_per_prompt(make_engine):
    eng = make_engine()
    sp = {"temperature": 1.0, "max_new_tokens": 6, "ignore_eos": True, "sampling_seed": 40}
    outs = eng.generate(input_ids=[[5, 6], [7]], sampling_params=dict(sp, n=3))
    assert len(outs) == 6
    for j in range(3):  # copy j of a prompt uses seed 40 + j
        alone = eng.generate(input_ids=[7], sampling_params=dict(sp, sampling_seed=40 + j))
        assert outs[3 + j]["output_ids"] == alone["output_ids"]
    assert len({tuple(o["output_ids"]) for o in outs[:3]}) > 1
    one = eng.generate(input_ids=[5, 6], sampling_params=dict(GREEDY, n=2, max_new_tokens=3))
    assert isinstance(one, list) and one[0]["output_ids"] == one[1]["output_ids"]


def test_seed_alias_equals_sampling_seed(make_engine):
    eng = make_engine()
    sp = {"temperature": 0.8, "max_new_tokens": 6, "ignore_eos": True}
    a = eng.generate(input_ids=[9, 9], sampling_params=dict(sp, seed=5))
    b = eng.generate(input_ids=[9, 9], sampling_params=dict(sp, sampling_seed=5))
    assert a["output_ids"] == b["output_ids"]


def test_min_new_tokens_masks_stop_tokens(make_engine):
    eng = make_engine()
    ref = eng.generate(input_ids=[4, 5, 6], sampling_params=dict(GREEDY, max_new_tokens=8))
    stop = ref["output_ids"][0]
    cut = eng.generate(
        input_ids=[4, 5, 6], sampling_params=dict(GREEDY, max_new_tokens=8, stop_token_ids=[stop])
    )
    assert cut["output_ids"] == [stop]
    held = eng.generate(
        input_ids=[4, 5, 6],
        sampling_params=dict(GREEDY, max_new_tokens=8, stop_token_ids=[stop], min_new_tokens=3),
    )
    assert len(held["output_ids"]) >= 3 and stop not in held["output_ids"][:3]


def test_penalties_reach_the_sampler(make_engine, monkeypatch):
    from srt.managers import scheduler as sched_mod

    calls = []
    real = sched_mod.apply_penalties
    monkeypatch.setattr(
        sched_mod, "apply_penalties", lambda lg, xs: calls.append(xs) or real(lg, xs)
    )
    eng = make_engine()
    sp = dict(GREEDY, max_new_tokens=12)
    plain = eng.generate(input_ids=[[3, 3, 3]] * 2, sampling_params=sp)
    assert not calls  # no penalty, no work
    pen = eng.generate(
        input_ids=[[3, 3, 3]] * 2,
        sampling_params=[sp, dict(sp, repetition_penalty=2.0, presence_penalty=2.0)],
    )
    assert len(calls) == 12 and calls[-1][1].params.repetition_penalty == 2.0
    assert pen[0]["output_ids"] == plain[0]["output_ids"]
    assert len(set(pen[1]["output_ids"])) >= len(set(plain[1]["output_ids"]))


def test_stream_chunks_add_up_and_close_frees(make_engine):
    eng = make_engine()
    start = _free(eng)
    prompts = [[5, 6, 7], [8], [9, 10]]
    sp = [dict(GREEDY, max_new_tokens=n) for n in (5, 3, 7)]
    full = eng.generate(input_ids=prompts, sampling_params=sp)
    got = {0: [], 1: [], 2: []}
    last = {}
    for chunk in eng.generate(input_ids=prompts, sampling_params=sp, stream=True):
        i = chunk["index"]
        assert chunk["output_ids"][: len(got[i])] == got[i]  # cumulative (SGLang's default)
        got[i] = chunk["output_ids"]
        last[i] = chunk["meta_info"]["finish_reason"]
    assert [got[i] for i in range(3)] == [o["output_ids"] for o in full]
    assert all(last[i]["type"] == "length" for i in range(3))
    single = list(eng.generate(input_ids=[5, 6, 7], sampling_params=sp[0], stream=True))
    assert "index" not in single[0] and single[-1]["meta_info"]["completion_tokens"] == 5
    assert single[-1]["output_ids"] == full[0]["output_ids"]
    it = eng.generate(
        input_ids=prompts, sampling_params=dict(GREEDY, max_new_tokens=50), stream=True
    )
    next(it)
    assert _free(eng) != start  # requests hold memory mid-stream
    it.close()
    assert _free(eng) == start and not eng.scheduler.has_work()
    with pytest.raises(ValueError, match="top_p"):  # a single bad request raises at the call
        eng.generate(input_ids=[1], sampling_params={"top_p": 5}, stream=True)


def test_async_generate(make_engine):
    eng = make_engine()
    sp = dict(GREEDY, max_new_tokens=4)
    ref = eng.generate(input_ids=[1, 2, 3], sampling_params=sp)

    async def run():
        out = await eng.async_generate(input_ids=[1, 2, 3], sampling_params=sp)
        chunks = [
            c
            async for c in await eng.async_generate(
                input_ids=[1, 2, 3], sampling_params=sp, stream=True
            )
        ]
        return out, chunks

    out, chunks = asyncio.run(run())
    assert out["output_ids"] == ref["output_ids"]
    assert chunks[-1]["output_ids"] == ref["output_ids"]  # cumulative chunks
    assert [len(c["output_ids"]) for c in chunks] == [1, 2, 3, 4]


def test_incremental_streaming_output(make_engine):
    """SGLang's incremental_streaming_output: each chunk has only what is new."""
    eng = make_engine(incremental_streaming_output=True)
    sp = dict(GREEDY, max_new_tokens=5)
    ref = eng.generate(input_ids=[[1, 2, 3], [4]], sampling_params=sp)
    got: dict[int, list[int]] = {0: [], 1: []}
    for chunk in eng.generate(input_ids=[[1, 2, 3], [4]], sampling_params=sp, stream=True):
        assert len(chunk["output_ids"]) == 1
        got[chunk["index"]] += chunk["output_ids"]
    assert [got[0], got[1]] == [o["output_ids"] for o in ref]


def test_log_level(make_engine):
    log = logging.getLogger("srt")
    old = log.level
    try:
        make_engine(log_level="error")
        assert log.level == logging.ERROR
    finally:
        log.setLevel(old)
    with pytest.raises(ValueError, match="log_level"):
        make_engine(log_level="loud")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_engine_loop_thread_replays_cuda_graphs_like_generate():
    """The engine's loop thread (the one generate and the server submit to) replays graphs
    captured on the main thread as the main thread does: same tokens, streamed or whole."""
    import queue

    from srt.entrypoints.engine_loop import Submission

    eng = srt.Engine(device="cuda", dtype="float32", max_total_tokens=8192, cuda_graph_max_bs=8)
    try:
        assert eng.model_runner.cuda_graph_runner is not None
        prompts = [[5 + i] * (3 + 5 * i) for i in range(6)]
        sp = dict(GREEDY, max_new_tokens=12)
        reqs = eng.make_requests(input_ids=prompts, sampling_params=sp).reqs
        for r in reqs:  # the reference: the scheduler driven on this (the capturing) thread
            eng.scheduler.add_request(r)
        eng.scheduler.run_until_idle()
        ref = [r.output_ids for r in reqs]
        assert [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=sp)] == ref
        loop = eng.engine_loop()  # the one generate ran on, as the HTTP server's
        events: queue.Queue = queue.Queue()
        try:
            subs = []
            for i, p in enumerate(prompts):
                sink = lambda ev, i=i: events.put((i, ev))  # noqa: E731
                kw = {"input_ids": p, "sampling_params": sp}
                sub = Submission(kw, sink, stream=True, incremental=True)
                subs.append(sub)
                loop.submit(sub)
            got, streamed = {}, {i: [] for i in range(6)}
            while len(got) < 6:
                i, ev = events.get(timeout=120)
                assert ev[0] in ("start", "chunk", "final"), ev
                if ev[0] == "chunk":
                    streamed[i] += ev[2]["output_ids"]
                if ev[0] == "final":
                    got[i] = ev[2]["output_ids"]
        finally:
            loop.close()
        assert [got[i] for i in range(6)] == ref
        assert [streamed[i] for i in range(6)] == ref
    finally:
        eng.shutdown()


def test_get_server_info(make_engine):
    """SGLang's Engine.get_server_info(): server args, KV pool size, model basics, state."""
    import json

    eng = make_engine(max_running_requests=7)
    before = eng.get_server_info()
    assert before["max_total_tokens"] == 512 and before["page_size"] == 1
    assert before["max_total_num_tokens"] == eng.model_runner.max_total_num_tokens
    assert before["max_running_requests"] == 7
    assert before["context_length"] == CTX and before["max_req_input_len"] == CTX - 1
    assert before["model_config"]["vocab_size"] == FakeConfig.vocab_size
    assert isinstance(before["version"], str) and before["version"]
    state = before["internal_states"][0]
    assert state["num_running_reqs"] == 0 and state["token_usage"] == 0.0
    eng.generate(input_ids=[[1, 2], [3]], sampling_params=dict(GREEDY, max_new_tokens=3))
    after = eng.get_server_info()["internal_states"][0]
    assert after["num_prefill_steps"] > state["num_prefill_steps"]
    assert after["available_kv_tokens"] == state["available_kv_tokens"]
    json.dumps(after)  # JSON-serialisable, as the HTTP endpoint will send it
    json.dumps(before)


def test_engine_dropped_without_shutdown_is_collected(make_engine):
    """The loop thread holds the engine weakly: a dropped engine frees its model and KV cache
    (as before there was a loop thread), and the thread ends."""
    import gc
    import weakref

    eng = make_engine()
    eng.generate(input_ids=[1, 2], sampling_params=dict(GREEDY, max_new_tokens=2))
    ref, thread = weakref.ref(eng), eng.engine_loop()._thread
    del eng
    gc.collect()
    assert ref() is None
    thread.join(timeout=10)
    assert not thread.is_alive()
