"""The embedded tiny tokenizer: loadable offline, exactly 1024 tokens, lossless, reproducible."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from srt.assets import (
    TINY_BOS_ID,
    TINY_EOS_ID,
    TINY_PAD_ID,
    TINY_TOKENIZER_DIR,
    TINY_VOCAB_SIZE,
    build_tiny_tokenizer,
    load_tiny_tokenizer,
)

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tok():
    return load_tiny_tokenizer()


def test_vocab_size_and_special_ids(tok):
    assert TINY_VOCAB_SIZE == 1024
    assert len(tok) == TINY_VOCAB_SIZE
    vocab = tok.get_vocab()
    assert sorted(vocab.values()) == list(range(TINY_VOCAB_SIZE))
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (
        TINY_PAD_ID,
        TINY_BOS_ID,
        TINY_EOS_ID,
    )
    assert (tok.pad_token, tok.bos_token, tok.eos_token) == ("<|pad|>", "<|bos|>", "<|eos|>")
    raw = json.loads((TINY_TOKENIZER_DIR / "tokenizer.json").read_text())
    assert raw["model"]["type"] == "BPE"
    assert len(raw["model"]["vocab"]) == TINY_VOCAB_SIZE


@pytest.mark.parametrize(
    "text",
    [
        "",
        "a",
        "The electron absorbs a photon of 3.2 eV.",
        "  leading and trailing spaces \n\n\ttabs\r\n",
        "Ünïcödé ß 日本語 😀 ∫ x² dx",
        "Answer: C",
        "<|eos|> in the middle <|user|>",
    ],
)
def test_round_trip(tok, text):
    ids = tok(text)["input_ids"]
    assert all(0 <= i < TINY_VOCAB_SIZE for i in ids)
    assert TINY_BOS_ID not in ids or "<|bos|>" in text  # no implicit BOS
    assert tok.decode(ids) == text


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=40))
def test_round_trip_any_text(tok, text):
    # Byte-level BPE: every string encodes and decodes back exactly.
    assert tok.decode(tok(text)["input_ids"]) == text


def test_compresses_english(tok):
    text = "The temperature of the ideal gas increases when the pressure increases."
    ids = tok(text)["input_ids"]
    assert len(ids) < len(text.encode()) / 2.5


def test_chat_template(tok):
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?"},
    ]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|bos|><|system|>\nBe brief.<|eos|>\n<|user|>\nWhat is 2+2?<|eos|>\n<|assistant|>\n"
    )
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids[:2] == [TINY_BOS_ID, tok.convert_tokens_to_ids("<|system|>")]
    assert ids.count(TINY_BOS_ID) == 1 and ids.count(TINY_EOS_ID) == 2
    assert ids[-2] == tok.convert_tokens_to_ids("<|assistant|>")
    no_gen = tok.apply_chat_template(msgs[1:], tokenize=False, add_generation_prompt=False)
    assert no_gen == "<|bos|><|user|>\nWhat is 2+2?<|eos|>\n"
    with pytest.raises(Exception, match="Unknown role"):
        tok.apply_chat_template([{"role": "robot", "content": "x"}], tokenize=False)


def test_assets_small_and_reproducible():
    total = sum(p.stat().st_size for p in TINY_TOKENIZER_DIR.iterdir())
    assert total < 200_000
    # Rebuilding from the script gives the committed bytes.
    assert build_tiny_tokenizer.check() == []
