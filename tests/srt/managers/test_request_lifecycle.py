"""Req stop conditions (stop strings, min_new_tokens) and Scheduler.abort (one request)."""

from __future__ import annotations

import pytest

import srt
from srt.managers.schedule_batch import Req
from srt.sampling.sampling_params import SamplingParams
from tests.srt.model_executor.runner_fakes import patch_builder


def _decode(ids):
    return "".join(chr(ord("a") + t % 26) for t in ids)


def _req(**params):
    return Req("r", [1, 2], SamplingParams(**params), eos_token_ids=frozenset({0}), decode=_decode)


def test_stop_string_spanning_tokens_and_min_new_tokens():
    req = _req(max_new_tokens=10, stop=("cde",))
    for t in (1, 2, 3):  # b c d
        req.output_ids.append(t)
        req.check_finished()
        assert not req.finished
    req.output_ids.append(4)  # e: "cde" completes across three tokens
    req.check_finished()
    assert req.finished_reason == {"type": "stop", "matched": "cde"}
    held = _req(max_new_tokens=10, min_new_tokens=3)
    held.output_ids.append(0)  # EOS before min_new_tokens does not stop
    held.check_finished()
    assert not held.finished
    held.output_ids += [5, 0]
    held.check_finished()
    assert held.finished_reason == {"type": "stop", "matched": 0}
    no_decode = Req("r", [1], SamplingParams(stop=("b",), max_new_tokens=3))
    no_decode.output_ids.append(1)
    no_decode.check_finished()
    assert not no_decode.finished


@pytest.fixture
def engine(monkeypatch):
    patch_builder(monkeypatch)
    return srt.Engine(device="cpu", skip_tokenizer_init=True, max_total_tokens=64)


def test_abort_one_running_or_waiting_request_frees_it(engine):
    sched = engine.scheduler
    rows = engine.model_runner.req_to_token_pool
    start = (sched.available_kv_size(), rows.available_size())
    sp = {"temperature": 0.0, "max_new_tokens": 20, "ignore_eos": True}
    batch = engine.make_requests(input_ids=[[1, 2, 3], [4] * 7, [5] * 40], sampling_params=sp)
    a, b, c = batch.items
    for r in batch.items:
        sched.add_request(r)
    sched.step()  # a and b prefilled; c waits (the pool cannot hold all three futures)
    assert a in sched.running and b in sched.running and c in sched.waiting
    assert sched.abort(c.rid) is c and c.finished_reason == {"type": "abort"}
    assert sched.abort(a.rid) is a and a.req_pool_idx is None
    assert sched.abort("nope") is None
    sched.run_until_idle()
    assert len(b.output_ids) == 20 and not a.output_ids[1:] and not c.output_ids
    assert (sched.available_kv_size(), rows.available_size()) == start
