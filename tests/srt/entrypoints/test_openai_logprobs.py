"""OpenAI logprobs, top_logprobs, echo and logit_bias: the mapping, and through the HTTP server."""

from __future__ import annotations

import json

import pytest

import srt
from srt.entrypoints import openai_logprobs as oai_lp
from srt.entrypoints.openai_api import BadRequest

GREEDY = {"temperature": 0.0}


def test_request_options_map_to_generate_arguments():
    assert oai_lp.generate_logprob_args({}, chat=False) == {}
    assert oai_lp.generate_logprob_args({"logprobs": None, "echo": True}, chat=False) == {}
    args = oai_lp.generate_logprob_args({"logprobs": 3}, chat=False)
    assert args == {
        "return_logprob": True,
        "top_logprobs_num": 3,
        "logprob_start_len": -1,
        "return_text_in_logprobs": True,
    }
    echo = oai_lp.generate_logprob_args({"logprobs": 0, "echo": True}, chat=False)
    assert echo["logprob_start_len"] == 0 and echo["top_logprobs_num"] == 0
    assert oai_lp.generate_logprob_args({"logprobs": False}, chat=True) == {}
    chat = oai_lp.generate_logprob_args({"logprobs": True, "top_logprobs": 5}, chat=True)
    assert chat["top_logprobs_num"] == 5 and "logprob_start_len" not in chat


@pytest.mark.parametrize(
    "body,chat,param",
    [
        ({"logprobs": 21}, False, "logprobs"),
        ({"logprobs": -1}, False, "logprobs"),
        ({"logprobs": True}, False, "logprobs"),
        ({"logprobs": "2"}, False, "logprobs"),
        ({"logprobs": 1, "echo": "yes"}, False, "echo"),
        ({"logprobs": 2}, True, "logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, True, "top_logprobs"),
        ({"top_logprobs": 2}, True, "top_logprobs"),
    ],
)
def test_bad_options_are_400s_naming_the_field(body, chat, param):
    with pytest.raises(BadRequest) as e:
        oai_lp.generate_logprob_args(body, chat)
    assert e.value.param == param and param in str(e.value)


META = {
    "completion_tokens": 2,
    "input_token_logprobs": [(None, 5, "A"), (-1.5, 6, "bc")],
    "input_top_logprobs": [None, [(-0.5, 9, "x"), (-1.5, 6, "bc")]],
    "output_token_logprobs": [(-0.25, 7, "d"), (-2.0, 8, None)],
    "output_top_logprobs": [[(-0.25, 7, "d"), (-3.0, 4, "d")], [(-1.0, 3, "é")]],
}


def test_completion_and_chat_shapes():
    got = oai_lp.completion_logprobs(META, with_input=True)
    assert got == {
        "tokens": ["A", "bc", "d", "token_id:8"],
        "token_logprobs": [None, -1.5, -0.25, -2.0],
        # two tokens with one text: the likelier one's logprob is kept
        "top_logprobs": [None, {"x": -0.5, "bc": -1.5}, {"d": -0.25}, {"é": -1.0}],
        "text_offset": [0, 1, 3, 4],
    }
    out_only = oai_lp.completion_logprobs(META, with_input=False)
    assert out_only["tokens"] == ["d", "token_id:8"] and out_only["text_offset"] == [0, 1]
    no_top = {k: v for k, v in META.items() if "top" not in k}
    assert oai_lp.completion_logprobs(no_top, with_input=False)["top_logprobs"] == []
    chat = oai_lp.chat_logprobs(META)["content"]
    assert chat[0] == {
        "token": "d",
        "logprob": -0.25,
        "bytes": [100],
        "top_logprobs": [
            {"token": "d", "logprob": -0.25, "bytes": [100]},
            {"token": "d", "logprob": -3.0, "bytes": [100]},
        ],
    }
    assert chat[1]["top_logprobs"][0]["bytes"] == list("é".encode())


def _chunks():
    """META's output streamed in two incremental chunks (what the server asks the engine for):
    each has its own token's entries only."""
    outs = []
    for n in (1, 2):
        meta = dict(META, completion_tokens=n)
        meta["output_token_logprobs"] = META["output_token_logprobs"][n - 1 : n]
        meta["output_top_logprobs"] = META["output_top_logprobs"][n - 1 : n]
        outs.append({"meta_info": meta})
    return outs


@pytest.mark.parametrize("chat", [False, True])
def test_stream_logprobs_of_incremental_chunks(chat):
    st = oai_lp.StreamLogprobs(chat, None if chat else ["Q"], n=1)
    sent = []
    for out in _chunks():
        payload = {"choices": [{"index": 0, "text": "t", "logprobs": None}]}
        sent.append(st.fill(payload, out)["choices"][0])
    if chat:
        assert [e["token"] for p in sent for e in p["logprobs"]["content"]] == [
            "d",
            "token_id:8",
        ]
    else:  # the echo and the prompt's logprobs come with the first chunk only
        first, second = sent
        assert first["text"] == "Qt" and second["text"] == "t"
        assert first["logprobs"]["tokens"] == ["A", "bc", "d"]
        assert second["logprobs"]["tokens"] == ["token_id:8"]
        assert second["logprobs"]["text_offset"] == [4]


def test_echo_texts():
    assert oai_lp.echo_texts({"prompt": "hi"}, None) is None
    assert oai_lp.echo_texts({"prompt": "hi", "echo": True}, None) == ["hi"]
    assert oai_lp.echo_texts({"prompt": ["a", "b"], "echo": True}, None) == ["a", "b"]

    class Tok:
        def decode(self, ids, skip_special_tokens=True):
            return "-".join(map(str, ids))

    assert oai_lp.echo_texts({"prompt": [1, 2], "echo": True}, Tok()) == ["1-2"]
    assert oai_lp.echo_texts({"prompt": [[1], [2, 3]], "echo": True}, Tok()) == ["1", "2-3"]


# ---- through the server ----
openai = pytest.importorskip("openai", reason="install the dev extra (openai client)")
httpx = pytest.importorskip("httpx", reason="install the dev extra (httpx)")


@pytest.fixture(scope="module")
def server():
    pytest.importorskip("fastapi", reason="install the server extra (fastapi, uvicorn)")
    from srt.entrypoints.http_server import ServerThread

    eng = srt.Engine(device="cpu", max_total_tokens=2048)
    if eng.tokenizer is None:
        pytest.skip("tiny tokenizer not shipped")
    st = ServerThread(eng, model_name="tiny")
    st.engine = eng
    yield st
    st.close()
    eng.shutdown()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=120, max_retries=0)


