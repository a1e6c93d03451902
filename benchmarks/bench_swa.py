"""Hybrid sliding-window KV pool vs the uniform pool on gpt-oss-20b (dummy weights), through the
Engine's scheduler: the same KV memory (mem_fraction_static), N long prompts at once.

Prints per pool: the memory report (bytes per token of full and window layers, tokens that fit),
the most requests that ran at once, prefill steps, and decode tokens/s (generated tokens over
the wall time of the decode steps, measured with CUDA syncs after a warm-up request).

    python benchmarks/bench_swa.py --num-prompts 64 --input-len 4096 --output-len 64 --kv-gib 8
"""

from __future__ import annotations

import argparse
import gc
import time

import torch

import srt
from srt.model_executor.model_builder import preset_overrides


def kv_tokens(args: argparse.Namespace, hybrid: bool) -> int | None:
    """max_total_tokens that puts the pool in `--kv-gib` GiB (None: sized by the memory
    fraction): uniform = budget / bytes per token; hybrid = what `hybrid_token_capacity` leaves
    for the full pool after the window pool."""
    if args.kv_gib is None:
        return None
    from srt.configs.model_config import ModelConfig
    from srt.mem_cache.kv_memory import KVCacheShape, hybrid_token_capacity
    from srt.model_executor.model_builder import PRESETS

    cfg = ModelConfig.from_hf(dict(PRESETS[args.model_preset]))
    n = int(cfg.num_hidden_layers)
    windows = [int(cfg.get_window_left(i)) for i in range(n)]
    n_swa = sum(w > 0 for w in windows) if hybrid else 0
    kv_heads, d = int(cfg.num_key_value_heads), int(cfg.head_dim)
    shape = KVCacheShape(n - n_swa, n_swa, kv_heads, d, d, 2)  # bf16 cache
    budget = int(args.kv_gib * 2**30)
    if not hybrid:
        return budget // shape.uniform_bytes_per_token - 1
    ctx = args.input_len + args.output_len + 8
    rep = hybrid_token_capacity(budget, shape, max(windows), 1, args.num_prompts, ctx)
    return rep.max_total_num_tokens


def run(args: argparse.Namespace, hybrid: bool) -> dict:
    eng = srt.Engine(
        max_total_tokens=kv_tokens(args, hybrid),
        load_format="dummy",
        device="cuda",
        skip_tokenizer_init=True,
        json_model_override_args=preset_overrides(args.model_preset),
        context_length=args.input_len + args.output_len + 8,
        mem_fraction_static=args.mem_fraction_static,
        max_running_requests=args.num_prompts,
        cuda_graph_max_bs=min(args.num_prompts, 256),
        disable_hybrid_swa_memory=not hybrid,
    )
    try:
        return _measure(eng, args, hybrid)
    finally:  # _measure's frame (which held the scheduler, hence the model) is gone by now
        eng.shutdown()
        torch.cuda.empty_cache()


def _measure(eng: srt.Engine, args: argparse.Namespace, hybrid: bool) -> dict:
    rep = eng.model_runner.kv_memory_report
    print(f"# {'hybrid' if hybrid else 'uniform'}: {rep.describe()}", flush=True)
    g = torch.Generator().manual_seed(0)
    vocab = int(eng.model_runner.model_config.vocab_size)
    sp = {"max_new_tokens": args.output_len, "temperature": 0.0, "ignore_eos": True}
    warm = torch.randint(0, vocab, (2, args.input_len), generator=g).tolist()
    eng.generate(input_ids=warm, sampling_params=sp)  # compile / warm-up
    prompts = torch.randint(0, vocab, (args.num_prompts, args.input_len), generator=g)
    sched = eng.scheduler
    peak, decode_s, decode_tokens, prefill_s = 0, 0.0, 0, 0.0
    step = sched.step

    def timed_step():
        nonlocal peak, decode_s, decode_tokens, prefill_s
        n_prefill = sched.num_prefill_steps
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = step()
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        peak = max(peak, len(sched.running) + len(out))
        if sched.num_prefill_steps > n_prefill:
            prefill_s += dt
        else:
            decode_s += dt
            decode_tokens += len(sched.running) + len(out)
        return out

    sched.step = timed_step
    steps0 = sched.num_prefill_steps
    t0 = time.perf_counter()
    outs = eng.generate(input_ids=prompts.tolist(), sampling_params=sp)
    wall = time.perf_counter() - t0
    sched.step = step
    assert all(len(o["output_ids"]) == args.output_len for o in outs)
    return dict(
        pool="hybrid" if hybrid else "uniform",
        max_tokens=rep.max_total_num_tokens,
        peak_running=peak,
        prefill_steps=sched.num_prefill_steps - steps0,
        decode_tok_s=decode_tokens / decode_s if decode_s else float("nan"),
        prefill_s=prefill_s,
        wall_s=wall,
        out_tok_s=args.num_prompts * args.output_len / wall,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-preset", default="gpt-oss-20b")
    p.add_argument("--num-prompts", type=int, default=96)
    p.add_argument("--input-len", type=int, default=4096)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--mem-fraction-static", type=float, default=0.85)
    p.add_argument(
        "--kv-gib",
        type=float,
        default=None,
        help="give both pools this many GiB of KV memory (else the memory fraction sizes them)",
    )
    args = p.parse_args()
    rows = []
    for hybrid in (True, False):
        try:
            rows.append(run(args, hybrid))
        except Exception as e:  # noqa: BLE001 - report and go on with the other pool
            print(f"# {'hybrid' if hybrid else 'uniform'} failed: {type(e).__name__}: {e}")
        gc.collect()  # the first engine's weights must be gone before the second one sizes its pool
        torch.cuda.empty_cache()
    for r in rows:
        print(
            f"{r['pool']:8s} max_tokens {r['max_tokens']:9d} | peak running {r['peak_running']:4d}"
            f" | prefill steps {r['prefill_steps']:3d} ({r['prefill_s']:7.2f} s) | decode"
            f" {r['decode_tok_s']:9.1f} tok/s | wall {r['wall_s']:7.2f} s,"
            f" {r['out_tok_s']:8.1f} out tok/s",
            flush=True,
        )


if __name__ == "__main__":
    main()
