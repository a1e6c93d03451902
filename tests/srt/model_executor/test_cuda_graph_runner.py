"""CUDA-graph decode: buckets, capture-mode reset, eager fallback (CPU); replay == eager (GPU).

GPU tests (skipped without CUDA) use the embedded tiny model when the model files are present,
else the stand-in model. `SRT_GRAPH_REPLAYS` sets the replay count of the memory test.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from runner_fakes import FakeConfig, patch_builder

from srt.managers.schedule_batch import Req, ScheduleBatch
from srt.model_executor import cuda_graph_runner as cgr
from srt.model_executor.cuda_graph_runner import CudaGraphRunner, get_batch_sizes_to_capture
from srt.model_executor.model_runner import ModelRunner
from srt.sampling.sampling_params import SamplingParams
from srt.server_args import ServerArgs

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_bucket_sizes():
    assert get_batch_sizes_to_capture(1) == [1]
    assert get_batch_sizes_to_capture(7) == [1, 2, 4, 7]
    assert get_batch_sizes_to_capture(8) == [1, 2, 4, 8]
    assert get_batch_sizes_to_capture(33) == [1, 2, 4, 8, 16, 24, 32, 33]
    assert get_batch_sizes_to_capture(64)[-3:] == [48, 56, 64]
    assert get_batch_sizes_to_capture(16, (3, 5, 99)) == [3, 5]
    with pytest.raises(ValueError, match="cuda_graph_max_bs"):
        get_batch_sizes_to_capture(0)


def _cpu_runner(monkeypatch) -> ModelRunner:
    patch_builder(monkeypatch)
    return ModelRunner(ServerArgs(device="cpu", max_total_tokens=64))


def test_capture_failure_resets_flags(monkeypatch):
    runner = _cpu_runner(monkeypatch)
    calls, seen = [], []
    monkeypatch.setattr(runner.token_to_kv_pool, "set_stream_overlap", calls.append)
    monkeypatch.setattr(cgr.torch.cuda, "Stream", lambda device=None: object())

    def boom(self, bs, stream):
        seen.append((self, self.is_capturing, runner.is_capturing is False))
        raise RuntimeError("capture exploded")

    monkeypatch.setattr(CudaGraphRunner, "_capture_one", boom)
    with pytest.raises(RuntimeError, match="capture exploded"):
        CudaGraphRunner(runner)
    graph_runner, capturing, _ = seen[0]
    assert capturing is True and graph_runner.is_capturing is False
    assert calls == [True, False]  # stream overlap on for the capture only


def test_capture_failure_falls_back_to_eager(monkeypatch):
    runner = _cpu_runner(monkeypatch)

    def fail(model_runner):
        raise RuntimeError("no graphs today")

    monkeypatch.setattr(cgr, "CudaGraphRunner", fail)
    with pytest.warns(RuntimeWarning, match="CUDA graph capture failed.*no graphs today"):
        runner._init_cuda_graphs()
    assert runner.cuda_graph_runner is None
    sb = ScheduleBatch.from_runner(runner, True)
    req = Req(0, [1, 2, 3], SamplingParams())
    assert runner.forward(sb.prepare_for_extend([req])).shape == (1, FakeConfig.vocab_size)


# ----------------------------------------------------------------------------- GPU
def _gpu_runner(monkeypatch, fused: bool, max_bs: int = 16) -> ModelRunner:
    try:
        import srt.model_loader as loader  # noqa: F401
        from srt.models import registry  # noqa: F401
    except ImportError:
        patch_builder(monkeypatch)
    args = ServerArgs(device="cuda", max_total_tokens=8192, cuda_graph_max_bs=max_bs,
                      max_running_requests=2 * max_bs, enable_fused_rope_kv=fused,
                      context_length=512)  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        runner = ModelRunner(args)
    failed = [str(w.message) for w in caught if "capture failed" in str(w.message)]
    assert not failed and runner.cuda_graph_runner is not None, failed
    return runner


def _start(runner, sb, raw_bs, seed):
    vocab = int(runner.model_config.vocab_size)
    g = torch.Generator().manual_seed(seed)
    reqs = []
    for i in range(raw_bs):
        n = int(torch.randint(1, 40, (1,), generator=g))
        reqs.append(Req(i, torch.randint(0, vocab, (n,), generator=g).tolist(), SamplingParams()))
    first = runner.forward(sb.prepare_for_extend(reqs)).argmax(-1).tolist()
    for r, t in zip(reqs, first, strict=True):
        r.output_ids.append(t)
    return reqs


@needs_cuda
@pytest.mark.parametrize("fused", [True, False])
def test_graph_replay_equals_eager_padded(monkeypatch, fused):
    runner = _gpu_runner(monkeypatch, fused)
    gr = runner.cuda_graph_runner
    pool = runner.token_to_kv_pool
    sb = ScheduleBatch.from_runner(runner, fused)
    for raw_bs in (3, 5, 13):  # padded to buckets 4, 8 and 16
        assert gr.bucket(raw_bs) > raw_bs
        graph_reqs = _start(runner, sb, raw_bs, seed=raw_bs)
        eager_reqs = _start(runner, sb, raw_bs, seed=raw_bs)
        for step in range(64):
            fb_g = sb.prepare_for_decode(graph_reqs)
            fb_e = sb.prepare_for_decode(eager_reqs)
            assert gr.can_run(fb_g)
            k_before = pool.get_key_buffer(0).clone()
            out_g = runner.forward(fb_g).clone()  # replay
            # Only this batch's slots and the padding slot 0 may change.
            changed = (pool.get_key_buffer(0) != k_before).flatten(1).any(1).nonzero().flatten()
            allowed = set(fb_g.out_cache_loc.tolist()) | {0}
            assert set(changed.tolist()) <= allowed, f"step {step}: padded rows wrote elsewhere"
            out_e = runner.forward(fb_e, use_cuda_graph=False)
            assert torch.equal(out_g, out_e), f"bs={raw_bs} step {step}: replay != eager"
            ids = out_g.argmax(-1).tolist()
            for a, b, t in zip(graph_reqs, eager_reqs, ids, strict=True):
                a.output_ids.append(t)
                b.output_ids.append(t)
        for r in graph_reqs + eager_reqs:
            sb.free_req(r)


@needs_cuda
def test_many_replays_stable_memory(monkeypatch):
    replays = int(os.environ.get("SRT_GRAPH_REPLAYS", "10000"))
    runner = _gpu_runner(monkeypatch, fused=True, max_bs=8)
    sb = ScheduleBatch.from_runner(runner, True)
    reqs = _start(runner, sb, 3, seed=0)
    fb = sb.prepare_for_decode(reqs)  # replayed again and again: same slots, same outputs
    first = runner.forward(fb).clone()
    torch.cuda.synchronize()
    mem = torch.cuda.memory_allocated()
    for _ in range(replays):
        out = runner.forward(fb)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == mem
    assert torch.equal(out, first)
