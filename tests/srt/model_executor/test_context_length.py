"""A context longer than the model's rope table is served exactly, or refused at construction.

Issue 21, item 7: `context_length=4096` on the tiny Llama (2048-row rope table) ran a
2100-token prompt with clamped positions. Now the table grows at construction (same formula),
so the logits equal those of a model built with a 4096-row table.
"""

from __future__ import annotations

import json

import pytest
import torch

import srt
from srt.layers.rotary_embedding import RotaryEmbedding, factory
from srt.managers.schedule_batch import Req, ScheduleBatch
from srt.sampling.sampling_params import SamplingParams

CTX, TABLE, PROMPT = 4096, 2048, 2100


@pytest.fixture(autouse=True)
def private_rope_instances(monkeypatch):
    """get_rope shares instances process-wide: keep the grown ones to this test."""
    monkeypatch.setattr(factory, "_ROPE_DICT", {})


def _engine(**kw) -> srt.Engine:
    return srt.Engine(
        device="cpu", max_total_tokens=CTX, context_length=CTX, skip_tokenizer_init=True, **kw
    )


def _rope_rows(eng: srt.Engine) -> set[int]:
    ropes = [m for m in eng.model_runner.model.modules() if isinstance(m, RotaryEmbedding)]
    assert ropes, "the tiny model has no rope layer?"
    return {r.cos_sin_cache.shape[0] for r in ropes}


def _prefill_logits(eng: srt.Engine, prompt: list[int]) -> torch.Tensor:
    runner = eng.model_runner
    sb = ScheduleBatch.from_runner(runner)
    req = Req(0, prompt, SamplingParams(max_new_tokens=1))
    try:
        return runner.forward(sb.prepare_for_extend([req])).double()  # [1, V]
    finally:
        sb.free_req(req)


def test_context_beyond_rope_table_matches_a_bigger_table():
    short = _engine()
    assert short.model_runner.model_config.max_position_embeddings == TABLE
    assert _rope_rows(short) == {CTX}  # grown at construction
    big = _engine(json_model_override_args=json.dumps({"max_position_embeddings": CTX}))
    assert _rope_rows(big) == {CTX}
    sd_s, sd_b = short.model_runner.model.state_dict(), big.model_runner.model.state_dict()
    assert sd_s.keys() == sd_b.keys()
    assert all(torch.equal(sd_s[k], sd_b[k]) for k in sd_s), "dummy weights differ"

    g = torch.Generator().manual_seed(21)
    prompt = torch.randint(3, 1000, (PROMPT,), generator=g).tolist()
    got, want = _prefill_logits(short, prompt), _prefill_logits(big, prompt)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    sp = {"max_new_tokens": 3, "temperature": 0.0, "ignore_eos": True}
    out_s = short.generate(input_ids=prompt, sampling_params=sp, return_logprob=True)
    out_b = big.generate(input_ids=prompt, sampling_params=sp, return_logprob=True)
    assert out_s["output_ids"] == out_b["output_ids"]
    torch.testing.assert_close(
        torch.tensor(out_s["output_token_logprobs"]),
        torch.tensor(out_b["output_token_logprobs"]),
        rtol=1e-5,
        atol=1e-5,
    )


def test_context_beyond_a_table_that_cannot_grow_is_refused(monkeypatch):
    monkeypatch.setattr(RotaryEmbedding, "_can_grow", lambda self: False)
    with pytest.raises(ValueError, match=rf"context length {CTX} .*{TABLE}-row rope table"):
        _engine()
    ok = srt.Engine(
        device="cpu", max_total_tokens=256, context_length=TABLE, skip_tokenizer_init=True
    )
    assert _rope_rows(ok) == {TABLE}
