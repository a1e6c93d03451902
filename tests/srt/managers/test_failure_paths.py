"""No request state leaks on a failure path (issue 21, item 6 and "no request state leaks").

Each test injects one failure into a real `srt.Engine` (the tiny Llama, dummy weights, CPU):
allocation failure in prefill or decode, an exception or KeyboardInterrupt in the forward, in
the sampler or inside the prefill allocation. After each, both pools (request rows and KV
slots) are back to their start and the next generate gives the same tokens as before.
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
        runner.token_to_kv_pool_allocator.available_size(),
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


def _nth_call_raises(fn, n: int, exc: BaseException):
    calls = {"n": 0}

    def wrapped(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == n:
            raise exc
        return fn(*args, **kwargs)

    return wrapped


def test_prefill_allocation_failure_frees_rows(engine, monkeypatch):
    """Issue item 6: rows were taken before req_pool_idx was set, then leaked forever."""
    ref, start = _reference(engine), _free_counts(engine)
    alloc = engine.model_runner.token_to_kv_pool_allocator
    monkeypatch.setattr(alloc, "alloc", lambda *a, **k: None)
    monkeypatch.setattr(alloc, "alloc_extend", lambda *a, **k: None)
    with pytest.raises(RuntimeError, match="out of memory"):
        engine.generate(input_ids=_prompts(), sampling_params=GREEDY)
    monkeypatch.undo()
    _assert_recovered(engine, start, ref)


def test_decode_allocation_failure_frees_everything(engine, monkeypatch):
    ref, start = _reference(engine), _free_counts(engine)
    alloc = engine.model_runner.token_to_kv_pool_allocator
    # The first decode step fails to get its slots (prefill uses alloc_extend).
    monkeypatch.setattr(alloc, "alloc_decode", lambda *a, **k: None)
    with pytest.raises(RuntimeError, match="out of memory"):
        engine.generate(input_ids=_prompts(), sampling_params=GREEDY)
    monkeypatch.undo()
    _assert_recovered(engine, start, ref)


@pytest.mark.parametrize(
    "exc", [RuntimeError("boom"), KeyboardInterrupt()], ids=["error", "ctrl-c"]
)
@pytest.mark.parametrize("call", [1, 3], ids=["prefill", "decode"])
def test_forward_failure_frees_everything(engine, monkeypatch, exc, call):
    ref, start = _reference(engine), _free_counts(engine)
    runner = engine.model_runner
    monkeypatch.setattr(runner, "forward", _nth_call_raises(runner.forward, call, exc))
    with pytest.raises(type(exc)):
        engine.generate(input_ids=_prompts(), sampling_params=GREEDY)
    monkeypatch.undo()
    _assert_recovered(engine, start, ref)


@pytest.mark.parametrize("path", ["sample", "greedy_ids", "greedy_ids_device"])
def test_sampler_failure_frees_everything(engine, monkeypatch, path):
    """Stands for a bad sampling parameter that reaches the sampler (the general sampler; the
    runner's greedy path of all-greedy prefills; the overlapped decode's device ids): the step
    raises."""
    ref, start = _reference(engine), _free_counts(engine)
    err = ValueError("probability tensor contains either inf, nan")
    params = GREEDY
    if path == "sample":  # sampled requests go through scheduler.sample
        monkeypatch.setattr(scheduler_mod, "sample", _nth_call_raises(scheduler_mod.sample, 2, err))
        params = {**GREEDY, "temperature": 0.7}
    else:  # the prefill's greedy ids, or the second overlapped decode step's
        runner = engine.model_runner
        n = 1 if path == "greedy_ids" else 2
        monkeypatch.setattr(runner, path, _nth_call_raises(getattr(runner, path), n, err))
    with pytest.raises(ValueError, match="probability"):
        engine.generate(input_ids=_prompts(), sampling_params=params)
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
    """More requests than rows: some run, some wait, when a decode step fails."""
    ref, start = _reference(engine), _free_counts(engine)
    runner = engine.model_runner
    monkeypatch.setattr(runner, "forward", _nth_call_raises(runner.forward, 4, RuntimeError("x")))
    many = _prompts() + _prompts(seed=1)  # 16 requests for 8 rows
    with pytest.raises(RuntimeError):
        engine.generate(input_ids=many, sampling_params=GREEDY)
    monkeypatch.undo()
    _assert_recovered(engine, start, ref)
