"""Tensor parallelism end to end: TP 2 (gloo, spawned ranks) gives the same greedy tokens and
logits as TP 1 for the tiny Llama and gpt-oss (dummy weights, identical at every TP size);
replicated KV heads; torchrun launch; errors and shutdown without hangs. GPU: bf16 TP 2 vs TP 1,
CUDA-graph replay with NCCL all-reduce inside."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

import srt
from tests.srt.distributed.tp_harness import TINY_GPT_OSS, free_port, run_ranks, runner_logits

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [100], list(range(40, 73))]  # lengths 7, 1, 33
GREEDY = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}
SAMPLED = {"max_new_tokens": 6, "temperature": 0.8, "top_p": 0.9, "seed": 3, "ignore_eos": True}
CPU = dict(device="cpu", dtype="float32", skip_tokenizer_init=True, max_total_tokens=512)


def _run_engine(tp: int, **kw) -> tuple[list, list]:
    engine = srt.Engine(tp_size=tp, **CPU, **kw)
    try:
        outs = engine.generate(
            input_ids=PROMPTS + [PROMPTS[0]],
            sampling_params=[GREEDY] * len(PROMPTS) + [SAMPLED],
            return_logprob=True,
            logprob_start_len=[0, 0, 3, -1],  # prompt logprobs: chunked LM head, all-gathered
            top_logprobs_num=2,
        )
        if tp > 1:  # a bad request fails on every rank alike; the engine stays usable
            with pytest.raises(ValueError, match="vocabulary"):
                engine.generate(input_ids=[5000], sampling_params=GREEDY)  # one request raises
            again = engine.generate(input_ids=PROMPTS[1], sampling_params=GREEDY)
            assert again["output_ids"] == outs[1]["output_ids"]
            # the prefix cache on every rank alike (off for gpt-oss's hybrid pool): a repeat
            # hits it, flush_cache drops it on all ranks, and the tokens stay the same
            cached = engine.generate(input_ids=PROMPTS[2], sampling_params=GREEDY)
            hit = cached["meta_info"]["cached_tokens"]
            assert hit > 0 or "json_model_override_args" in kw
            assert engine.flush_cache() is True
            fresh = engine.generate(input_ids=PROMPTS[2], sampling_params=GREEDY)
            assert fresh["meta_info"]["cached_tokens"] == 0
            assert cached["output_ids"] == fresh["output_ids"] == outs[2]["output_ids"]
            procs = engine._tp_workers.procs
    finally:
        engine.shutdown()
    if tp > 1:
        assert not any(p.is_alive() for p in procs), "TP workers outlived shutdown()"
        with pytest.raises(RuntimeError, match="shutdown"):
            engine.generate(input_ids=[1], sampling_params=GREEDY)
    lps = [
        o["output_token_logprobs"]
        + [e[0] for e in o["meta_info"]["input_token_logprobs"][1:]]
        + [e[0] for row in o["meta_info"]["output_top_logprobs"] for e in row]
        for o in outs
    ]
    return [o["output_ids"] for o in outs], lps


@pytest.mark.parametrize("model", ["llama", "gpt_oss"])
def test_engine_tp2_same_tokens_as_tp1(model):
    kw = {} if model == "llama" else {"json_model_override_args": json.dumps(TINY_GPT_OSS)}
    ids1, lp1 = _run_engine(1, **kw)
    ids2, lp2 = _run_engine(2, **kw)
    assert all(len(x) == 6 for x in ids1)
    assert ids2 == ids1
    for a, b in zip(lp2, lp1, strict=True):
        np.testing.assert_allclose(np.array(a), np.array(b), atol=1e-4, rtol=1e-4)


def test_replicated_kv_heads_paged_unfused_logits_match_tp1():
    """1 KV head on 2 ranks (replicated), page_size 4, unfused KV write: every logit of the
    prefill and of 4 teacher-forced decode steps matches TP 1 (fp32)."""
    cfg = {"num_key_value_heads": 1, "vocab_size": 1023}  # 1023: padded LM-head slice
    kw = dict(
        device="cpu",
        dtype="float32",
        max_total_tokens=512,
        page_size=4,
        enable_fused_rope_kv=False,
        json_model_override_args=json.dumps(cfg),
    )
    forced = [[7, 8, 9], [10, 11, 12], [1, 2, 3], [4, 5, 6]]
    ref = runner_logits(kw, PROMPTS, forced)["eager"]
    ranks = run_ranks(runner_logits, 2, {**kw, "tp_size": 2}, PROMPTS, forced)
    for step, want in enumerate(ref):
        assert want.shape[-1] == 1023
        np.testing.assert_array_equal(ranks[0]["eager"][step], ranks[1]["eager"][step])
        np.testing.assert_allclose(ranks[0]["eager"][step], want, atol=2e-5, rtol=1e-4)


def test_torchrun_launch_matches_tp1(tmp_path):
    out = tmp_path / "ids.json"
    script = os.path.join(os.path.dirname(__file__), "torchrun_engine.py")
    env = {**os.environ, "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(free_port()),
        script,
        str(out),
    ]
    proc = subprocess.run(cmd, timeout=180, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    engine = srt.Engine(**CPU)
    ref = engine.generate(input_ids=[[5, 6, 7], [9] * 33, [3]], sampling_params=GREEDY)
    engine.shutdown()
    assert json.loads(out.read_text()) == [o["output_ids"] for o in ref]


def test_rank_failures_raise_instead_of_hanging():
    """A start-up error on every rank comes back as that error; a rank that dies mid-life makes
    the next call fail (no hang) and stops the other ranks."""
    with pytest.raises(ValueError, match="num_heads"):
        srt.Engine(tp_size=3, **CPU)  # 4 query heads do not split over 3 ranks
    engine = srt.Engine(tp_size=2, dist_timeout=30, **CPU)
    procs = engine._tp_workers.procs
    long = {**GREEDY, "max_new_tokens": 400}
    killer = threading.Timer(1.0, procs[1].kill)  # rank 1 dies in the middle of decoding
    start = time.monotonic()
    killer.start()
    with pytest.raises(RuntimeError, match="TP ranks failed"):
        engine.generate(input_ids=PROMPTS, sampling_params=long)
    killer.join()
    assert time.monotonic() - start < 60
    assert not any(p.is_alive() for p in procs)
    with pytest.raises(RuntimeError, match="shut down"):
        engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    engine.shutdown()


def test_tp_size_without_group_is_refused():
    from srt.model_executor.model_runner import ModelRunner
    from srt.server_args import ServerArgs

    with pytest.raises(RuntimeError, match="TP group"):
        ModelRunner(ServerArgs(device="cpu", tp_size=2))


# ---- GPU: the lead runs these on 2 GPUs ----
two_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"
)


@two_gpus
@pytest.mark.parametrize("model", ["llama", "gpt_oss"])
def test_gpu_tp2_bf16_close_to_tp1_and_graphs_equal_eager(model):
    """NCCL TP 2, bf16: CUDA-graph replays (all-reduce captured) equal eager decode bit for bit
    and the two ranks agree; logits match TP 1 within bf16 tolerance."""
    over = {} if model == "llama" else TINY_GPT_OSS
    kw = dict(
        device="cuda",
        dtype="bfloat16",
        max_total_tokens=4096,
        cuda_graph_max_bs=8,
        context_length=256,
        json_model_override_args=json.dumps(over),
    )
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (1, 7, 33, 5, 2)]
    forced = torch.randint(3, 1000, (8, len(prompts)), generator=g).tolist()
    ref = runner_logits(kw, prompts, forced, modes=("eager",))["eager"]
    ranks = run_ranks(
        runner_logits,
        2,
        {**kw, "tp_size": 2},
        prompts,
        forced,
        ("graph", "eager"),
        backend="nccl",
    )
    errs = []  # per (step, request) row: max |TP 2 - TP 1| / max |TP 1|
    for step, want in enumerate(ref):
        r0 = ranks[0]
        np.testing.assert_array_equal(r0["graph"][step], r0["eager"][step])
        np.testing.assert_array_equal(r0["graph"][step], ranks[1]["graph"][step])
        errs += list(np.abs(r0["graph"][step] - want).max(1) / np.abs(want).max(1).clip(1e-6))
    errs = np.array(errs)
    # A near-tie in the MoE router can flip an expert choice under bf16 rounding: one row then
    # differs by ~0.3 (seen for TP 1 bf16 vs fp32 alone on CPU, and for TP 2 vs TP 1 on 2 H200s).
    # A sharding bug would move every row, so at most one outlier row is allowed for the MoE.
    outliers = int((errs >= 0.05).sum())
    assert outliers <= (1 if model == "gpt_oss" else 0), f"rows over 0.05: {np.sort(errs)[-3:]}"
    assert np.median(errs) < 0.02, f"median relative error {np.median(errs):.3g}"


@two_gpus
def test_gpu_engine_tp2_generates_with_cuda_graphs():
    engine = srt.Engine(
        device="cuda",
        tp_size=2,
        skip_tokenizer_init=True,
        max_total_tokens=4096,
        cuda_graph_max_bs=8,
        context_length=256,
    )
    try:
        outs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    finally:
        engine.shutdown()
    assert [len(o["output_ids"]) for o in outs] == [6] * len(PROMPTS)


def _hf_checkpoint(path, arch: str) -> None:
    """A tiny random HF checkpoint: separate q/k/v and gate/up (Llama); interleaved gate/up
    experts, biases and sinks (gpt-oss), all non-zero."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    common = dict(
        vocab_size=161,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        initializer_range=0.1,
    )
    if arch in ("llama", "qwen3"):
        name = "Llama" if arch == "llama" else "Qwen3"
        cfg = getattr(transformers, f"{name}Config")(intermediate_size=96, **common)
        model = getattr(transformers, f"{name}ForCausalLM")(cfg)
    else:
        cfg = transformers.GptOssConfig(
            intermediate_size=32,
            num_local_experts=5,
            num_experts_per_tok=2,
            sliding_window=5,
            swiglu_limit=0.5,
            **common,
        )
        model = transformers.GptOssForCausalLM(cfg)
    with torch.no_grad():  # HF zero-inits biases and sinks; make them matter
        for name, p in model.named_parameters():
            if name.endswith(("bias", "sinks")):
                p.copy_(torch.randn(p.shape) * 0.3)
    model.float().save_pretrained(str(path))


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gpt_oss"])
def test_hf_checkpoint_tp2_logits_match_tp1(tmp_path, arch):
    """Checkpoint loading shards every tensor (q/k/v, gate/up, experts, sinks, vocab padded
    161 -> 162): TP 2 logits of prefill and teacher-forced decode equal TP 1 (fp32)."""
    _hf_checkpoint(tmp_path, arch)
    kw = dict(
        model_path=str(tmp_path),
        device="cpu",
        dtype="float32",
        max_total_tokens=256,
        skip_tokenizer_init=True,
    )
    prompts = [[5, 6, 7, 8, 9, 10, 11], [100], list(range(40, 73))]
    forced = [[7, 8, 9], [10, 11, 12], [1, 2, 3]]
    ref = runner_logits(kw, prompts, forced)["eager"]
    ranks = run_ranks(runner_logits, 2, {**kw, "tp_size": 2}, prompts, forced)
    for step, want in enumerate(ref):
        assert want.shape[-1] == 161 and np.abs(want).max() > 0.1
        np.testing.assert_array_equal(ranks[0]["eager"][step], ranks[1]["eager"][step])
        np.testing.assert_allclose(ranks[0]["eager"][step], want, atol=2e-5, rtol=1e-4)
