"""SamplingParams: SGLang's names, aliases and validation before anything runs (issue 21 #8)."""

from __future__ import annotations

import math

import pytest

from srt.sampling.sampling_params import SamplingParams


@pytest.mark.parametrize("name", ["temperature", "top_p", "min_p", "frequency_penalty"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_floats_are_rejected(name, value):
    with pytest.raises(ValueError, match=f"{name} must be finite"):
        SamplingParams.from_dict({name: value})


@pytest.mark.parametrize("name", ["presence_penalty", "repetition_penalty"])
def test_non_finite_penalties_are_rejected(name):
    with pytest.raises(ValueError, match=name):
        SamplingParams.from_dict({name: math.nan})


@pytest.mark.parametrize(
    "value, exc", [(2.5, ValueError), ("0.5", TypeError), (True, TypeError), (math.nan, ValueError)]
)
def test_top_k_must_be_an_integer(value, exc):
    with pytest.raises(exc, match="top_k"):
        SamplingParams.from_dict({"top_k": value})
    with pytest.raises(exc, match="top_k"):
        SamplingParams(top_k=value)


def test_integral_float_top_k_and_strings_for_floats():
    assert SamplingParams.from_dict({"top_k": 3.0}).top_k == 3
    with pytest.raises(TypeError, match="temperature must be a number"):
        SamplingParams.from_dict({"temperature": "0.5"})


@pytest.mark.parametrize(
    "params, match",
    [
        ({"frequency_penalty": 2.5}, "frequency_penalty must be in"),
        ({"presence_penalty": -2.01}, "presence_penalty must be in"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be in"),
        ({"repetition_penalty": 2.1}, "repetition_penalty must be in"),
        ({"n": 0}, "n must be in"),
        ({"min_new_tokens": 5, "max_new_tokens": 4}, "min_new_tokens"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop_token_ids": [1.5]}, "stop_token_ids"),
        ({"sampling_seed": 1.5}, "sampling_seed"),
        ({"seed": 1, "sampling_seed": 2}, "differ"),
        ({"max_tokens": 3}, "unknown keys"),
        ({"skip_special_tokens": "yes"}, "skip_special_tokens"),
    ],
)
def test_out_of_range_values_are_rejected(params, match):
    with pytest.raises((ValueError, TypeError), match=match):
        SamplingParams.from_dict(params)


def test_sglang_names_and_the_seed_alias():
    p = SamplingParams.from_dict(
        {
            "stop": "###",
            "stop_token_ids": 7,
            "n": 3,
            "min_new_tokens": 2,
            "frequency_penalty": 0.5,
            "presence_penalty": -0.5,
            "repetition_penalty": 1.3,
            "skip_special_tokens": False,
            "no_stop_trim": True,
            "seed": 11,
            "top_p": None,  # None means the default
        }
    )
    assert p.stop == ("###",) and p.stop_token_ids == (7,) and p.n == 3
    assert p.sampling_seed == 11 and p.seed == 11 and p.top_p == 1.0
    assert p.has_penalties and not SamplingParams().has_penalties
    assert SamplingParams.from_dict({"sampling_seed": 4, "seed": 4}).sampling_seed == 4


FLOAT32_TINY = 1.1754943508222875e-38  # float32's smallest normal


@pytest.mark.parametrize(
    "params, match",
    [
        ({"temperature": 1e39}, "temperature=1e\\+39 overflows float32"),
        ({"repetition_penalty": 1e-300}, "repetition_penalty=1e-300 underflows float32"),
        ({"repetition_penalty": FLOAT32_TINY / 2}, "repetition_penalty=.* underflows"),
        ({"frequency_penalty": 1e-310}, "frequency_penalty=.* underflows float32"),
        ({"presence_penalty": -1e-45}, "presence_penalty=.* underflows float32"),
        ({"top_p": 1e-300}, "top_p=1e-300 underflows float32"),
        ({"min_p": 1e-40}, "min_p=1e-40 underflows float32"),
        ({"top_k": 2**31}, "top_k must be -1 .* 2147483647"),
        ({"sampling_seed": 2**64}, "sampling_seed must be in \\[-2\\*\\*63, 2\\*\\*63 - 1\\]"),
        ({"seed": -(2**63) - 1}, "sampling_seed must be in"),
        ({"sampling_seed": 2**63 - 2, "n": 3}, "sampling_seed \\+ n - 1"),
        ({"n": 129}, "n must be in \\[1, 128\\]"),
        ({"stop": 5}, "stop must be a string or a list of strings, got int"),
        ({"stop": {"a": 1}}, "stop must be a string or a list of strings, got dict"),
        ({"stop": ["a", 3]}, "stop must be a string or a list of non-empty strings"),
        ({"stop_token_ids": {"a": 1}}, "stop_token_ids must be an int or a list of ints, got dict"),
        ({"stop_token_ids": [-1]}, "stop_token_ids must be >= 0"),
    ],
)
def test_values_float32_or_the_sampler_cannot_hold_are_rejected(params, match):
    """Issue 50: these reached the forward step (or the generator) and failed it for everyone."""
    with pytest.raises((ValueError, TypeError), match=match):
        SamplingParams.from_dict(params)


def test_stop_must_not_be_a_bare_string_or_dict_when_built_directly():
    with pytest.raises(TypeError, match="stop must be a tuple"):
        SamplingParams(stop="abc")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="stop_token_ids must be a tuple"):
        SamplingParams(stop_token_ids={1: 2})  # type: ignore[arg-type]


def test_edges_that_stay_legal():
    assert SamplingParams.from_dict({"sampling_seed": 2**63 - 1}).sampling_seed == 2**63 - 1
    assert SamplingParams.from_dict({"seed": -(2**63)}).sampling_seed == -(2**63)
    assert SamplingParams(n=128).n == 128
    assert SamplingParams(repetition_penalty=FLOAT32_TINY).repetition_penalty == FLOAT32_TINY
    assert SamplingParams(frequency_penalty=0.0, top_k=2**31 - 1).top_k == 2**31 - 1
    assert SamplingParams(temperature=3e38).temperature == 3e38


@pytest.mark.parametrize("t", [1e-39, 1e-7, 0.0])
def test_temperature_below_sglang_eps_is_greedy(t):
    """SGLang treats 0 <= temperature < 1e-6 as greedy: a tiny temperature never divides."""
    assert SamplingParams(temperature=t).is_greedy
    assert not SamplingParams(temperature=1e-6).is_greedy
