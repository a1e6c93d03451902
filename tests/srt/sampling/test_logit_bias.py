"""logit_bias: checked on construction, added per row in one scatter-add, greedy follows it."""

from __future__ import annotations

import pytest
import torch

from srt.sampling.logit_bias import apply_logit_bias, check_logit_bias_vocab, parse_logit_bias
from srt.sampling.sampler import sample
from srt.sampling.sampling_params import SamplingParams


def test_parse_normalises_openai_json_keys():
    assert parse_logit_bias({"17": 5, 3: -2.5, "0": 100}) == ((0, 100.0), (3, -2.5), (17, 5.0))
    assert parse_logit_bias(None) is None and parse_logit_bias({}) is None
    # idempotent: what SamplingParams stores parses to itself
    p = SamplingParams.from_dict({"logit_bias": {"9": -100, "4": 1e-3}})
    assert p.logit_bias == ((4, 1e-3), (9, -100.0))
    assert SamplingParams(logit_bias=p.logit_bias) == p
    assert hash(p) == hash(SamplingParams(logit_bias={4: 1e-3, 9: -100}))


@pytest.mark.parametrize(
    "bias,match",
    [
        ({"a": 1}, "logit_bias keys must be token ids"),
        ({"1.5": 1}, "logit_bias keys must be token ids"),
        ({"-3": 1}, "negative token id"),
        ({True: 1}, "logit_bias keys must be token ids"),
        ({"5": 100.5}, r"logit_bias\['5'\] must be in \[-100, 100\]"),
        ({"5": -101}, r"logit_bias\['5'\] must be in \[-100, 100\]"),
        ({"5": float("nan")}, r"logit_bias\['5'\]"),
        ({"5": float("-inf")}, r"logit_bias\['5'\]"),
        ({"5": "1"}, r"logit_bias\['5'\] must be a number"),
        ({"5": None}, r"logit_bias\['5'\] must be a number"),
        ({"5": 1, 5: 2}, "names token 5 twice"),
        ([5, 1], "logit_bias must be a dict"),
        ("5:1", "logit_bias must be a dict"),
    ],
)
def test_bad_logit_bias_raises_naming_it(bias, match):
    with pytest.raises((ValueError, TypeError), match=match):
        SamplingParams.from_dict({"logit_bias": bias})


def test_vocab_check():
    check_logit_bias_vocab(((3, 1.0), (9, 2.0)), 10)
    check_logit_bias_vocab(None, 10)
    with pytest.raises(ValueError, match="token id 10 outside the vocabulary"):
        check_logit_bias_vocab(((3, 1.0), (10, 2.0)), 10)


def test_apply_adds_each_rows_bias_and_leaves_the_input_alone():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 11, generator=g)
    before = logits.clone()
    biases = [((2, 5.0), (7, -1.5)), None, ((0, 100.0),), ((10, -100.0), (2, 0.25))]
    out = apply_logit_bias(logits, biases)
    assert torch.equal(logits, before)
    want = before.clone()
    for i, pairs in enumerate(biases):
        for tok, b in pairs or ():
            want[i, tok] += b
    assert torch.equal(out, want)
    assert apply_logit_bias(logits, [None] * 4) is logits  # no bias: no copy, no work
    with pytest.raises(ValueError, match="need 4 logit_bias"):
        apply_logit_bias(logits, [None])
    with pytest.raises(ValueError, match="token id 11 outside"):
        apply_logit_bias(logits, [((11, 1.0),), None, None, None])


def test_bias_changes_the_greedy_choice_and_can_ban_it():
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(1))
    top = logits.argmax(-1)
    params = [SamplingParams(temperature=0.0)] * 3
    forced = apply_logit_bias(logits, [((5, 100.0),), ((int(top[1]), -100.0),), None])
    ids, _ = sample(forced, params, [None] * 3)
    assert int(ids[0]) == 5
    assert int(ids[1]) != int(top[1]) and int(ids[1]) == int(logits[1].topk(2).indices[1])
    assert int(ids[2]) == int(top[2])
