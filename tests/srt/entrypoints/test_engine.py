"""srt.Engine with the embedded tiny Llama (random seeded weights) on CPU."""

from __future__ import annotations

import os

import pytest

import srt

pytest.importorskip("srt.layers.rotary_embedding", reason="needs the layers branch")

PROMPTS = ["Hello world", "The capital of France is", "a", "1 2 3 4 5 6 7 8 9 10 11 12 13"]
GREEDY = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine():
    eng = srt.Engine(device="cpu", max_total_tokens=1024)
    yield eng
    eng.shutdown()


def test_lazy_export():
    from srt.entrypoints.engine import Engine

    assert srt.Engine is Engine
    with pytest.raises(AttributeError):
        srt.NotAThing  # noqa: B018


def test_fused_and_unfused_give_same_tokens(engine):
    ids = [engine.tokenizer.encode(p) for p in PROMPTS] if engine.tokenizer else None
    kw = {"prompt": PROMPTS} if ids else {"input_ids": [[5, 6, 7], [9] * 20, [3], [11, 12]]}
    fused = engine.generate(sampling_params=GREEDY, **kw)
    unfused_eng = srt.Engine(device="cpu", max_total_tokens=1024, enable_fused_rope_kv=False)
    unfused = unfused_eng.generate(sampling_params=GREEDY, **kw)
    assert [o["output_ids"] for o in fused] == [o["output_ids"] for o in unfused]
    assert all(len(o["output_ids"]) == 12 for o in fused)
    paged = srt.Engine(device="cpu", max_total_tokens=1024, page_size=16)
    assert [o["output_ids"] for o in paged.generate(sampling_params=GREEDY, **kw)] == [
        o["output_ids"] for o in fused
    ]


def test_single_vs_batch_and_outputs(engine):
    one = engine.generate(input_ids=[5, 6, 7, 8], sampling_params=GREEDY, return_logprob=True)
    assert isinstance(one, dict)
    assert one["meta_info"]["prompt_tokens"] == 4
    assert len(one["output_token_logprobs"]) == 12
    assert all(lp <= 0 for lp in one["output_token_logprobs"])
    many = engine.generate(input_ids=[[5, 6, 7, 8], [1, 2]], sampling_params=GREEDY)
    assert isinstance(many, list) and many[0]["output_ids"] == one["output_ids"]


@pytest.mark.skipif(
    not os.path.isdir(os.path.join(os.path.dirname(srt.__file__), "assets", "tiny_tokenizer")),
    reason="tiny tokenizer not shipped",
)
def test_text_with_tiny_tokenizer(engine):
    assert engine.tokenizer is not None
    out = engine.generate(prompt="Hello", sampling_params=GREEDY)
    assert isinstance(out["text"], str)
    assert out["text"] == engine.tokenizer.decode(out["output_ids"], skip_special_tokens=True)


def test_missing_tokenizer_is_graceful(monkeypatch, tmp_path):
    from srt.entrypoints import engine as engine_mod

    monkeypatch.setattr(engine_mod, "TINY_TOKENIZER_DIR", str(tmp_path / "nope"))
    eng = srt.Engine(device="cpu", max_total_tokens=256)
    assert eng.tokenizer is None
    out = eng.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 2})
    assert "text" not in out and len(out["output_ids"]) <= 2
    with pytest.raises(ValueError, match="no tokenizer"):
        eng.generate(prompt="hi")


def test_progress_bar_for_long_batches(engine, capsys):
    engine.generate(input_ids=[[i + 3] for i in range(40)],
                    sampling_params={"max_new_tokens": 2, "temperature": 0.0})  # fmt: skip
    assert "generate" in capsys.readouterr().err
