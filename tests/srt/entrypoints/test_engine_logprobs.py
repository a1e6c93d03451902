"""Engine logprobs and logit_bias end to end, against HF transformers' float64 logits.

A tiny random Llama checkpoint is saved, served by `srt.Engine(model_path=...)` on CPU, and every
returned logprob is checked against log_softmax of HF's float64 logits of the same sequence.
"""

from __future__ import annotations

import random

import pytest
import torch

import srt
from srt.entrypoints import engine_client
from tests.conftest import gpu
from tests.srt.models.hf_compare import save_hf_checkpoint

transformers = pytest.importorskip("transformers")

VOCAB = 160
ATOL = 2e-4  # our float32 run against HF's float64
GREEDY = {"temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        initializer_range=0.1,
        rms_norm_eps=1e-5,
    )
    path = tmp_path_factory.mktemp("llama_lp")
    hf = save_hf_checkpoint(path, transformers.LlamaForCausalLM, cfg, seed=3)
    return path, hf.double()


@pytest.fixture(scope="module")
def engine(ckpt):
    eng = srt.Engine(model_path=str(ckpt[0]), device="cpu", max_total_tokens=1024)
    yield eng
    eng.shutdown()


@torch.no_grad()
def _hf_logprobs(hf, seq: list[int], bias: dict[int, float] | None = None, temp: float = 1.0):
    """float64 [len(seq), V]: log_softmax((logits + bias) / temp) at every position."""
    logits = hf(input_ids=torch.tensor([seq]), use_cache=False).logits[0].double()
    for tok, b in (bias or {}).items():
        logits[:, tok] += b
    return torch.log_softmax(logits / temp, dim=-1)


def _prompts(lens, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in lens]


def _check_top(row, ref_row, k):
    """A top list: k (logprob, id, text) entries, descending, the reference's k best."""
    assert len(row) == k
    lps = [e[0] for e in row]
    assert lps == sorted(lps, reverse=True)
    for lp, tok, _ in row:
        assert lp == pytest.approx(float(ref_row[tok]), abs=ATOL)
    best = ref_row.topk(k).values.tolist()
    assert lps == pytest.approx(best, abs=ATOL)


def test_input_and_output_logprobs_match_hf_float64(engine, ckpt):
    hf = ckpt[1]
    prompts = _prompts([1, 7, 13, 4])
    starts = [0, 3, 12, 4]  # the whole prompt, a middle, the last token only, none
    k = 4
    outs = engine.generate(
        input_ids=prompts,
        sampling_params=dict(GREEDY, max_new_tokens=5),
        return_logprob=True,
        logprob_start_len=starts,
        top_logprobs_num=k,
    )
    for prompt, s, out in zip(prompts, starts, outs, strict=True):
        meta, L = out["meta_info"], len(prompt)
        seq = prompt + out["output_ids"]
        ref = _hf_logprobs(hf, seq)
        inp, in_top = meta["input_token_logprobs"], meta["input_top_logprobs"]
        assert [t for _, t, _ in inp] == prompt[s:] and len(in_top) == L - s
        if s < L:  # SGLang's: the first scored prompt token has no logprob
            assert inp[0][0] is None and in_top[0] is None
        for j in range(1, L - s):
            p = s + j  # token p is scored by position p - 1
            assert inp[j][0] == pytest.approx(float(ref[p - 1, seq[p]]), abs=ATOL)
            _check_top(in_top[j], ref[p - 1], k)
        outl, out_top = meta["output_token_logprobs"], meta["output_top_logprobs"]
        assert [t for _, t, _ in outl] == out["output_ids"] and len(out_top) == 5
        assert out["output_token_logprobs"] == [e[0] for e in outl]
        for j, (lp, tok, text) in enumerate(outl):
            row = ref[L + j - 1]
            assert tok == int(row.argmax()) and text is None
            assert lp == pytest.approx(float(row[tok]), abs=ATOL)
            _check_top(out_top[j], row, k)
            assert out_top[j][0][0] == lp  # greedy: its logprob is the row's top-1, exactly


def test_sampled_logprobs_are_of_the_temperature_scaled_distribution(engine, ckpt):
    hf = ckpt[1]
    prompt = _prompts([6], seed=1)[0]
    sp = {"temperature": 0.7, "top_p": 0.8, "top_k": 30, "seed": 5, "max_new_tokens": 6}
    sp["ignore_eos"] = True
    out = engine.generate(input_ids=prompt, sampling_params=sp, return_logprob=True)
    ref = _hf_logprobs(hf, prompt + out["output_ids"], temp=0.7)
    for j, (lp, tok, _) in enumerate(out["meta_info"]["output_token_logprobs"]):
        assert lp == pytest.approx(float(ref[len(prompt) + j - 1, tok]), abs=ATOL)
    assert out["meta_info"]["input_token_logprobs"] == []  # logprob_start_len -1: none
    assert "output_top_logprobs" not in out["meta_info"]


