"""The overlapped decode (Scheduler, SGLang's overlap schedule): the same tokens, finish
reasons and freed memory as reading every step back first, on the real tiny Llama (CPU; on
CUDA with graphs, pinned token buffers and events)."""

from __future__ import annotations

import pytest
import torch

import srt
from tests.conftest import gpu

ROWS = 8


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = [3, 1, 7, 33, 2, 12, 5, 17][:n]
    return [torch.randint(3, 1000, (m,), generator=g).tolist() for m in lens]


@pytest.fixture(
    scope="module",
    params=[("cpu", 1), ("cpu", 4), pytest.param(("cuda", 1), marks=gpu)],
    ids=["page1", "page4", "cuda-graphs"],
)
def engines(request):
    device, page_size = request.param
    kw = dict(
        device=device,
        max_total_tokens=1024,
        max_running_requests=ROWS,
        page_size=page_size,
        skip_tokenizer_init=True,
        context_length=48,
        allow_auto_truncate=True,  # the 33-token prompt: its max_new_tokens cut to fit
    )
    on = srt.Engine(**kw)
    off = srt.Engine(**kw, disable_overlap_schedule=True)
    assert on.scheduler.overlap and not off.scheduler.overlap
    yield on, off
    on.shutdown()
    off.shutdown()


def _free(eng) -> tuple[int, int]:
    r = eng.model_runner
    return eng.scheduler.available_kv_size(), r.req_to_token_pool.available_size()


def _run(eng, prompts, params):
    outs = eng.generate(input_ids=prompts, sampling_params=params)
    return [(o["output_ids"], o["meta_info"]["finish_reason"]) for o in outs]


def test_same_tokens_and_finish_reasons(engines):
    """Lengths that differ per request, stop tokens hit at various steps (those requests run a
    step past their stop), the context limit (prompt 33 + 20 > 48, cut to fit)."""
    on, off = engines
    prompts = _prompts(ROWS)
    base = [{"max_new_tokens": n, "temperature": 0.0} for n in (9, 1, 14, 20, 2, 11, 6, 17)]
    free = _free(on)
    ref = _run(off, prompts, base)
    # stop on tokens each request really produces (its 3rd / 5th / ... output)
    params = [dict(p) for p in base]
    for i in (0, 2, 5, 7):
        params[i]["stop_token_ids"] = [ref[i][0][min(2 + i % 3, len(ref[i][0]) - 1)]]
    before = on.scheduler.num_overlapped_steps
    got, want = _run(on, prompts, params), _run(off, prompts, params)
    assert got == want
    assert any(r[1]["type"] == "stop" for r in got) and any(r[1]["type"] == "length" for r in got)
    assert on.scheduler.num_overlapped_steps > before, "no step was overlapped"
    assert _free(on) == free and not on.scheduler.has_work()
    assert _run(on, prompts, base) == ref  # and the next run is unchanged


SAMPLED = [
    {"temperature": 0.8, "sampling_seed": 5},
    {"temperature": 1.3, "top_k": 7, "sampling_seed": 11},
    {"temperature": 0.6, "top_p": 0.7, "min_p": 0.05, "sampling_seed": 2},
]


def test_sampled_requests_overlap_with_the_same_tokens(engines):
    """Seeded sampled requests (with top_k / top_p / min_p) beside greedy ones: each draws
    from its own generator once a step in both schedules, so the tokens are the same; one
    stops on a token it samples (its extra step's draw is never read)."""
    on, off = engines
    prompts = _prompts(5, seed=3)
    params = [{"max_new_tokens": 10, **p} for p in SAMPLED]
    params += [{"max_new_tokens": 7, "temperature": 0.0}, {"max_new_tokens": 12, **SAMPLED[0]}]
    ref = _run(off, prompts, params)
    params[1] = {**params[1], "stop_token_ids": [ref[1][0][3]]}
    free = _free(on)
    before = on.scheduler.num_overlapped_steps
    got, want = _run(on, prompts, params), _run(off, prompts, params)
    assert got == want
    assert got[1][1]["type"] == "stop" and len(got[1][0]) <= 4
    assert on.scheduler.num_overlapped_steps > before, "no step was overlapped"
    assert _free(on) == free and not on.scheduler.has_work()


@pytest.mark.parametrize(
    "other",
    [{"min_new_tokens": 3}, {"repetition_penalty": 1.3}],
    ids=["min_new_tokens", "penalty"],
)
def test_penalised_request_turns_overlap_off_same_tokens(engines, other):
    on, off = engines
    prompts = _prompts(3, seed=1)
    params = [
        {"max_new_tokens": 8, "temperature": 0.0},
        {"max_new_tokens": 8, "temperature": 0.0} | other,
        {"max_new_tokens": 6, "temperature": 0.0},
    ]
    before = on.scheduler.num_overlapped_steps
    assert _run(on, prompts, params) == _run(off, prompts, params)
    assert on.scheduler.num_overlapped_steps == before


def test_abort_and_arrivals_while_a_step_is_in_flight(engines):
    """A request aborted while its step runs loses that token and frees its memory; a request
    added meanwhile is admitted after the step is read; the others are unchanged."""
    on, off = engines
    prompts = _prompts(4, seed=2)
    params = [{"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}] * 4
    ref = _run(off, prompts, params)
    free = _free(on)
    sched = on.scheduler
    reqs = on.make_requests(None, params[:3], prompts[:3], False).items
    for r in reqs:
        sched.add_request(r)
    sched.step()  # prefill
    sched.step()  # first decode step launched, not read
    assert sched._inflight is not None
    sched.step()  # the second launched, the first read
    assert sched._inflight is not None and all(len(r.output_ids) == 2 for r in reqs)
    aborted = sched.abort(reqs[1].rid)
    assert aborted is reqs[1] and reqs[1].finished
    late = on.make_requests(None, params[3], prompts[3], False).items[0]
    sched.add_request(late)
    sched.run_until_idle()
    assert len(reqs[1].output_ids) == 2  # the in-flight token was dropped
    assert [reqs[0].output_ids, reqs[2].output_ids, late.output_ids] == [
        ref[0][0],
        ref[2][0],
        ref[3][0],
    ]
    assert _free(on) == free and not sched.has_work()


def run_decode_without_host_waits(eng, prompts: list[list[int]], params: list[dict]) -> None:
    """Prefill, then run the whole decode phase with torch's sync debug mode raising on any
    synchronising call: the overlapped decode must never make the host wait for the device
    (reading a step's tokens waits on its event, which is not such a call)."""
    sched = eng.scheduler
    reqs = eng.make_requests(None, params, prompts, False).items
    for r in reqs:
        sched.add_request(r)
    sched.step()  # the prefill (its logits are read back: a sync)
    assert sched.running and not sched.waiting
    torch.cuda.set_sync_debug_mode("error")
    try:
        sched.run_until_idle()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert sched.num_overlapped_steps > 0 and all(r.finished for r in reqs)


@gpu
def test_overlapped_decode_never_waits_for_the_device(engines):
    on, off = engines
    if on.model_runner.device.type != "cuda":
        pytest.skip("the CUDA engine only")
    prompts = _prompts(4, seed=4)
    params = [{"max_new_tokens": n, "temperature": 0.0} for n in (9, 4, 12)]
    params.append({"max_new_tokens": 10, **SAMPLED[2]})  # sampling on the device, no wait
    ref = _run(off, prompts, params)
    stop = ref[2][0][5]  # request 2 stops on a token it produces
    params[2] = {**params[2], "stop_token_ids": [stop]}
    free = _free(on)
    run_decode_without_host_waits(on, prompts, params)
    assert _free(on) == free
