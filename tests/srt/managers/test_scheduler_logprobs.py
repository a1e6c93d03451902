"""The scheduler's logprob steps on the stand-in model (which returns [T, V] logits itself)."""

from __future__ import annotations

import random

import pytest

import srt
from srt.managers import scheduler_logprobs
from tests.srt.model_executor.runner_fakes import FakeConfig, patch_builder

V = FakeConfig.vocab_size
GREEDY = {"temperature": 0.0, "ignore_eos": True}


@pytest.fixture
def engine(monkeypatch):
    patch_builder(monkeypatch)
    eng = srt.Engine(device="cpu", skip_tokenizer_init=True, max_total_tokens=512)
    yield eng
    eng.shutdown()


def test_prompt_logprobs_equal_next_token_logprobs_of_each_prefix(engine):
    """Token p's input logprob (scored inside one prefill) is the logprob the model gives it
    as the next token of prompt[:p] (a separate request's output top list over the vocab)."""
    rng = random.Random(0)
    prompt = [rng.randrange(V) for _ in range(11)]
    out = engine.generate(
        input_ids=prompt,
        sampling_params=dict(GREEDY, max_new_tokens=1),
        return_logprob=True,
        logprob_start_len=2,
        top_logprobs_num=3,
    )
    inp = out["meta_info"]["input_token_logprobs"]
    assert [t for _, t, _ in inp] == prompt[2:] and inp[0][0] is None
    prefixes = [prompt[:p] for p in range(3, 11)]
    alone = engine.generate(
        input_ids=prefixes,
        sampling_params=dict(GREEDY, max_new_tokens=1),
        return_logprob=True,
        top_logprobs_num=V,
    )
    for j, (p, a) in enumerate(zip(range(3, 11), alone, strict=True)):
        row = {tok: lp for lp, tok, _ in a["meta_info"]["output_top_logprobs"][0]}
        assert len(row) == V
        assert inp[j + 1][0] == pytest.approx(row[prompt[p]], abs=1e-5)
        top = out["meta_info"]["input_top_logprobs"][j + 1]
        assert [lp for lp, _, _ in top] == pytest.approx(sorted(row.values())[::-1][:3], abs=1e-5)


def test_no_logprobs_no_extra_work(engine, monkeypatch):
    """Without logprobs or logit_bias the prefill is runner.forward and decode overlaps."""
    calls = []
    real = engine.model_runner.forward_with_input_logprobs
    monkeypatch.setattr(
        engine.model_runner,
        "forward_with_input_logprobs",
        lambda fb: calls.append(fb) or real(fb),
    )
    before = engine.scheduler.num_overlapped_steps
    engine.generate(input_ids=[[1, 2, 3], [4, 5]], sampling_params=dict(GREEDY, max_new_tokens=4))
    assert not calls and engine.scheduler.num_overlapped_steps > before
    # output logprobs only (the default start): still the plain prefill
    lp = dict(input_ids=[1, 2, 3], sampling_params=dict(GREEDY, max_new_tokens=2))
    engine.generate(**lp, return_logprob=True)
    assert not calls
    engine.generate(**lp, return_logprob=True, logprob_start_len=0)
    assert len(calls) == 1 and calls[0].extend_logprob_start_lens_cpu == [0]


def test_bias_keeps_requests_out_of_the_overlapped_decode(engine):
    sp = dict(GREEDY, max_new_tokens=5, logit_bias={"7": 100})
    before = engine.scheduler.num_overlapped_steps
    out = engine.generate(input_ids=[3, 4, 5], sampling_params=sp)
    assert out["output_ids"] == [7] * 5
    assert engine.scheduler.num_overlapped_steps == before
    req = engine.make_requests(
        input_ids=[3, 4], sampling_params={"max_new_tokens": 1}, return_logprob=True
    ).items[0]
    assert req.logprob_start_len == 2 and not scheduler_logprobs.wants_input_logprobs(req)
