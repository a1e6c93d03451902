"""Benchmark one static batch: prefill, then decode, fused vs unfused RoPE + KV write.

    python -m srt.bench_one_batch                      # embedded tiny model, this machine's device
    python -m srt.bench_one_batch --model-preset llama3-8b --batch-size 1 8 32 64 \
        --input-len 512 --output-len 128 --json-out results.json

SGLang's convention and flags. For every variant (fused / unfused RoPE+KV write, and on CUDA
eager / CUDA graph) and batch size it prints the prefill latency, the median decode-step latency
(forward + greedy sampling), and decode tokens/s, and ends with a line saying whether all
variants produced the same output tokens.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from typing import Any

import torch

from srt.model_executor.model_builder import PRESETS, preset_overrides
from srt.server_args import ServerArgs


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m srt.bench_one_batch", description=__doc__.split("\n")[0]
    )
    p.add_argument("--model-path", default=None, help="HF checkpoint dir (default: tiny config)")
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy", "safetensors", "pt"])
    p.add_argument(
        "--model-preset",
        default=None,
        choices=sorted(PRESETS),
        help="dummy model of a real model's shape (implies dummy weights)",
    )
    p.add_argument("--batch-size", type=int, nargs="+", default=[1, 8])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--device", default=None, choices=["cuda", "cpu"])
    p.add_argument("--dtype", default="auto")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8_e4m3", "fp8_e5m2"])
    p.add_argument("--page-size", type=int, default=1)
    p.add_argument("--attention-backend", default=None, choices=["torch_native", "triton"])
    p.add_argument("--disable-cuda-graph", action="store_true")
    p.add_argument(
        "--no-eager", action="store_true", help="with CUDA graphs, skip the eager decode variant"
    )
    p.add_argument(
        "--disable-fused-rope-kv",
        action="store_true",
        help="run only the unfused path (RoPE op + set_kv_buffer)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", default=None, help="write the results as JSON to this file")
    args = p.parse_args(argv)
    if min(args.batch_size) < 1 or args.input_len < 1 or args.output_len < 1:
        p.error("--batch-size, --input-len and --output-len must be >= 1")
    return args


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_batch(
    runner: Any, bs: int, input_len: int, output_len: int, use_graph: bool, seed: int
) -> dict[str, Any]:
    """Prefill bs random prompts, then greedy-decode output_len tokens; time both phases."""
    from srt.managers.schedule_batch import Req, ScheduleBatch
    from srt.sampling.sampling_params import SamplingParams

    dev = runner.device
    vocab = int(runner.model_config.vocab_size)
    g = torch.Generator().manual_seed(seed + bs)
    prompts = torch.randint(0, vocab, (bs, input_len), generator=g).tolist()
    params = SamplingParams(max_new_tokens=output_len, temperature=0.0, ignore_eos=True)
    reqs = [Req(i, p, params) for i, p in enumerate(prompts)]
    sb = ScheduleBatch.from_runner(runner)
    try:
        fb = sb.prepare_for_extend(reqs)
        _sync(dev)
        t0 = time.perf_counter()
        next_ids = runner.forward(fb).argmax(dim=-1)  # [bs]
        ids = next_ids.tolist()
        prefill_s = time.perf_counter() - t0
        outputs = [[t] for t in ids]
        steps = []
        for _ in range(output_len - 1):
            for r, t in zip(reqs, ids, strict=True):
                r.output_ids = [t]
            fb = sb.prepare_for_decode(reqs)
            _sync(dev)
            t0 = time.perf_counter()
            ids = runner.forward(fb, use_graph).argmax(dim=-1).tolist()
            steps.append(time.perf_counter() - t0)
            for out, t in zip(outputs, ids, strict=True):
                out.append(t)
    finally:
        for r in reqs:
            sb.free_req(r)
    step = statistics.median(steps) if steps else float("nan")
    return {
        "batch_size": bs,
        "input_len": input_len,
        "output_len": output_len,
        "prefill_latency_s": prefill_s,
        "prefill_tokens_per_s": bs * input_len / prefill_s,
        "decode_step_latency_s": step,
        "decode_tokens_per_s": bs / step if steps else float("nan"),
        "output_ids": outputs,
    }


def build_server_args(args: argparse.Namespace, fused: bool) -> ServerArgs:
    max_bs = max(args.batch_size)
    ps = args.page_size
    per_req = -(-(args.input_len + args.output_len) // ps) * ps + ps
    return ServerArgs(
        model_path=args.model_path,
        load_format="dummy" if args.model_preset else args.load_format,
        device=args.device,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        page_size=ps,
        attention_backend=args.attention_backend,
        enable_fused_rope_kv=fused,
        disable_cuda_graph=args.disable_cuda_graph,
        cuda_graph_max_bs=max_bs,
        max_total_tokens=max_bs * per_req,
        max_running_requests=max_bs,
        context_length=args.input_len + args.output_len + 8 if args.model_path is None else None,
        random_seed=args.seed,
        json_model_override_args=preset_overrides(args.model_preset) if args.model_preset else "{}",
    ).resolved()


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    from srt.model_executor.model_runner import ModelRunner

    results: list[dict[str, Any]] = []
    fused_modes = [False] if args.disable_fused_rope_kv else [True, False]
    model = model_config = None
    for fused in fused_modes:
        sargs = build_server_args(args, fused)
        runner = ModelRunner(sargs, model_config, model)  # the second variant reuses the weights
        model, model_config = runner.model, runner.model_config
        graph_modes = [False] + ([True] if runner.cuda_graph_runner is not None else [])
        if args.no_eager and len(graph_modes) > 1:
            graph_modes = [True]
        name = "fused" if fused else "unfused"
        print(
            f"# {name}: device={runner.device} dtype={runner.dtype} kv={runner.kv_dtype} "
            f"backend={sargs.attention_backend} page_size={sargs.page_size} "
            f"graphs={runner.cuda_graph_runner is not None}",
            flush=True,
        )
        run_batch(runner, 1, min(args.input_len, 16), 3, graph_modes[-1], args.seed)  # warm-up
        for use_graph in graph_modes:
            for bs in args.batch_size:
                r = run_batch(runner, bs, args.input_len, args.output_len, use_graph, args.seed)
                r.update(
                    variant=name,
                    cuda_graph=use_graph,
                    device=str(runner.device),
                    model=args.model_preset or args.model_path or "tiny",
                )
                results.append(r)
                print(
                    f"{name:8s} graph={int(use_graph)} bs={bs:4d} | prefill "
                    f"{r['prefill_latency_s'] * 1e3:9.2f} ms | decode step "
                    f"{r['decode_step_latency_s'] * 1e3:8.3f} ms | decode "
                    f"{r['decode_tokens_per_s']:10.1f} tok/s",
                    flush=True,
                )
        runner.cuda_graph_runner = None
        del runner
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    _summary(results)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)
    return results


def _summary(results: list[dict[str, Any]]) -> None:
    by_key = {(r["variant"], r["cuda_graph"], r["batch_size"]): r for r in results}
    for (variant, graph, bs), r in sorted(by_key.items()):
        if variant == "fused" and ("unfused", graph, bs) in by_key:
            u = by_key[("unfused", graph, bs)]
            gain = r["decode_tokens_per_s"] / u["decode_tokens_per_s"] - 1
            print(f"fused vs unfused graph={int(graph)} bs={bs}: decode {gain * 100:+.1f}%")
    ref: dict[int, Any] = {}
    mismatches = []
    for r in results:
        first = ref.setdefault(r["batch_size"], r)
        if r["output_ids"] != first["output_ids"]:
            mismatches.append(f"{r['variant']}/graph={int(r['cuda_graph'])}/bs={r['batch_size']}")
    variants = sorted({(r["variant"], r["cuda_graph"]) for r in results})
    names = ", ".join(f"{v}{'+graph' if g else ''}" for v, g in variants)
    if mismatches:
        print(f"output tokens: MISMATCH between variants ({names}): {', '.join(mismatches)}")
    else:
        print(f"output tokens: MATCH across all variants ({names})")


if __name__ == "__main__":
    main()
    sys.exit(0)
