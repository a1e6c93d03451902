"""No request state leaks on a failure path (issue 21, item 6 and "no request state leaks"),
and a failed step fails only the requests it fails for (issue 50).

Each test injects failures into a real `srt.Engine` (the tiny Llama, dummy weights, CPU):
allocation failure in prefill or decode, an exception or KeyboardInterrupt in the forward, in
the sampler or inside the prefill allocation. A step that fails once is retried (same tokens);
one that fails every time fails each request alone; an interrupt aborts the call. After each,
both pools (request rows and KV slots) are back to their start and the next generate gives the
same tokens as before.
"""

from __future__ import annotations

import pytest
import torch

import srt
import srt.managers.scheduler as scheduler_mod

GREEDY = {"max_new_tokens": 5, "temperature": 0.0, "ignore_eos": True}
ROWS = 8


def _prompts(n: int = ROWS, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = [3, 1, 7, 33, 2, 12, 5, 17][:n]
    return [torch.randint(3, 1000, (m,), generator=g).tolist() for m in lens]


@pytest.fixture(scope="module", params=[1, 16], ids=["page1", "page16"])
def engine(request):
    eng = srt.Engine(
        device="cpu",
        max_total_tokens=512,
        max_running_requests=ROWS,
        page_size=request.param,
        skip_tokenizer_init=True,
    )
    yield eng
    eng.shutdown()


def _free_counts(eng) -> tuple[int, int]:
    runner = eng.model_runner
    return (
        eng.scheduler.available_kv_size(),
        runner.req_to_token_pool.available_size(),
    )


def _reference(eng) -> list[list[int]]:
    outs = eng.generate(input_ids=_prompts(), sampling_params=GREEDY)
    return [o["output_ids"] for o in outs]


def _assert_recovered(eng, start: tuple[int, int], ref: list[list[int]]) -> None:
    assert _free_counts(eng) == start, "a pool did not get everything back"
    assert not eng.scheduler.has_work()
    assert _reference(eng) == ref, "the next generate differs"
    assert _free_counts(eng) == start


def _nth_call_raises(fn, n: int, exc: BaseException, after: bool = False):
    """fn, but its n-th call raises exc (after running fn, so that its effects happened)."""
    calls = {"n": 0}

    def wrapped(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == n:
            if after:
                fn(*args, **kwargs)
            raise exc
        return fn(*args, **kwargs)

    return wrapped


def _all_fail_alone(outs: list[dict], match: str) -> None:
    for o in outs:
        assert match in o["error"], o
        assert o["meta_info"]["finish_reason"]["type"] == "abort"
        assert o["meta_info"]["finish_reason"]["status_code"] == 500


def test_prefill_allocation_failure_frees_rows(engine, monkeypatch):
    """Issue 21 item 6: rows were taken before req_pool_idx was set, then leaked forever. A
    failure on every try: each request fails alone (a list call keeps going), nothing leaks."""
    ref, start = _reference(engine), _free_counts(engine)
    alloc = engine.model_runner.token_to_kv_pool_allocator
    monkeypatch.setattr(alloc, "alloc", lambda *a, **k: None)
    monkeypatch.setattr(alloc, "alloc_extend", lambda *a, **k: None)
    _all_fail_alone(engine.generate(input_ids=_prompts(), sampling_params=GREEDY), "out of memory")
    with pytest.raises(RuntimeError, match="out of memory"):  # a single request raises it
        engine.generate(input_ids=_prompts()[0], sampling_params=GREEDY)
    monkeypatch.undo()
    _assert_recovered(engine, start, ref)


def test_decode_allocation_failure_frees_everything(engine, monkeypatch):
    ref, start = _reference(engine), _free_counts(engine)
    alloc = engine.model_runner.token_to_kv_pool_allocator
    # Every decode step fails to get its slots (prefill uses alloc_extend).
    monkeypatch.setattr(alloc, "alloc_decode", lambda *a, **k: None)
    outs = engine.generate(input_ids=_prompts(), sampling_params=GREEDY)
    _all_fail_alone(outs, "out of memory")
    assert [o["output_ids"] for o in outs] == [r[:1] for r in ref]  # the prefill's token kept
    monkeypatch.undo()
    _assert_recovered(engine, start, ref)


@pytest.mark.parametrize("call", [1, 3], ids=["prefill", "decode"])
def test_one_forward_failure_is_retried_without_loss(engine, monkeypatch, call):
    """Issue 50: a step that fails once is undone and retried in halves: every request gets
    the tokens it gets without the failure, and nothing leaks."""
    ref, start = _reference(engine), _free_counts(engine)
    runner = engine.model_runner
    monkeypatch.setattr(runner, "forward", _nth_call_raises(runner.forward, call, RuntimeError()))
    assert _reference(engine) == ref
    monkeypatch.undo()
    _assert_recovered(engine, start, ref)


@pytest.mark.parametrize("call", [1, 3], ids=["prefill", "decode"])
def test_interrupt_in_the_forward_frees_everything(engine, monkeypatch, call):
    ref, start = _reference(engine), _free_counts(engine)
    runner = engine.model_runner
    exc = KeyboardInterrupt()
    monkeypatch.setattr(runner, "forward", _nth_call_raises(runner.forward, call, exc))
    with pytest.raises(KeyboardInterrupt):
        engine.generate(input_ids=_prompts(), sampling_params=GREEDY)
    monkeypatch.undo()
    _assert_recovered(engine, start, ref)


SAMPLED = {**GREEDY, "temperature": 0.7, "top_k": 40, "sampling_seed": 123}


@pytest.mark.parametrize("path", ["sample", "greedy_ids", "greedy_ids_device"])
def test_sampler_failure_is_retried_without_loss(engine, monkeypatch, path):
    """A sampler that raises once (the general sampler, with seeded top-k rows drawn from
    their generators; the runner's greedy path of all-greedy prefills; the overlapped decode's
    device ids): the retried step draws what it would have drawn (generators restored)."""
    ref, start = _reference(engine), _free_counts(engine)
    err = ValueError("probability tensor contains either inf, nan")
    params = GREEDY
    if path == "sample":  # sampled requests go through scheduler.sample
        params = SAMPLED
        want = engine.generate(input_ids=_prompts(), sampling_params=params)
        # raises after drawing: the generators advanced and must be restored
        flaky = _nth_call_raises(scheduler_mod.sample, 2, err, after=True)
        monkeypatch.setattr(scheduler_mod, "sample", flaky)
    else:  # the prefill's greedy ids, or the second overlapped decode step's
        want = engine.generate(input_ids=_prompts(), sampling_params=params)
        runner = engine.model_runner
        n = 1 if path == "greedy_ids" else 2
        monkeypatch.setattr(runner, path, _nth_call_raises(getattr(runner, path), n, err))
    outs = engine.generate(input_ids=_prompts(), sampling_params=params)
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in want]
    monkeypatch.undo()
    _assert_recovered(engine, start, ref)


def test_interrupt_inside_prefill_allocation_frees_rows(engine, monkeypatch):
    ref, start = _reference(engine), _free_counts(engine)
    alloc = engine.model_runner.token_to_kv_pool_allocator
    for name in ("alloc", "alloc_extend"):
        monkeypatch.setattr(
            alloc, name, _nth_call_raises(getattr(alloc, name), 1, KeyboardInterrupt())
        )
    with pytest.raises(KeyboardInterrupt):
        engine.generate(input_ids=_prompts(), sampling_params=GREEDY)
    monkeypatch.undo()
    _assert_recovered(engine, start, ref)


def test_failure_while_requests_wait_and_run_frees_everything(engine, monkeypatch):
    """More requests than rows: some run, some wait, when a decode step fails (once, then on
    every try)."""
    many = _prompts() + _prompts(seed=1)  # 16 requests for 8 rows
    ref, start = _reference(engine), _free_counts(engine)
    want = [o["output_ids"] for o in engine.generate(input_ids=many, sampling_params=GREEDY)]
    runner = engine.model_runner
    monkeypatch.setattr(runner, "forward", _nth_call_raises(runner.forward, 4, RuntimeError("x")))
    outs = engine.generate(input_ids=many, sampling_params=GREEDY)
    assert [o["output_ids"] for o in outs] == want
    monkeypatch.undo()
    real = runner.forward
    calls = {"n": 0}

    def fails_from_the_fourth(fb):
        calls["n"] += 1
        if calls["n"] >= 4:
            raise RuntimeError("device lost")
        return real(fb)

    monkeypatch.setattr(runner, "forward", fails_from_the_fourth)
    _all_fail_alone(engine.generate(input_ids=many, sampling_params=GREEDY), "device lost")
    monkeypatch.undo()
    _assert_recovered(engine, start, ref)
