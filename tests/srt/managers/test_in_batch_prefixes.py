"""InBatchPrefixes (SGLang's in-batch prefix check): how much of a candidate's prompt a prompt
admitted in the same prefill batch shares, in whole blocks, hashed lazily on both sides."""

from __future__ import annotations

import random

import pytest

from srt.managers.req import Req
from srt.managers.schedule_policy import InBatchPrefixes
from srt.sampling.sampling_params import SamplingParams


def _req(ids: list[int], extra_key: str | None = None) -> Req:
    r = Req("r", list(ids), SamplingParams(max_new_tokens=1))
    r.extra_key = extra_key
    return r


def _shared(a: list[int], b: list[int], block: int, limit: int) -> int:
    """Whole blocks of b[:limit] equal to a's (the brute force)."""
    n = 0
    while n + block <= min(len(a), limit, len(b)) and a[n : n + block] == b[n : n + block]:
        n += block
    return n


@pytest.mark.parametrize("block", [1, 4, 32])
def test_shared_len_matches_the_brute_force(block):
    rng = random.Random(block)
    systems = [[rng.randrange(50) for _ in range(rng.randrange(0, 5 * block))] for _ in range(4)]
    prompts = [rng.choice(systems) + [rng.randrange(50) for _ in range(7)] for _ in range(30)]
    seen = InBatchPrefixes(block)
    added: list[list[int]] = []
    for p in prompts:  # candidates and additions interleaved: deep walks, then new prompts
        limit = len(p) - 1
        want = max((_shared(a, p, block, limit) for a in added), default=0)
        assert seen.shared_len(_req(p), limit) == want
        if rng.random() < 0.6:
            seen.add(_req(p))
            added.append(p)


def test_extra_keys_never_share():
    seen = InBatchPrefixes(4)
    ids = list(range(40))
    seen.add(_req(ids, "tenant-a"))
    assert seen.shared_len(_req(ids, "tenant-b"), 39) == 0
    assert seen.shared_len(_req(ids), 39) == 0
    assert seen.shared_len(_req(ids, "tenant-a"), 39) == 36
