"""srt.bench_serving's datasets and arrival schedule: lengths, the range ratio, the shared
prefix really shared per group (and only there), seeds, warm-up rows."""

from __future__ import annotations

import math

import numpy as np
import pytest

from srt.bench_serving.datasets import (
    ROLE_DECODER,
    ROLE_LONG,
    random_lens,
    sample_generated_shared_prefix,
    sample_long_prompt_arrival,
    sample_random_requests,
    warmup_rows,
)
from srt.bench_serving.runner import arrival_offsets

VOCAB = 997  # odd on purpose


@pytest.mark.parametrize("ratio", [0.0, 0.25, 0.5, 1.0])
def test_random_lengths_follow_the_range_ratio(ratio):
    seed = int(np.random.default_rng().integers(1 << 30))
    rows = sample_random_requests(300, 37, 11, ratio, VOCAB, seed)
    assert len(rows) == 300
    ins = [r.prompt_len for r in rows]
    outs = [r.output_len for r in rows]
    assert min(ins) >= max(int(37 * ratio), 1) and max(ins) <= 37
    assert min(outs) >= max(int(11 * ratio), 1) and max(outs) <= 11
    if ratio == 1.0:
        assert set(ins) == {37} and set(outs) == {11}
    else:  # 300 draws cover both ends of the range
        assert min(ins) == max(int(37 * ratio), 1) and max(ins) == 37
    ids = [t for r in rows for t in r.prompt]
    assert min(ids) >= 0 and max(ids) < VOCAB
    assert all(r.group == -1 and r.arrival_s is None for r in rows)


def test_random_seeds():
    a = sample_random_requests(20, 64, 8, 0.5, VOCAB, seed=3)
    assert a == sample_random_requests(20, 64, 8, 0.5, VOCAB, seed=3)
    assert a != sample_random_requests(20, 64, 8, 0.5, VOCAB, seed=4)
    state = np.random.get_state()[1].copy()
    sample_random_requests(5, 8, 8, 0.0, VOCAB, seed=1)
    assert (np.random.get_state()[1] == state).all()  # no global random state touched


def test_random_lens_rule():
    rng = np.random.default_rng(0)
    assert random_lens(1, 0.0, 5, rng) == [1] * 5
    assert set(random_lens(10, 0.95, 50, rng)) == {9, 10}  # int(9.5) = 9
    with pytest.raises(ValueError, match="range_ratio"):
        random_lens(10, 1.5, 1, rng)
    with pytest.raises(ValueError, match="full_len"):
        random_lens(0, 0.5, 1, rng)


def test_bad_arguments_name_themselves():
    with pytest.raises(ValueError, match="num_prompts"):
        sample_random_requests(0, 8, 8, 0.0, VOCAB, 0)
    with pytest.raises(ValueError, match="question_len"):
        sample_generated_shared_prefix(2, 2, 8, 0, 4, VOCAB, 0)
    with pytest.raises(ValueError, match="delay_s"):
        sample_long_prompt_arrival(2, 8, 8, 64, 2, -1.0, VOCAB, 0)


def test_shared_prefix_is_shared_per_group_only():
    groups, per, sys_len, q_len, out_len = 5, 7, 41, 9, 13
    rows = sample_generated_shared_prefix(groups, per, sys_len, q_len, out_len, VOCAB, seed=11)
    assert len(rows) == groups * per
    assert all(r.prompt_len == sys_len + q_len and r.output_len == out_len for r in rows)
    by_group: dict[int, list] = {}
    for r in rows:
        by_group.setdefault(r.group, []).append(r)
    assert sorted(by_group) == list(range(groups))
    systems = []
    for members in by_group.values():
        assert len(members) == per
        system = members[0].prompt[:sys_len]
        assert all(m.prompt[:sys_len] == system for m in members)  # identical ids
        assert len({m.prompt[sys_len:] for m in members}) == per  # own questions
        systems.append(system)
    assert len(set(systems)) == groups  # groups share nothing
    # shuffled: not group-major, same rows as the ordered list
    ordered = sample_generated_shared_prefix(
        groups, per, sys_len, q_len, out_len, VOCAB, seed=11, shuffle=False
    )
    assert [r.group for r in ordered] == sorted(r.group for r in ordered)
    assert [r.group for r in rows] != [r.group for r in ordered]
    assert sorted(rows, key=lambda r: r.prompt) == sorted(ordered, key=lambda r: r.prompt)
    again = sample_generated_shared_prefix(groups, per, sys_len, q_len, out_len, VOCAB, seed=11)
    assert again == rows
    other = sample_generated_shared_prefix(groups, per, sys_len, q_len, out_len, VOCAB, seed=12)
    assert other != rows


def test_long_prompt_arrival_rows():
    rows = sample_long_prompt_arrival(6, 17, 33, 1000, 3, 0.7, VOCAB, seed=2)
    decoders = [r for r in rows if r.role == ROLE_DECODER]
    long = [r for r in rows if r.role == ROLE_LONG]
    assert len(decoders) == 6 and len(long) == 1
    assert all(d.prompt_len == 17 and d.output_len == 33 and d.arrival_s == 0.0 for d in decoders)
    assert long[0].prompt_len == 1000 and long[0].output_len == 3 and long[0].arrival_s == 0.7


def test_warmup_rows_are_fresh_and_cover_the_longest():
    rows = sample_random_requests(10, 50, 20, 0.0, VOCAB, seed=5)
    warm = warmup_rows(rows, 2, VOCAB, seed=5)
    longest = max(r.prompt_len for r in rows)
    assert [w.prompt_len for w in warm[:2]] == [r.prompt_len for r in rows[:2]]
    assert max(w.prompt_len for w in warm) == longest
    assert all(w.output_len <= 4 for w in warm)
    prompts = {r.prompt for r in rows}
    assert not any(w.prompt in prompts for w in warm)
    assert warmup_rows(rows, 0, VOCAB, 5) == []


def test_arrival_offsets():
    rows = sample_random_requests(4000, 4, 2, 0.0, VOCAB, seed=0)
    assert set(arrival_offsets(rows, math.inf, 0)) == {0.0}
    offs = arrival_offsets(rows, 50.0, seed=9)
    assert offs == arrival_offsets(rows, 50.0, seed=9)
    assert offs[0] == 0.0 and all(b >= a for a, b in zip(offs[:-1], offs[1:], strict=True))
    gaps = np.diff(offs)
    assert abs(gaps.mean() - 1 / 50) < 0.1 / 50  # exponential gaps of mean 1 / rate
    assert abs(np.median(gaps) - math.log(2) / 50) < 0.15 / 50
    lpa = sample_long_prompt_arrival(3, 4, 4, 8, 1, 0.25, VOCAB, 0)
    assert arrival_offsets(lpa, 10.0, 0) == [0.0, 0.0, 0.0, 0.25]  # fixed times kept
    with pytest.raises(ValueError, match="request_rate"):
        arrival_offsets(rows, 0.0, 0)
