"""The per-request seeded sampler (srt/sampling/sampler.py)."""

import torch

from srt.sampling.sampler import sample
from srt.sampling.sampling_params import SamplingParams


def _gens(n, seed=0):
    return [torch.Generator().manual_seed(seed + i) for i in range(n)]


def test_greedy_and_degenerate_filters_pick_argmax():
    logits = torch.randn(7, 33, generator=torch.Generator().manual_seed(1))
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(top_k=1, temperature=2.0),
        SamplingParams(top_p=1e-6, temperature=1.5),
        SamplingParams(min_p=1.0),
    ] * 2
    params = params[:7]
    ids, lp = sample(logits, params, _gens(7), return_logprob=True)
    assert torch.equal(ids, logits.argmax(-1))
    ref = torch.log_softmax(logits.double(), -1).gather(1, ids[:, None]).squeeze(1)
    torch.testing.assert_close(lp.double(), ref, rtol=0, atol=1e-5)


def test_top_k_restricts_support_and_seed_reproduces():
    logits = torch.randn(1, 33, generator=torch.Generator().manual_seed(2))
    top3 = set(logits[0].topk(3).indices.tolist())
    p = SamplingParams(top_k=3, temperature=5.0)
    seen = set()
    for s in range(200):
        ids, _ = sample(logits, [p], _gens(1, s))
        seen.add(int(ids[0]))
    assert seen <= top3 and len(seen) == 3
    a = [int(sample(logits, [p], _gens(1, 5))[0][0]) for _ in range(3)]
    assert len(set(a)) == 1


def test_temperature_only_rows_draw_from_the_softmax():
    """No filter: the whole distribution at the row's temperature (empirical frequencies of
    3000 seeded draws within 5 standard errors of softmax(logits / T), float64)."""
    logits = torch.randn(1, 7, generator=torch.Generator().manual_seed(3)) * 2
    p = SamplingParams(temperature=0.7)
    n = 3000
    counts = torch.zeros(7, dtype=torch.float64)
    for s in range(n):
        counts[int(sample(logits, [p], _gens(1, s))[0][0])] += 1
    want = torch.softmax(logits[0].double() / 0.7, -1)
    se = (want * (1 - want) / n).sqrt()
    assert ((counts / n - want).abs() <= 5 * se + 1e-3).all(), (counts / n, want)


def test_a_seeded_row_draws_the_same_whatever_its_batch():
    """Same seed, same token: alone, or beside greedy, filtered and other temperature-only
    rows (each row's path depends on its own settings only)."""
    logits = torch.randn(4, 257, generator=torch.Generator().manual_seed(4))
    mine = SamplingParams(temperature=1.1)
    cut = SamplingParams(temperature=0.9, top_p=0.8)
    for s in range(20):
        alone = sample(logits[2:3], [mine], _gens(1, s))[0]
        params = [cut, SamplingParams(temperature=0.0), mine, SamplingParams(temperature=0.5)]
        gens = _gens(4, 100 + s)
        gens[2] = _gens(1, s)[0]
        batch = sample(logits, params, gens)[0]
        assert int(batch[2]) == int(alone[0])
        assert int(batch[1]) == int(logits[1].argmax())
