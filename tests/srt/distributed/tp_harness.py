"""Run a function on N TP ranks (spawned processes, gloo on CPU / NCCL on CUDA) and collect the
results; plus rank functions that drive a ModelRunner with teacher-forced tokens."""

from __future__ import annotations

import queue
import socket
import traceback
from typing import Any

import numpy as np
import torch.multiprocessing as mp

TINY_GPT_OSS = {
    "architectures": ["GptOssForCausalLM"],
    "model_type": "gpt_oss",
    "vocab_size": 1024,
    "hidden_size": 64,
    "intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_local_experts": 5,
    "num_experts_per_tok": 2,
    "experts_per_token": 2,
    "sliding_window": 5,
    "layer_types": ["sliding_attention", "full_attention"],
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 1000.0,
    "rope_scaling": {
        "rope_type": "yarn",
        "factor": 4.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 32,
    },
    "attention_bias": True,
    "swiglu_limit": 0.5,
    "tie_word_embeddings": False,
    "eos_token_id": 2,
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, tp: int, addr: str, backend: str, fn, args: tuple, q) -> None:
    from srt.distributed import destroy_distributed_environment, init_distributed_environment

    try:
        init_distributed_environment(tp, rank, addr, backend, local_rank=rank, timeout_s=120)
        q.put((rank, "ok", fn(*args)))
    except BaseException:  # noqa: BLE001 - reported to the test
        q.put((rank, "error", traceback.format_exc()))
    finally:
        destroy_distributed_environment()


def run_ranks(fn, tp: int, *args: Any, backend: str = "gloo", timeout_s: float = 240) -> list:
    """fn(*args) on each of tp spawned ranks (the TP group initialised); results by rank."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    addr = f"tcp://127.0.0.1:{free_port()}"
    procs = [
        ctx.Process(target=_entry, args=(r, tp, addr, backend, fn, args, q), daemon=True)
        for r in range(tp)
    ]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    try:
        while len(out) < tp:
            try:
                rank, kind, val = q.get(timeout=timeout_s)
            except queue.Empty:
                raise TimeoutError(f"ranks {sorted(set(range(tp)) - set(out))} hung") from None
            if kind == "error":
                raise RuntimeError(f"rank {rank} failed:\n{val}")
            out[rank] = val
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.terminate()
    return [out[r] for r in range(tp)]


def runner_logits(
    server_kwargs: dict,
    prompts: list[list[int]],
    forced: list[list[int]],
    modes: tuple[str, ...] = ("eager",),
) -> dict[str, list[np.ndarray]]:
    """Build a ModelRunner (in this process's TP position); for each mode ("eager" or "graph":
    decode replays CUDA graphs) prefill `prompts`, then decode feeding forced[step][i] to request
    i. Returns mode -> float32 logits (numpy) of the prefill [B, V] and of every decode step."""
    from srt.managers.schedule_batch import Req, ScheduleBatch
    from srt.model_executor.model_runner import ModelRunner
    from srt.sampling.sampling_params import SamplingParams
    from srt.server_args import ServerArgs

    runner = ModelRunner(ServerArgs(**server_kwargs))
    if "graph" in modes and runner.cuda_graph_runner is None:
        raise RuntimeError("CUDA graphs were not captured")
    sb = ScheduleBatch.from_runner(runner)
    result = {}
    for mode in modes:
        reqs = [Req(i, list(p), SamplingParams()) for i, p in enumerate(prompts)]
        outs = [runner.forward(sb.prepare_for_extend(reqs)).float().cpu().numpy().copy()]
        for step in forced:
            for r, t in zip(reqs, step, strict=True):
                r.output_ids.append(int(t))
            logits = runner.forward(sb.prepare_for_decode(reqs), use_cuda_graph=mode == "graph")
            outs.append(logits.float().cpu().numpy().copy())
        for r in reqs:
            sb.free_req(r)
        result[mode] = outs
    return result