def test_lm_eval_style_prompt_scoring(client, server):
    """echo + logprobs with max_tokens 0 (and 1): every prompt token's logprob, the first null,
    equal to the engine's own input logprobs; top-1 entries at least the token's own."""
    ids = server.engine.tokenizer.encode("The capital of France is Paris")
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1, **GREEDY}}
    body.update(return_logprob=True, logprob_start_len=0)
    ref = httpx.post(server.url + "/generate", json=body, timeout=60).json()
    ref = ref["meta_info"]["input_token_logprobs"]
    for max_tokens in (0, 1):
        r = client.completions.create(
            model="tiny", prompt=ids, max_tokens=max_tokens, echo=True, logprobs=1, temperature=0
        )
        lp = r.choices[0].logprobs
        assert len(lp.token_logprobs) == len(ids) + max_tokens
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert lp.token_logprobs[: len(ids)] == pytest.approx([e[0] for e in ref], abs=1e-6)
        for tok_lp, top in zip(lp.token_logprobs[1:], lp.top_logprobs[1:], strict=True):
            assert len(top) == 1 and max(top.values()) >= tok_lp
        assert r.choices[0].text.startswith("The capital of France is Paris")
        assert r.usage.completion_tokens == max_tokens


def test_chat_logprobs_whole_and_streamed(client):
    msgs = [{"role": "user", "content": "Say something"}]
    kw = dict(model="tiny", messages=msgs, max_tokens=5, temperature=0, logprobs=True)
    r = client.chat.completions.create(**kw, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 5
    for item in content:
        assert len(item.top_logprobs) == 3
        assert item.top_logprobs[0].logprob == item.logprob  # greedy: the top-1, exactly
        vals = [t.logprob for t in item.top_logprobs]
        assert vals == sorted(vals, reverse=True)
    plain = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=5, temperature=0)
    assert plain.choices[0].logprobs is None
    assert plain.choices[0].message.content == r.choices[0].message.content
    streamed = []
    for chunk in client.chat.completions.create(**kw, stream=True):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += [(c.token, c.logprob) for c in chunk.choices[0].logprobs.content]
    assert streamed == [(c.token, c.logprob) for c in content]


def test_logit_bias_through_the_api(client, server):
    tok = server.engine.tokenizer.encode(" Paris")[-1]
    r = client.completions.create(
        model="tiny", prompt="Hi", max_tokens=3, temperature=0, logit_bias={str(tok): 100}
    )
    assert r.choices[0].text == server.engine.tokenizer.decode([tok] * 3)
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        client.completions.create(model="tiny", prompt="Hi", max_tokens=3, logit_bias={"x": 1})
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        client.completions.create(model="tiny", prompt="Hi", max_tokens=3, logit_bias={"5": 500})
    r = httpx.post(
        server.url + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
        timeout=30,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"
    assert not server.loop.num_active


def test_native_generate_logprob_fields(server):
    body = {
        "text": "Hello",
        "sampling_params": {"max_new_tokens": 2, **GREEDY},
        "return_logprob": True,
        "logprob_start_len": 0,
        "top_logprobs_num": 2,
        "return_text_in_logprobs": True,
    }
    r = httpx.post(server.url + "/generate", json=body, timeout=30)
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]
    ids = server.engine.tokenizer.encode("Hello")
    assert [e[1] for e in meta["input_token_logprobs"]] == ids
    assert meta["input_token_logprobs"][0][0] is None
    assert len(meta["output_top_logprobs"]) == 2 and len(meta["output_top_logprobs"][0]) == 2
    assert all(isinstance(e[2], str) for e in meta["output_token_logprobs"])
    bad = httpx.post(server.url + "/generate", json=dict(body, logprob_start_len=99), timeout=30)
    assert bad.status_code == 400 and "logprob_start_len" in bad.text
    json.dumps(meta)  # plain JSON: no infinities
