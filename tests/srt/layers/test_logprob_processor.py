"""Token logprobs, top-k lists and the prompt rows they score, against float64 log_softmax."""

from __future__ import annotations

import pytest
import torch

from srt.layers import logprob_processor as lpp
from srt.layers.logprob_processor import input_logprob_rows, input_token_logprobs, token_logprobs


def _close(got: torch.Tensor, ref: torch.Tensor) -> None:
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)  # float32 math


def _logits(n: int, v: int, seed: int) -> torch.Tensor:
    return torch.randn(n, v, generator=torch.Generator().manual_seed(seed)) * 3


@pytest.mark.parametrize("n,v,k", [(1, 7, 0), (5, 33, 3), (9, 129, 129), (3, 17, 40)])
def test_token_logprobs_match_float64_log_softmax(n, v, k):
    logits = _logits(n, v, seed=n * v)
    ids = torch.randint(0, v, (n,), generator=torch.Generator().manual_seed(k))
    got = token_logprobs(logits, ids, k)
    ref = torch.log_softmax(logits.double(), -1)  # [n, v]
    _close(got.token_logprobs, ref.gather(1, ids[:, None])[:, 0])
    if k == 0:
        assert got.top_logprobs_val is None and got.top_logprobs_idx is None
        return
    kk = min(k, v)
    assert got.top_logprobs_val.shape == (n, kk) and got.top_logprobs_idx.shape == (n, kk)
    # descending, and each value is the logprob of its own id
    assert bool((got.top_logprobs_val[:, 1:] <= got.top_logprobs_val[:, :-1]).all())
    _close(got.top_logprobs_val, ref.gather(1, got.top_logprobs_idx))
    ref_top = ref.topk(kk, dim=-1)
    assert torch.equal(got.top_logprobs_idx, ref_top.indices)  # randn: no ties


def test_greedy_token_logprob_equals_its_top1_bit_for_bit():
    logits = _logits(6, 50, seed=3)
    got = token_logprobs(logits, logits.argmax(-1), 2)
    assert torch.equal(got.token_logprobs, got.top_logprobs_val[:, 0])


def test_masked_token_is_clamped_not_minus_inf():
    logits = _logits(2, 9, seed=4)
    logits[:, 3] = float("-inf")
    got = token_logprobs(logits, torch.tensor([3, 3]), 9)
    low = torch.finfo(torch.float32).min
    assert bool((got.token_logprobs == low).all())
    assert bool(torch.isfinite(got.top_logprobs_val).all())


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="token_ids"):
        token_logprobs(torch.zeros(3, 5), torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="top_k"):
        token_logprobs(torch.zeros(3, 5), torch.zeros(3, dtype=torch.int64), -1)
    with pytest.raises(ValueError, match="outside"):
        input_logprob_rows([3, 4], [0, 5])
    with pytest.raises(ValueError, match="start lens"):
        input_logprob_rows([3, 4], [0])


def test_input_logprob_rows_follow_sglang_positions():
    # request 0: 5 tokens from 0 -> rows 0..3; request 1: 1 token -> none; request 2: 4 tokens
    # from 2 -> rows 6 + 2 .. 6 + 2 (token 3 scored by position 2); request 3 from its end: none
    rows, counts = input_logprob_rows([5, 1, 4, 3], [0, 0, 2, 3])
    assert rows == [0, 1, 2, 3, 8]
    assert counts == [4, 0, 1, 0]


@pytest.mark.parametrize("chunk", [1, 2, 5, 1 << 26])
def test_chunked_input_logprobs_equal_one_pass(monkeypatch, chunk):
    """Prompt rows projected in chunks give the same rows as one projection of everything."""
    T, H, V = 23, 8, 13
    g = torch.Generator().manual_seed(7)
    hidden = torch.randn(T, H, generator=g)
    weight = torch.randn(V, H, generator=g)
    ids = torch.randint(0, V, (T,), generator=g)
    rows, _ = input_logprob_rows([9, 3, 11], [0, 1, 4])
    monkeypatch.setattr(lpp, "CHUNK_ELEMENTS", chunk * V)
    calls = []

    def project(h):
        calls.append(h.shape[0])
        return h @ weight.t()

    got = input_token_logprobs(hidden, ids, rows, project, V, top_k=4)
    assert max(calls) <= chunk and sum(calls) == len(rows)
    full = torch.log_softmax((hidden @ weight.t()).double(), -1)  # [T, V]
    r = torch.tensor(rows)
    _close(got.token_logprobs, full[r, ids[r + 1]])
    _close(got.top_logprobs_val, full[r].topk(4, -1).values)
    empty = input_token_logprobs(hidden, ids, [], project, V, top_k=4)
    assert empty.token_logprobs.shape == (0,) and empty.top_logprobs_idx.shape == (0, 4)
