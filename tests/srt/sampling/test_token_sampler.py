"""The per-request seeded sampler (srt/sampling/sampler.py)."""

import os

import pytest
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


interp = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="the Triton kernel needs CUDA or TRITON_INTERPRET=1",
)
DEV = "cuda" if torch.cuda.is_available() else "cpu"


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gumbel_max_draws_from_the_softmax(dtype):
    """4000 rows of one launch (300 under the interpreter, ~20 ms a program), each the same
    logits at its own seed: the frequencies are softmax(logits / T) (float64) within 5
    standard errors (a wrong temperature or noise sign is off by far more)."""
    from srt.sampling.greedy import gumbel_max

    g = torch.Generator().manual_seed(7)
    logits = (torch.randn(2, 7, generator=g) * 2).to(DEV, dtype)
    if DEV == "cpu" and dtype != torch.float32:
        pytest.skip("one dtype under the interpreter")
    n = 4000 if DEV == "cuda" else 300
    rows = torch.ones(n, dtype=torch.int64, device=DEV)  # row 1 only
    temps = torch.full((n,), 0.7, device=DEV)
    seeds = torch.randint(0, 2**53, (n,), generator=g).to(DEV)
    ids = gumbel_max(logits, rows, temps, seeds).cpu()
    freq = torch.bincount(ids, minlength=7).double() / n
    want = torch.softmax(logits[1].double().cpu() / 0.7, -1)
    se = (want * (1 - want) / n).sqrt()
    assert ((freq - want).abs() <= 5 * se + 1e-3).all(), (freq, want)
    again = gumbel_max(logits, rows[:50], temps[:50], seeds[:50]).cpu()
    assert torch.equal(again, ids[:50])  # same seed and logits, same token, any launch


@interp
def test_seeded_rows_of_the_gumbel_path_do_not_depend_on_their_batch():
    """With seeds (the scheduler's path): a temperature-only row's token depends on its own
    logits, temperature and seed only; greedy rows beside it keep the argmax; a seed outside
    [0, 2**53) is refused."""
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(8)).to(DEV)
    mine = SamplingParams(temperature=1.2)
    cut = SamplingParams(temperature=0.9, top_k=20)
    for s in (1, 2**40, 2**53 - 1):
        alone = sample(logits[2:3], [mine], [None], seeds=[s])[0]
        params = [cut, SamplingParams(temperature=0.0), mine, SamplingParams(temperature=0.4)]
        gens = [torch.Generator(DEV).manual_seed(3), None, None, None]
        batch = sample(logits, params, gens, seeds=[5, 0, s, 9])[0]
        assert int(batch[2]) == int(alone[0])
        assert int(batch[1]) == int(logits[1].argmax())
    with pytest.raises(ValueError, match="seeds"):
        sample(logits[:1], [mine], [None], seeds=[2**53])


def test_step_seeds_differ_by_request_and_step():
    from srt.sampling.sampler import step_seed

    seeds = {step_seed(s, d) for s in range(50) for d in range(50)}
    assert len(seeds) == 2500 and all(0 <= x < 2**53 for x in seeds)
