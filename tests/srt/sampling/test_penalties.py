"""Frequency / presence / repetition penalties and min_new_tokens against a float64 reference."""

from __future__ import annotations

import torch

from srt.sampling.penalties import PenaltyInputs, apply_penalties
from srt.sampling.sampling_params import SamplingParams


def _reference(logits, inputs):
    out = logits.double().clone()
    for i, x in enumerate(inputs):
        p = x.params
        for t in set(x.prompt_ids) | set(x.output_ids):
            v = out[i, t]
            if p.repetition_penalty != 1.0:
                out[i, t] = v / p.repetition_penalty if v > 0 else v * p.repetition_penalty
        for t in set(x.output_ids):
            c = x.output_ids.count(t)
            out[i, t] -= p.frequency_penalty * c + p.presence_penalty
        if len(x.output_ids) < p.min_new_tokens:
            for t in x.banned_until_min:
                out[i, t] = -torch.inf
    return out


def test_penalties_match_reference():
    g = torch.Generator().manual_seed(3)
    B, V = 7, 33
    logits = torch.randn(B, V, generator=g) * 3
    rows = []
    for i in range(B):
        prompt = torch.randint(0, V, (1 + 4 * i,), generator=g).tolist()
        out = torch.randint(0, V, (i,), generator=g).tolist()
        params = SamplingParams(
            frequency_penalty=[0.0, 0.7, -1.1, 2.0, 0.0, 0.3, 0.0][i],
            presence_penalty=[0.0, 0.0, 0.5, -2.0, 0.0, 1.0, 0.0][i],
            repetition_penalty=[1.0, 1.0, 1.5, 0.6, 1.9, 1.0, 1.0][i],
            min_new_tokens=[0, 0, 0, 0, 0, 9, 3][i],
            max_new_tokens=16,
        )
        rows.append(PenaltyInputs(params, prompt, out, frozenset({1, 5, 32})))
    before = logits.clone()
    got = apply_penalties(logits, rows)
    assert torch.equal(logits, before)  # input untouched
    ref = _reference(logits, rows)
    finite = torch.isfinite(ref)
    assert torch.equal(finite, torch.isfinite(got))
    torch.testing.assert_close(got.double()[finite], ref[finite], rtol=1e-5, atol=1e-5)
    assert not torch.isfinite(got[5, [1, 5, 32]]).any()  # 5 tokens < min_new_tokens 9
    assert torch.isfinite(got[6]).all()  # row 6 already has 6 >= 3 tokens
    assert torch.equal(got[0], logits[0])  # no penalty: unchanged


def test_no_penalty_batch_is_untouched():
    logits = torch.randn(3, 17, generator=torch.Generator().manual_seed(1))
    rows = [PenaltyInputs(SamplingParams(), [1, 2], [3, 3]) for _ in range(3)]
    assert torch.equal(apply_penalties(logits, rows), logits)
