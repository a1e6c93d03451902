"""Chunked prefill (issue 48): the same greedy tokens with and without chunks (page 1 and 16,
fused and unfused, with and without the radix cache), running decodes step between a long
prompt's chunks, each chunk's whole pages enter the radix cache, a chunk that fails or an abort
mid-prompt fails that request alone; ServerArgs' default and checks (tiny Llama, CPU)."""

from __future__ import annotations

import random

import pytest

import srt
from srt.managers.schedule_batch import Req
from srt.mem_cache.radix_cache import RadixKey
from srt.sampling.sampling_params import SamplingParams
from srt.server_args import ServerArgs
from tests.srt.mem_cache.radix_checks import check_ownership

SP = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}


def _engine(ps: int, fused: bool = True, **kw) -> srt.Engine:
    kw.setdefault("max_total_tokens", 2048)
    return srt.Engine(
        device="cpu",
        skip_tokenizer_init=True,
        page_size=ps,
        enable_fused_rope_kv=fused,
        context_length=512,
        **kw,
    )


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 999) for _ in range(45)]
    lens = (100, 57, 23, 3, 64)
    out = [[rng.randrange(3, 999) for _ in range(n)] for n in lens]
    return out + [shared + [rng.randrange(3, 999) for _ in range(k)] for k in (30, 2, 41)]


@pytest.mark.parametrize(
    "ps, fused, chunk, radix",
    [(1, True, 7, True), (1, False, 16, False), (16, True, 24, False), (16, False, 16, True)],
)
def test_greedy_tokens_identical_with_and_without_chunks(ps, fused, chunk, radix):
    prompts = _prompts(ps + chunk)
    ref = _engine(ps, fused, chunked_prefill_size=-1, disable_radix_cache=True)
    want = [o["output_ids"] for o in ref.generate(input_ids=prompts, sampling_params=SP)]
    steps = ref.scheduler.num_prefill_steps
    ref.shutdown()
    eng = _engine(ps, fused, chunked_prefill_size=chunk, disable_radix_cache=not radix)
    for _ in range(2):  # the second time from the cache (when on)
        outs = eng.generate(input_ids=prompts, sampling_params=SP)
        assert [o["output_ids"] for o in outs] == want
    assert eng.scheduler.num_prefill_steps > 2 * steps  # prompts went in chunks
    if radix:
        cached = [o["meta_info"]["cached_tokens"] for o in outs]
        assert cached == [(len(p) - 1) // ps * ps for p in prompts]
    sched = eng.scheduler
    check_ownership(sched.tree_cache, eng.model_runner.token_to_kv_pool_allocator, [])
    assert sched.available_kv_size() == eng.model_runner.max_total_num_tokens
    eng.shutdown()


def _req(rid: str, ids: list[int], n: int) -> Req:
    return Req(rid, ids, SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True))


def _short_requests(eng: srt.Engine, first: int, n: int) -> tuple[list[Req], list[dict]]:
    """Two 3-token requests of n tokens each, and their outputs served alone."""
    short = [_req(f"s{i}", [first + i, 6, 7], n) for i in range(2)]
    sp = dict(SP, max_new_tokens=n)
    return short, [eng.generate(input_ids=r.origin_input_ids, sampling_params=sp) for r in short]


@pytest.mark.parametrize("ps", [1, 4])
def test_decodes_step_between_chunks_and_chunks_enter_the_cache(ps):
    eng = _engine(ps, chunked_prefill_size=8)
    sched, runner = eng.scheduler, eng.model_runner
    short, solo = _short_requests(eng, 5, 40)
    long_ids = [(7 * i) % 997 + 3 for i in range(61)]
    kinds: list[str] = []
    real = runner.forward

    def forward(fb, *a, **k):
        long_rows = {r.req_pool_idx for r in sched.running if r.rid == "long"}
        mine = long_rows & set(fb.req_pool_indices.tolist())
        kinds.append("chunk" if fb.forward_mode.is_extend() and mine else "other")
        return real(fb, *a, **k)

    runner.forward = forward
    for r in short:
        sched.add_request(r)
    sched.step()  # the short ones are prefilled and decoding
    long = _req("long", long_ids, 3)
    sched.add_request(long)
    seen_in_tree = 0
    while sched.has_work():
        sched.step()
        if sched.chunked_req is long:  # its earlier chunks' whole pages are in the tree
            m = sched.tree_cache.match_prefix(RadixKey(tuple(long_ids)))
            seen_in_tree = max(seen_in_tree, m.prefix_len)
            assert m.prefix_len == long.kv_len // ps * ps
    chunks = [i for i, k in enumerate(kinds) if k == "chunk"]
    assert len(chunks) == -(-61 // 8)
    assert all(kinds[i + 1] == "other" for i in chunks[:-1])  # a decode step between chunks
    assert seen_in_tree >= 48
    assert [r.output_ids for r in short] == [s["output_ids"] for s in solo]
    alone = eng.generate(input_ids=long_ids, sampling_params=dict(SP, max_new_tokens=3))
    assert long.output_ids == alone["output_ids"]
    assert alone["meta_info"]["cached_tokens"] == 60 // ps * ps
    eng.shutdown()


@pytest.mark.parametrize("how", ["fail", "abort"])
def test_a_chunk_that_fails_or_an_abort_mid_prompt(how, monkeypatch):
    eng = _engine(4, chunked_prefill_size=8, max_total_tokens=512)
    sched, runner = eng.scheduler, eng.model_runner
    other = _req("other", [9, 8, 7], 12)
    want = eng.generate(input_ids=[9, 8, 7], sampling_params=dict(SP, max_new_tokens=12))
    long = _req("long", [(5 * i) % 991 + 3 for i in range(50)], 4)
    real = runner.forward

    def forward(fb, *a, **k):
        if long.kv_len >= 24 and fb.forward_mode.is_extend():
            raise RuntimeError("poisoned chunk")
        return real(fb, *a, **k)

    if how == "fail":
        monkeypatch.setattr(runner, "forward", forward)
    for r in (other, long):
        sched.add_request(r)
    while sched.has_work():
        sched.step()
        if how == "abort" and long.kv_len >= 24 and not long.finished:
            assert sched.abort("long") is long
    assert long.finished_reason["type"] == "abort" and long.req_pool_idx is None
    assert how == "abort" or "poisoned chunk" in str(long.error)
    assert sched.chunked_req is None and other.output_ids == want["output_ids"]
    tree = sched.tree_cache
    check_ownership(tree, runner.token_to_kv_pool_allocator, [])
    assert tree.protected_size() == 0
    assert sched.available_kv_size() == runner.max_total_num_tokens
    assert runner.req_to_token_pool.available_size() == runner.max_running_requests
    eng.shutdown()


def test_server_args_chunked_prefill_size():
    assert ServerArgs(device="cpu").resolved().chunked_prefill_size == 4096
    assert ServerArgs(device="cpu", chunked_prefill_size=-1).resolved().chunked_prefill_size == -1
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="chunked_prefill_size"):
            ServerArgs(chunked_prefill_size=bad)  # type: ignore[arg-type]