def test_logit_bias_forces_and_bans_greedy_tokens(engine, ckpt):
    hf = ckpt[1]
    prompt = _prompts([5], seed=2)[0]
    plain = engine.generate(input_ids=prompt, sampling_params=dict(GREEDY, max_new_tokens=4))
    forced_tok = next(t for t in range(3, VOCAB) if t not in plain["output_ids"])
    sp = dict(GREEDY, max_new_tokens=4, logit_bias={str(forced_tok): 100})
    forced = engine.generate(input_ids=prompt, sampling_params=sp, return_logprob=True)
    assert forced["output_ids"] == [forced_tok] * 4
    ref = _hf_logprobs(hf, prompt + forced["output_ids"], bias={forced_tok: 100.0})
    for j, (lp, _, _) in enumerate(forced["meta_info"]["output_token_logprobs"]):
        assert lp == pytest.approx(float(ref[len(prompt) + j - 1, forced_tok]), abs=ATOL)
    # a ban of the first greedy token gives the runner-up (with a small bias: the choice moves)
    first = plain["output_ids"][0]
    banned = engine.generate(
        input_ids=prompt, sampling_params=dict(GREEDY, max_new_tokens=1, logit_bias={first: -100})
    )
    row = _hf_logprobs(hf, prompt)[-1]
    assert banned["output_ids"][0] == int(row.topk(2).indices[1])


def test_mixed_batch_tokens_equal_runs_without_logprobs(engine):
    """Requests asking for logprobs (or not) in one batch: every request's tokens are those of
    the batch run without any logprobs (which takes the overlapped decode)."""
    prompts = _prompts([3, 9, 1, 14, 6, 2], seed=4)
    sps = [
        dict(GREEDY, max_new_tokens=7),
        {"temperature": 0.9, "seed": 11, "max_new_tokens": 9, "ignore_eos": True},
        dict(GREEDY, max_new_tokens=3),
        {"temperature": 0.6, "top_k": 8, "seed": 12, "max_new_tokens": 5, "ignore_eos": True},
        dict(GREEDY, max_new_tokens=8),
        {"temperature": 1.2, "seed": 13, "max_new_tokens": 6, "ignore_eos": True},
    ]
    before = engine.scheduler.num_overlapped_steps
    base = engine.generate(input_ids=prompts, sampling_params=sps)
    assert engine.scheduler.num_overlapped_steps > before  # the reference did overlap
    flags = [True, False, True, False, False, True]
    mixed = engine.generate(
        input_ids=prompts,
        sampling_params=sps,
        return_logprob=flags,
        top_logprobs_num=[2, 0, 0, 0, 0, 3],
        logprob_start_len=[0, -1, 1, -1, -1, -1],
    )
    assert [o["output_ids"] for o in mixed] == [o["output_ids"] for o in base]
    for o, f in zip(mixed, flags, strict=True):
        assert ("output_token_logprobs" in o["meta_info"]) == f
        if f:
            assert len(o["meta_info"]["output_token_logprobs"]) == len(o["output_ids"])


def test_stream_chunks_carry_the_same_logprobs(engine):
    prompt = _prompts([8], seed=5)[0]
    kw = dict(
        input_ids=prompt,
        sampling_params=dict(GREEDY, max_new_tokens=6),
        return_logprob=True,
        top_logprobs_num=2,
        logprob_start_len=2,
    )
    engine.generate(**kw)  # fills the prefix cache: every call below starts from the same
    whole = engine.generate(**kw)  # cached prefix (its first 2 tokens), so computes the same bits
    meta = whole["meta_info"]
    assert meta["cached_tokens"] == 2
    # cumulative (the default): every chunk has the lists so far, the last one all of them
    chunks = list(engine.generate(**kw, stream=True))
    assert len(chunks) == 6
    for i, c in enumerate(chunks):
        for key in ("output_token_logprobs", "output_top_logprobs"):
            assert c["meta_info"][key] == meta[key][: i + 1]
        assert c["output_token_logprobs"] == whole["output_token_logprobs"][: i + 1]
        assert c["meta_info"]["input_token_logprobs"] == meta["input_token_logprobs"]
    # incremental: each chunk has its own token's entries
    batch = engine.make_requests(**kw)
    inc = list(engine_client.stream(engine.engine_loop(), batch, incremental=True))
    got = [e for c in inc for e in c["meta_info"]["output_token_logprobs"]]
    tops = [e for c in inc for e in c["meta_info"]["output_top_logprobs"]]
    assert got == meta["output_token_logprobs"] and tops == meta["output_top_logprobs"]
    assert inc[-1]["meta_info"]["input_token_logprobs"] == meta["input_token_logprobs"]


