"""StreamAccumulator: the same cumulative and incremental views whatever the engine streams."""

from __future__ import annotations

import random

import pytest

from srt.entrypoints.stream_output import StreamAccumulator


def _engine_chunks(seed: int, cumulative: bool) -> tuple[list[dict], list[int], str]:
    """A random stream (steps of 0-3 ids, text held back at times, logprobs) in one mode."""
    rng = random.Random(seed)
    ids: list[int] = []
    lps: list[float] = []
    text = ""
    chunks = []
    for step in range(rng.randint(1, 9)):
        new = [rng.randrange(1000) for _ in range(rng.randint(0 if step else 1, 3))]
        new_text = "".join(rng.choice("ab \u00e9") for _ in range(rng.randint(0, 4)))
        new_lps = [-rng.random() for _ in new]
        ids, lps, text = ids + new, lps + new_lps, text + new_text
        meta = {"completion_tokens": len(ids), "finish_reason": None, "prompt_tokens": 3}
        t, i, lp = (text, ids, lps) if cumulative else (new_text, new, new_lps)
        chunk = {"text": t, "output_ids": list(i), "output_token_logprobs": list(lp)}
        meta["output_token_logprobs"] = [(x, y, None) for x, y in zip(lp, i, strict=True)]
        chunks.append({**chunk, "meta_info": meta})
    return chunks, ids, text


@pytest.mark.parametrize("seed", range(12))
def test_both_engine_modes_give_the_same_views(seed):
    views = []
    for cumulative in (True, False):
        chunks, ids, text = _engine_chunks(seed, cumulative)
        acc = StreamAccumulator()
        out = [acc.add(c) for c in chunks]
        whole, new = [o[0] for o in out], [o[1] for o in out]
        assert whole[-1]["text"] == text and whole[-1]["output_ids"] == ids
        assert "".join(n["text"] for n in new) == text
        assert [t for n in new for t in n["output_ids"]] == ids
        for w in whole:
            assert len(w["output_ids"]) == len(w["output_token_logprobs"])
            meta = w["meta_info"]
            assert len(meta["output_token_logprobs"]) == meta["completion_tokens"]
        views.append((whole, new))
    assert views[0] == views[1]


def test_input_chunk_is_not_modified():
    chunk = {"text": "ab", "output_ids": [1, 2], "meta_info": {"completion_tokens": 2}}
    acc = StreamAccumulator()
    acc.add(chunk)
    second = {"text": "c", "output_ids": [3], "meta_info": {"completion_tokens": 3}}
    whole, new = acc.add(second)
    assert second == {"text": "c", "output_ids": [3], "meta_info": {"completion_tokens": 3}}
    assert whole["text"] == "abc" and whole["output_ids"] == [1, 2, 3] and new["text"] == "c"