def test_chunks_shrink_while_others_decode():
    """While other requests decode, a chunk is at most decode_chunked_prefill_size tokens; once
    they finish, the prompt goes on in whole chunks; every request's tokens are unchanged."""
    eng = _engine(1, chunked_prefill_size=16, decode_chunked_prefill_size=5)
    sched, runner = eng.scheduler, eng.model_runner
    short, solo = _short_requests(eng, 9, 4)
    long_ids = [(11 * i) % 997 + 3 for i in range(83)]
    sizes: list[tuple[int, int]] = []  # (chunk tokens, other running requests)
    real = runner.forward

    def forward(fb, *a, **k):
        rows = {r.req_pool_idx: r for r in sched.running}
        mine = [rows[i].rid == "long" for i in fb.req_pool_indices.tolist() if i in rows]
        if fb.forward_mode.is_extend() and any(mine):
            others = sum(not r.finished and r.rid != "long" for r in sched.running)
            sizes.append((fb.extend_seq_lens_cpu[0], others))
        return real(fb, *a, **k)

    runner.forward = forward
    for r in short:
        sched.add_request(r)
    sched.step()
    long = _req("long", long_ids, 3)
    sched.add_request(long)
    while sched.has_work():
        sched.step()
    assert sum(n for n, _ in sizes) == 83
    assert {n for n, others in sizes if others} == {5}
    alone = [n for n, others in sizes if not others]
    assert alone[:-1] and all(n == 16 for n in alone[:-1])
    assert [r.output_ids for r in short] == [s["output_ids"] for s in solo]
    want = eng.generate(input_ids=long_ids, sampling_params=dict(SP, max_new_tokens=3))
    assert long.output_ids == want["output_ids"]
    eng.shutdown()


def test_server_args_decode_chunked_prefill_size():
    from srt.server_args import DEFAULT_DECODE_CHUNK

    args = ServerArgs(device="cpu").resolved()
    assert args.decode_chunked_prefill_size == DEFAULT_DECODE_CHUNK
    assert (
        ServerArgs(device="cpu", decode_chunked_prefill_size=-1)
        .resolved()
        .decode_chunked_prefill_size
        == -1
    )
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="decode_chunked_prefill_size"):
            ServerArgs(decode_chunked_prefill_size=bad)  # type: ignore[arg-type]


def test_requests_are_admitted_between_chunks_one_chunked_prompt_at_a_time():
    """A short request that arrives while a long prompt is chunked is prefilled between its
    chunks (its first token comes before the long prompt's); a second long prompt waits until
    the first is done (and stops admission: FIFO); every request's tokens equal its solo run."""
    eng = _engine(1, chunked_prefill_size=8, decode_chunked_prefill_size=8)
    sched = eng.scheduler
    sp = dict(SP, max_new_tokens=3)
    ids = {
        "long1": [(7 * i) % 997 + 3 for i in range(61)],
        "short": [9, 8, 7, 6],
        "long2": [(5 * i) % 991 + 4 for i in range(40)],
        "late": [4, 5, 6],
    }
    solo = {k: eng.generate(input_ids=v, sampling_params=sp)["output_ids"] for k, v in ids.items()}
    assert eng.flush_cache()  # computed again, in chunks
    reqs = {k: _req(k, v, 3) for k, v in ids.items()}
    sched.add_request(reqs["long1"])
    sched.step()  # long1's first chunk
    for k in ("short", "long2", "late"):
        sched.add_request(reqs[k])
    first: dict[str, int] = {}
    chunked: list[str] = []
    step = 0
    while sched.has_work():
        sched.step()
        step += 1
        if sched.chunked_req is not None:
            chunked.append(sched.chunked_req.rid)
        for k, r in reqs.items():
            if r.output_ids and k not in first:
                first[k] = step
    assert first["short"] < first["long1"]  # admitted between long1's chunks
    assert chunked.index("long2") > max(i for i, rid in enumerate(chunked) if rid == "long1")
    assert first["late"] > first["long1"]  # behind long2 in the queue
    assert {k: r.output_ids for k, r in reqs.items()} == solo
    eng.shutdown()
