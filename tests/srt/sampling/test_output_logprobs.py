"""Output-token logprobs: SGLang's distribution (penalised, biased, temperature-scaled)."""

from __future__ import annotations

import pytest
import torch

from srt.sampling.logprobs import output_logprobs
from srt.sampling.sampling_params import SamplingParams


def test_rows_that_ask_get_log_softmax_of_logits_over_their_temperature():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(5, 37, generator=g) * 4
    params = [
        SamplingParams(temperature=0.0),  # greedy: temperature 1
        SamplingParams(temperature=0.7, top_k=5, top_p=0.5),  # filters do not cut the logprob
        SamplingParams(temperature=1.3),
        SamplingParams(top_k=1, temperature=3.0),  # greedy through top_k 1
        SamplingParams(temperature=2.0),
    ]
    ids = torch.randint(0, 37, (5,), generator=g)
    tops = [3, 0, None, 37, 2]
    got = output_logprobs(logits, params, ids, tops)
    assert got[2] is None
    temps = [1.0, 0.7, 1.3, 1.0, 2.0]
    for i, (t, k) in enumerate(zip(temps, tops, strict=True)):
        if k is None:
            continue
        ref = torch.log_softmax(logits[i].double() / t, -1)
        assert got[i].logprob == pytest.approx(float(ref[ids[i]]), abs=1e-5)
        assert len(got[i].top) == k
        want = ref.topk(k) if k else None
        if k:
            assert [tok for _, tok in got[i].top] == want.indices.tolist()
            for (lp, _), w in zip(got[i].top, want.values.tolist(), strict=True):
                assert lp == pytest.approx(w, abs=1e-5)


def test_no_row_asks_no_work_and_argument_checks():
    logits = torch.randn(2, 5)
    ids = torch.zeros(2, dtype=torch.int64)
    p = [SamplingParams()] * 2
    assert output_logprobs(logits, p, ids, [None, None]) == [None, None]
    with pytest.raises(ValueError, match="need 2"):
        output_logprobs(logits, p, ids, [None])