def test_prompt_only_scoring_with_max_new_tokens_0(engine, ckpt):
    """lm-eval's loglikelihood: max_new_tokens 0, the whole prompt scored, nothing generated."""
    hf = ckpt[1]
    prompt = _prompts([9], seed=6)[0]
    free = engine.scheduler.available_kv_size()
    out = engine.generate(
        input_ids=[prompt, prompt],
        sampling_params={"max_new_tokens": 0},
        return_logprob=[True, False],
        logprob_start_len=0,
        top_logprobs_num=1,
    )
    assert [o["output_ids"] for o in out] == [[], []]
    assert out[0]["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    ref = _hf_logprobs(hf, prompt)
    lps = [e[0] for e in out[0]["meta_info"]["input_token_logprobs"]]
    assert lps[0] is None
    assert lps[1:] == pytest.approx([float(ref[p - 1, prompt[p]]) for p in range(1, 9)], abs=ATOL)
    assert out[0]["meta_info"]["output_token_logprobs"] == []
    assert "input_token_logprobs" not in out[1]["meta_info"]
    assert engine.scheduler.available_kv_size() == free


def test_bad_logprob_arguments_are_rejected_alone(engine):
    prompt = _prompts([4], seed=7)[0]
    one = dict(GREEDY, max_new_tokens=2)
    lp = dict(input_ids=prompt, sampling_params=one, return_logprob=True)
    with pytest.raises(ValueError, match="logprob_start_len=5 is higher than the number of input"):
        engine.generate(**lp, logprob_start_len=5)
    with pytest.raises(ValueError, match="top_logprobs_num must be >= 0"):
        engine.generate(**lp, top_logprobs_num=-1)
    with pytest.raises(TypeError, match="logprob_start_len must be an int"):
        engine.generate(**lp, logprob_start_len=1.5)
    with pytest.raises(ValueError, match=f"token id {VOCAB} outside the vocabulary"):
        engine.generate(input_ids=prompt, sampling_params=dict(one, logit_bias={VOCAB: 1}))
    with pytest.raises(ValueError, match="2 logprob_start_len values for 3 requests"):
        engine.generate(input_ids=[prompt] * 3, sampling_params=one, logprob_start_len=[0, 1])
    # in a batch, checked up front like every other value: the call is refused naming the
    # first bad request, before any runs; the HTTP loop's make_requests keeps each error
    batch3 = dict(
        input_ids=[prompt, prompt, prompt],
        sampling_params=[one, dict(one, logit_bias={"x": 1}), one],
        return_logprob=True,
        logprob_start_len=[0, 0, 9],
    )
    steps = engine.scheduler.num_prefill_steps
    with pytest.raises(ValueError, match="request 1: .*logit_bias"):
        engine.generate(**batch3)
    assert engine.scheduler.num_prefill_steps == steps
    items = engine.make_requests(**batch3).items
    assert [type(x).__name__ for x in items] == ["Req", "RequestError", "RequestError"]
    assert "logit_bias" in items[1].message and "logprob_start_len" in items[2].message


def test_logprob_text_with_the_tiny_tokenizer():
    eng = srt.Engine(device="cpu", max_total_tokens=256)
    try:
        if eng.tokenizer is None:
            pytest.skip("tiny tokenizer not shipped")
        out = eng.generate(
            prompt="Hello there",
            sampling_params=dict(GREEDY, max_new_tokens=3),
            return_logprob=True,
            logprob_start_len=0,
            top_logprobs_num=2,
            return_text_in_logprobs=True,
        )
        meta = out["meta_info"]
        dec = eng.tokenizer.decode
        for _, tok, text in meta["input_token_logprobs"] + meta["output_token_logprobs"]:
            assert text == dec([tok])
        for row in meta["output_top_logprobs"]:
            assert all(text == dec([tok]) for _, tok, text in row)
    finally:
        eng.shutdown()


@gpu
def test_cuda_graph_logprobs_and_bias_match_eager():
    """On the GPU: graph replays (logprobs and logit_bias computed outside the graph) give the
    eager engine's tokens and logprobs, and a mixed batch keeps the no-logprob tokens."""
    prompts = _prompts([5, 17, 2, 9], seed=8)
    sps = [
        dict(GREEDY, max_new_tokens=12),
        dict(GREEDY, max_new_tokens=12, logit_bias={"7": 3.5, "40": -100}),
        {"temperature": 0.8, "seed": 3, "max_new_tokens": 12, "ignore_eos": True},
        dict(GREEDY, max_new_tokens=12),
    ]
    kw = dict(return_logprob=[True, True, True, False], top_logprobs_num=3, logprob_start_len=0)
    runs = {}
    for graph in (False, True):
        eng = srt.Engine(
            device="cuda",
            cuda_graph=graph,
            dtype="float32",
            max_total_tokens=2048,
            cuda_graph_max_bs=8,
            skip_tokenizer_init=True,
        )
        assert (eng.model_runner.cuda_graph_runner is not None) == graph
        try:
            base = eng.generate(input_ids=prompts, sampling_params=sps)
            runs[graph] = eng.generate(input_ids=prompts, sampling_params=sps, **kw)
            assert [o["output_ids"] for o in runs[graph]] == [o["output_ids"] for o in base]
            assert base[1]["output_ids"] == [7] * 12  # the tiny model's logits spread < 3.5
        finally:
            eng.shutdown()
    for a, b in zip(runs[False], runs[True], strict=True):
        assert a["output_ids"] == b["output_ids"]
        la = [e[0] for e in a["meta_info"].get("output_token_logprobs", [])]
        lb = [e[0] for e in b["meta_info"].get("output_token_logprobs", [])]
        assert la == pytest.approx(lb, abs=1e-4)
