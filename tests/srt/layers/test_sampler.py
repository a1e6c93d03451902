"""Sampler: greedy, temperature, top-k, top-p; seeded reproducibility; parameter checks."""

import pytest
import torch

from srt.layers.sampler import Sampler, SamplingBatchInfo, top_k_top_p_mask


def test_greedy_and_logprobs():
    logits = torch.randn(5, 33)
    info = SamplingBatchInfo.from_params([{"temperature": 0.0}] * 5)
    assert info.is_all_greedy
    ids, lp = Sampler()(logits, info, return_logprob=True)
    assert torch.equal(ids, logits.argmax(-1))
    torch.testing.assert_close(lp, torch.log_softmax(logits, -1).gather(-1, ids[:, None])[:, 0])


def test_seeded_sampling_is_reproducible_and_mixes_greedy_rows():
    logits = torch.randn(4, 50)
    params = [{"temperature": 1.0}, {"temperature": 0.0}, {"temperature": 0.7}, {}]
    a = Sampler()(logits, SamplingBatchInfo.from_params(params, seed=3))
    b = Sampler()(logits, SamplingBatchInfo.from_params(params, seed=3))
    assert torch.equal(a, b)
    assert a[1] == logits[1].argmax()
    draws = torch.stack([Sampler()(logits, SamplingBatchInfo.from_params(params, seed=s))
                         for s in range(20)])  # fmt: skip
    assert draws[:, 0].unique().numel() > 1  # actually random


def test_top_k_and_top_p_restrict_support():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]] * 2)
    info = SamplingBatchInfo.from_params([{"top_k": 2}, {"top_p": 0.7}], seed=0)
    probs = top_k_top_p_mask(torch.softmax(logits, -1), info.top_ks, info.top_ps)
    assert (probs[0, 2:] == 0).all() and probs[0, :2].sum().item() == pytest.approx(1.0)
    p = torch.softmax(logits[1], -1)  # 0.64, 0.24, ...: the first two reach 0.7
    assert (probs[1, 2:] == 0).all() and probs[1, 1] > 0
    torch.testing.assert_close(probs[1, :2], p[:2] / p[:2].sum())
    seen = set()
    for s in range(30):
        ids = Sampler()(logits, SamplingBatchInfo.from_params([{"top_k": 2}, {"top_p": 0.7}],
                                                              seed=s))  # fmt: skip
        seen.update(ids.tolist())
    assert seen <= {0, 1}


def test_bad_params():
    with pytest.raises(ValueError, match="temperature"):
        SamplingBatchInfo.from_params([{"temperature": -1}])
    with pytest.raises(ValueError, match="top_p"):
        SamplingBatchInfo.from_params([{"top_p": 0.0}])
