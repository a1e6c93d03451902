"""The eager decode warm-up (decode_warmup.py): which sizes, and that its dummy steps leave every
KV slot a request could hold untouched (only the padding slot 0 is written)."""

from __future__ import annotations

import random

import pytest
import torch

import srt
from srt.model_executor.decode_warmup import MAX_WARM_BATCH, eager_decode_sizes, warmup_eager_decode
from tests.conftest import gpu
from tests.srt.mem_cache.radix_checks import kv_bytes


def test_sizes_are_the_powers_of_two_past_the_graphs():
    assert eager_decode_sizes(65, 2048) == [128, 256, 512, 1024]
    assert eager_decode_sizes(65, 300) == [128, 256, 300]
    assert eager_decode_sizes(1, 4) == [1, 2, 4]
    assert eager_decode_sizes(1, 5) == [1, 2, 4, 5]
    assert eager_decode_sizes(65, 64) == []  # the graphs take every batch
    assert eager_decode_sizes(2 * MAX_WARM_BATCH, 4 * MAX_WARM_BATCH) == []


def _only_padding_written(pool, warm) -> None:
    """warm() leaves every KV slot but the padding slot 0 as it was."""
    for b in (*pool.k_buffer, *pool.v_buffer):  # fresh random bytes everywhere
        b.view(torch.uint8).copy_(torch.randint_like(b.view(torch.uint8), 0, 256))
    before = kv_bytes(pool)
    warm()
    for x, y in zip(before, kv_bytes(pool), strict=True):
        assert torch.equal(x[1:], y[1:])  # slot 0 is the padding slot


def _check_only_padding_written(eng, sizes, cascade):
    runner = eng.scheduler.runner
    _only_padding_written(
        runner.token_to_kv_pool, lambda: warmup_eager_decode(runner, sizes, cascade)
    )


def _triton_engine(context_length: int) -> srt.Engine:
    return srt.Engine(
        device="cuda" if torch.cuda.is_available() else "cpu",  # the CPU runs Triton interpreted
        skip_tokenizer_init=True,
        attention_backend="triton",
        max_total_tokens=512,
        context_length=context_length,
        disable_cuda_graph=True,
    )


@pytest.mark.parametrize("cascade", [False, True])
def test_dummy_decodes_write_only_the_padding_slot(cascade):
    eng = _triton_engine(64)
    try:
        _check_only_padding_written(eng, [1, 3], cascade)
        # and the engine still serves after it
        ids = [[random.randrange(3, 900) for _ in range(9)]]
        out = eng.generate(input_ids=ids, sampling_params={"max_new_tokens": 2})
        assert len(out[0]["output_ids"]) == 2
    finally:
        eng.shutdown()


@gpu
def test_gpu_warmup_at_start_and_padding_only():
    """On the GPU the runner warms its eager sizes at start-up (unrun on CI)."""
    eng = srt.Engine(device="cuda", skip_tokenizer_init=True, max_total_tokens=8192)
    try:
        _check_only_padding_written(eng, [128, 256], True)
    finally:
        eng.shutdown()


def test_extend_warm_prefixes_take_each_split_count(monkeypatch):
    from srt.layers.attention.triton_ops import extend_attention as ea
    from srt.model_executor.decode_warmup import extend_warm_prefixes

    assert extend_warm_prefixes(100) == [0]
    assert extend_warm_prefixes(2049) == [0, 2048]
    assert extend_warm_prefixes(32768) == [0, 2048, 4096]
    monkeypatch.setattr(ea, "interpreting", lambda: False)  # the GPU's tile shape
    for prefix, splits in zip(extend_warm_prefixes(32768), (1, 2, 4), strict=True):
        assert ea.extend_num_splits(1, 8, 4, 1, prefix + 1, 132) == splits


def test_extend_warmup_writes_only_the_padding_slot(monkeypatch):
    """The dummy extends (split-KV after 2048 cached keys) leave every other slot untouched and
    launch the split they are there for."""
    from srt.layers.attention import triton_backend as tb
    from srt.model_executor.decode_warmup import warmup_extend_splits

    seen = []
    fwd = tb.extend_attention_fwd
    monkeypatch.setattr(
        tb, "extend_attention_fwd", lambda *a, **k: (seen.append(k["num_splits"]), fwd(*a, **k))
    )
    eng = _triton_engine(2100)
    try:
        runner = eng.scheduler.runner
        runner.attn_backend._num_sms = 132
        seen.clear()
        _only_padding_written(runner.token_to_kv_pool, lambda: warmup_extend_splits(runner))
        assert max(seen) == 2
    finally:
        eng.shutdown()
