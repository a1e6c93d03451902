"""The Engine from several threads and concurrent coroutines at once (issue 50).

Every caller's requests join the one continuous batch of the engine's loop thread; each gets
the tokens of its solo greedy (or seeded) run, and no KV slot or request row is lost. The
embedded tiny Llama and its tokenizer on CPU, a 512-token pool (so requests also wait for
memory), short outputs.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest

import srt
from tests.conftest import gpu

GREEDY = {"temperature": 0.0, "ignore_eos": True}


def _free(eng) -> tuple[int, int]:
    r = eng.model_runner
    return eng.scheduler.available_kv_size(), r.req_to_token_pool.available_size()


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=gpu)])
def engine(request):
    eng = srt.Engine(device=request.param, max_total_tokens=512, max_running_requests=16)
    if eng.tokenizer is None:
        pytest.skip("tiny tokenizer not shipped")
    yield eng
    eng.shutdown()


def _record_batch_sizes(monkeypatch, eng) -> list[int]:
    sizes: list[int] = []
    runner = eng.model_runner
    real = runner.forward

    def forward(fb, *a, **k):
        sizes.append(fb.batch_size)
        return real(fb, *a, **k)

    monkeypatch.setattr(runner, "forward", forward)
    return sizes


def test_threads_get_their_solo_tokens_and_lose_no_slot(engine, monkeypatch):
    """The issue's case: 4 threads x 3 greedy calls on a 512-token pool gave wrong tokens,
    IndexError / "double free" / "was not prefilled", and lost 12-15 slots."""
    rng = random.Random()
    prompts = [[rng.randrange(3, 1000) for _ in range(rng.randrange(1, 30))] for _ in range(12)]
    sp = dict(GREEDY, max_new_tokens=8)
    solo = [engine.generate(input_ids=p, sampling_params=sp)["output_ids"] for p in prompts]
    start = _free(engine)
    sizes = _record_batch_sizes(monkeypatch, engine)
    got: dict[int, list[int]] = {}
    errors: list[BaseException] = []
    go = threading.Barrier(4)

    def worker(t: int) -> None:
        go.wait(timeout=30)
        for j in range(3):
            try:
                got[t * 3 + j] = engine.generate(input_ids=prompts[t * 3 + j], sampling_params=sp)[
                    "output_ids"
                ]
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert [got[i] for i in range(12)] == solo, f"prompts {prompts}"
    assert _free(engine) == start and not engine.scheduler.has_work()
    assert max(sizes) > 1  # the callers shared batches


def test_asyncio_gather_of_async_generate(engine):
    """The issue's case: asyncio.gather over two async_generate calls raised IndexError in
    schedule_batch.prepare_for_decode."""
    sp = dict(GREEDY, max_new_tokens=6)
    prompts = [[5, 6, 7], [8] * 11, [9, 10]]
    solo = [engine.generate(input_ids=p, sampling_params=sp)["output_ids"] for p in prompts]
    start = _free(engine)

    async def main():
        return await asyncio.gather(
            engine.async_generate(input_ids=prompts[0], sampling_params=sp),
            engine.async_generate(input_ids=prompts[1:], sampling_params=sp),
        )

    one, two = asyncio.run(main())
    assert [one["output_ids"]] + [o["output_ids"] for o in two] == solo
    assert _free(engine) == start


def test_cancelled_coroutine_frees_its_requests(engine):
    start = _free(engine)

    async def main():
        task = asyncio.ensure_future(
            engine.async_generate(input_ids=[[1, 2, 3]] * 3, sampling_params=dict(GREEDY))
        )
        while engine.engine_loop().num_active == 0:
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert _free(engine) == start and not engine.scheduler.has_work()


def _stop_string(text: str, rng: random.Random) -> str | None:
    """A short piece of the solo text (its first occurrence is where that run stops)."""
    text = text.strip()
    if len(text) < 6:
        return None
    i = rng.randrange(2, len(text) - 3)
    s = text[i : i + 3]
    return s if s.strip() else None


def test_stress_threads_and_coroutines(engine, monkeypatch):
    """8 threads and 16 coroutines at once, random lengths, text and token prompts (the
    tokenizer used from every thread), some stop strings, some streams closed early (aborts),
    some seeded sampling: each output equals its solo run (an aborted stream: a prefix of it);
    both pools are back to full afterwards."""
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    jobs = []  # (prompt kwargs, sampling params, abort after this many chunks or None)
    for i in range(24):
        ids = [rng.randrange(3, 1000) for _ in range(rng.randrange(1, 40))]
        prompt = {"input_ids": ids}
        if i % 2:
            text = engine.tokenizer.decode(ids, skip_special_tokens=True)
            prompt = {"prompt": text} if text.strip() else prompt
        sp = dict(GREEDY, max_new_tokens=rng.randrange(1, 10))
        if i % 5 == 4:
            sp.update(temperature=0.9, top_k=rng.choice([-1, 30]), sampling_seed=rng.randrange(99))
        jobs.append([prompt, sp, rng.randrange(1, 4) if i % 4 == 3 else None])
    for job in jobs:  # stop strings taken from the solo text, for some greedy jobs
        prompt, sp, _ = job
        if rng.random() < 0.4 and sp["temperature"] == 0.0:
            text = engine.generate(**prompt, sampling_params=sp)["text"]
            stop = _stop_string(text, rng)
            if stop is not None:
                job[1] = dict(sp, stop=stop)
    solo = [engine.generate(**p, sampling_params=sp) for p, sp, _ in jobs]
    start = _free(engine)
    sizes = _record_batch_sizes(monkeypatch, engine)
    results: dict[int, object] = {}

    def run_thread(i: int) -> None:
        prompt, sp, abort_after = jobs[i]
        try:
            if abort_after is None:
                results[i] = engine.generate(**prompt, sampling_params=sp)
                return
            it = engine.generate(**prompt, sampling_params=sp, stream=True)
            chunks = [c for _, c in zip(range(abort_after), it, strict=False)]
            it.close()  # aborts the request if it still runs
            results[i] = chunks
        except BaseException as e:  # noqa: BLE001 - checked below
            results[i] = e

    async def run_coroutine(i: int) -> None:
        prompt, sp, abort_after = jobs[i]
        await asyncio.sleep(rng.random() * 0.02)
        if abort_after is None:
            results[i] = await engine.async_generate(**prompt, sampling_params=sp)
            return
        it = await engine.async_generate(**prompt, sampling_params=sp, stream=True)
        chunks = []
        async for chunk in it:
            chunks.append(chunk)
            if len(chunks) == abort_after:
                break
        await it.aclose()
        results[i] = chunks

    async def coroutines() -> None:
        await asyncio.gather(*(run_coroutine(i) for i in range(8, 24)))

    threads = [threading.Thread(target=run_thread, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    asyncio.run(coroutines())
    for t in threads:
        t.join(timeout=120)
    for i, (_, _, abort_after) in enumerate(jobs):
        got, want = results[i], solo[i]
        assert not isinstance(got, BaseException), (seed, i, got)
        if abort_after is None:
            assert got["output_ids"] == want["output_ids"], (seed, i)
            assert got["text"] == want["text"], (seed, i)
            assert got["meta_info"]["finish_reason"] == want["meta_info"]["finish_reason"]
        else:  # cumulative chunks: each a prefix of the solo output
            for chunk in got:
                n = len(chunk["output_ids"])
                assert chunk["output_ids"] == want["output_ids"][:n], (seed, i)
    deadline = time.monotonic() + 30
    while engine.scheduler.has_work() and time.monotonic() < deadline:
        time.sleep(0.01)  # (a stream closed by the garbage collector may still be aborting)
    assert _free(engine) == start, seed
    assert max(sizes) > 1, seed


def test_logprob_arguments_through_threads_and_coroutines(engine):
    """logprob_start_len / top_logprobs_num / return_logprob (per request too) reach the loop
    thread from threads, coroutines and streams alike: each call gets its solo run's logprobs
    while the others share its batch."""
    rng = random.Random()
    prompts = [[rng.randrange(3, 1000) for _ in range(rng.randrange(2, 20))] for _ in range(6)]
    sp = dict(GREEDY, max_new_tokens=5)
    kw = dict(return_logprob=True, top_logprobs_num=3, logprob_start_len=1)
    solo = [engine.generate(input_ids=p, sampling_params=sp, **kw) for p in prompts]
    start = _free(engine)

    def view(out: dict) -> tuple:
        meta = out["meta_info"]
        keys = ("input_token_logprobs", "output_token_logprobs", "output_top_logprobs")
        return out["output_ids"], [len(meta[k]) for k in keys], meta["output_top_logprobs"]

    got: dict[int, dict] = {}
    go = threading.Barrier(3)

    def worker(i: int) -> None:
        go.wait(timeout=30)
        got[i] = engine.generate(input_ids=prompts[i], sampling_params=sp, **kw)

    async def coroutines() -> list:
        calls = [engine.async_generate(input_ids=p, sampling_params=sp, **kw) for p in prompts[2:4]]
        stream = await engine.async_generate(
            input_ids=prompts[4:], sampling_params=sp, stream=True, **kw
        )
        last: dict[int, dict] = {}
        async for chunk in stream:  # cumulative: the last chunk of each is its output
            last[chunk["index"]] = chunk
        return [*await asyncio.gather(*calls), last[0], last[1]]

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    go.wait(timeout=30)
    outs = asyncio.run(coroutines())
    for t in threads:
        t.join(timeout=120)
    outs = [got[0], got[1], *outs]
    for out, ref in zip(outs, solo, strict=True):
        ids, lens, tops = view(out)
        ref_ids, ref_lens, ref_tops = view(ref)
        assert (ids, lens) == (ref_ids, ref_lens)
        assert [[t for _, t, _ in row] for row in tops] == [[t for _, t, _ in r] for r in ref_tops]
        lps = [e[0] for e in out["meta_info"]["output_token_logprobs"]]
        ref_lps = [e[0] for e in ref["meta_info"]["output_token_logprobs"]]
        assert lps == pytest.approx(ref_lps, abs=1e-5)
    per_request = engine.generate(
        input_ids=prompts[:2], sampling_params=sp, return_logprob=[False, True], top_logprobs_num=2
    )
    assert "input_token_logprobs" not in per_request[0]["meta_info"]
    assert len(per_request[1]["meta_info"]["output_top_logprobs"][0]) == 2
    assert _free(engine) == start and not engine.scheduler.has_work()
