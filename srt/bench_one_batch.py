"""Benchmark one static batch: prefill, then decode, fused vs unfused RoPE + KV write.

    python -m srt.bench_one_batch                      # embedded tiny model, this machine's device
    python -m srt.bench_one_batch --model-preset llama3-8b --batch-size 1 8 32 64 \
        --input-len 512 --output-len 128 --run-name h100
    python -m srt.bench_one_batch --correctness-test   # check outputs instead of timing them

SGLang's convention and flags. For every variant (fused / unfused RoPE+KV write, and on CUDA
eager / CUDA graph) and every (batch size, input length, output length) it warms that shape up,
then prints the prefill latency (median of 3 prefills) and tokens/s, the median decode-step
latency (forward + greedy sampling) beside its read floor (weights + KV read / measured copy
bandwidth; n/a on CPU) and the host time of preparing each step's batch (not in the step; the
Engine's overlapped decode hides it under the previous step), and decode tokens/s; rows are
appended to ``--result-filename`` with SGLang's field names. It ends with a line saying whether
all variants produced the same output tokens, and exits 1 when they did not.
``--correctness-test`` (srt/bench_correctness.py) decodes real prompts instead.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import json
import logging
import os
import statistics
import sys
import time
from collections.abc import Iterator
from typing import Any

import torch

from srt import settings
from srt.bench_args import (
    build_parser,
    build_server_args,
    check_lengths,
    check_model_path,
    parse_args,
)
from srt.server_args import ServerArgs
from srt.utils.cli import run_cli

EXIT_MISMATCH = 1
PREFILL_REPEATS = 3  # timed prefills per shape; the median is reported


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _profiled(fn: Any, device: torch.device, trace_path: str) -> Any:
    """Run ``fn()`` under the torch profiler, export a chrome trace, print the top kernels."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        out = fn()
        _sync(device)
    os.makedirs(os.path.dirname(os.path.abspath(trace_path)), exist_ok=True)
    prof.export_chrome_trace(trace_path)
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=15), flush=True)
    print(f"torch profiler trace of one decode step: {trace_path}", flush=True)
    return out


def run_batch(
    runner: Any,
    bs: int,
    input_len: int,
    output_len: int,
    use_graph: bool,
    seed: int,
    trace_path: str | None = None,
) -> dict[str, Any]:
    """Prefill bs random prompts, then greedy-decode output_len tokens; time both phases.

    The prefill runs PREFILL_REPEATS times (the requests' memory freed in between); its latency
    is the median. The decode continues from the last one.

    With ``trace_path`` the decode step at ``output_len // 2`` (SGLang's default) runs under the
    torch profiler and is left out of the median.
    """
    from srt.managers.schedule_batch import Req, ScheduleBatch
    from srt.sampling.sampling_params import SamplingParams

    dev = runner.device
    vocab = int(runner.model_config.vocab_size)
    g = torch.Generator().manual_seed(seed + bs)
    prompts = torch.randint(0, vocab, (bs, input_len), generator=g).tolist()
    params = SamplingParams(max_new_tokens=output_len, temperature=0.0, ignore_eos=True)
    reqs = [Req(i, p, params) for i, p in enumerate(prompts)]
    sb = ScheduleBatch.from_runner(runner)
    profile_step = output_len // 2 if trace_path else -1
    try:
        prefill_runs = []
        for rep in range(PREFILL_REPEATS):  # the median of a few prefills: one sample is noisy
            if rep:
                for r in reqs:
                    sb.free_req(r)
            ids, prefill_s = [], 0.0
            for group in prefill_groups(sb, reqs):  # one group unless the window pool is small
                fb = sb.prepare_for_extend(group)
                _sync(dev)
                t0 = time.perf_counter()
                ids += runner.greedy_ids(runner.forward(fb))  # [len(group)]
                prefill_s += time.perf_counter() - t0
                sb.evict_swa(group)  # window pages no later query reads (hybrid pool)
            prefill_runs.append(prefill_s)
        prefill_s = statistics.median(prefill_runs)
        outputs = [[t] for t in ids]
        steps, prepares = [], []
        for i in range(output_len - 1):
            for r, t in zip(reqs, ids, strict=True):
                r.output_ids = [t]
            t_prep = time.perf_counter()
            fb = sb.prepare_for_decode(reqs)
            _sync(dev)
            t0 = time.perf_counter()
            prepares.append(t0 - t_prep)
            if trace_path is not None and i == profile_step:

                def step(fb: Any = fb) -> list[int]:
                    return runner.greedy_ids(runner.forward(fb, use_graph))

                ids = _profiled(step, dev, trace_path)
            else:
                ids = runner.greedy_ids(runner.forward(fb, use_graph))
                steps.append(time.perf_counter() - t0)
            sb.evict_swa(reqs)
            for out, t in zip(outputs, ids, strict=True):
                out.append(t)
    finally:
        for r in reqs:
            sb.free_req(r)
    step_s = statistics.median(steps) if steps else float("nan")
    total = prefill_s + sum(steps)
    return {
        # SGLang's result.jsonl fields
        "batch_size": bs,
        "input_len": input_len,
        "output_len": output_len,
        "prefill_latency": prefill_s,
        "prefill_throughput": bs * input_len / prefill_s,
        "median_decode_latency": step_s,
        # host time of the batch's preparation before each step (slots, upload), which the step
        # leaves out; SGLang's bench_one_batch counts it in its decode latency
        "median_prepare_latency": statistics.median(prepares) if prepares else float("nan"),
        "median_decode_throughput": bs / step_s if steps else float("nan"),
        "total_latency": total,
        "overall_throughput": bs * (input_len + len(steps) + 1) / total,
        # the names the earlier versions used (benchmarks/bench_e2e.py reads them)
        "prefill_latency_s": prefill_s,
        "prefill_tokens_per_s": bs * input_len / prefill_s,
        "decode_step_latency_s": step_s,
        "decode_tokens_per_s": bs / step_s if steps else float("nan"),
        "output_ids": outputs,
    }


def prefill_groups(sb: Any, reqs: list[Any]) -> list[list[Any]]:
    """The requests in prefill batches that fit the window pool of a hybrid KV pool (a
    prefill holds window slots for every prompt token; the scheduler would split it the same
    way). One batch with a uniform pool."""
    if not sb.is_swa:
        return [reqs]
    from srt.mem_cache.kv_memory import swa_tokens_per_request

    ps = sb.page_size
    keep = swa_tokens_per_request(sb.sliding_window_size, ps)  # per prefilled request
    room = sb.allocator.swa_available_size() - len(reqs) * keep
    groups: list[list[Any]] = [[]]
    used = 0
    for r in reqs:
        need = -(-len(r.origin_input_ids) // ps) * ps
        if groups[-1] and used + need > room:
            groups.append([])
            used = 0
        groups[-1].append(r)
        used += need
    return groups


def _trace_path(args: argparse.Namespace, variant: str, graph: bool, shape: tuple) -> str:
    bs, il, ol = shape
    folder = settings.get().torch_profiler_dir
    name = f"{args.profile_prefix}_{variant}_graph{int(graph)}_batch{bs}_input{il}_output{ol}"
    return os.path.join(folder, f"{name}_decode.trace.json.gz")


def _fmt_row(name: str, graph: bool, r: dict[str, Any]) -> str:
    floor = r["decode_floor_latency"]
    step = r["median_decode_latency"]
    floor_s = f"{floor * 1e3:8.3f} ms, {step / floor:4.2f}x" if floor else f"{'n/a':>18s}"
    return (
        f"{name:8s} graph={int(graph)} bs={r['batch_size']:4d} in={r['input_len']:5d} "
        f"out={r['output_len']:4d} | prefill {r['prefill_latency'] * 1e3:9.2f} ms "
        f"{r['prefill_throughput']:10.0f} tok/s | decode step {step * 1e3:8.3f} ms "
        f"(floor {floor_s}, + prepare {r['median_prepare_latency'] * 1e3:6.3f} ms) | "
        f"decode {r['median_decode_throughput']:10.1f} tok/s"
    )


def _is_rank0() -> bool:
    from srt.distributed import get_tp_rank, model_parallel_is_initialized

    return not model_parallel_is_initialized() or get_tp_rank() == 0


def latency_test(args: argparse.Namespace, model_config: Any) -> list[dict[str, Any]]:
    """Every variant x (batch size, input length, output length): warm-up, then a timed run."""
    from srt.model_executor.model_runner import ModelRunner
    from srt.utils.decode_floor import decode_reads, measure_copy_bandwidth

    say = print if _is_rank0() else (lambda *a, **k: None)
    results: list[dict[str, Any]] = []
    fused_modes = [False] if args.disable_fused_rope_kv else [True, False]
    model = None
    bandwidth = None
    shapes = list(itertools.product(args.batch_size, args.input_len, args.output_len))
    for fused in fused_modes:
        sargs = build_server_args(args, fused)
        assert sargs.device is not None  # build_server_args resolves the device
        device = torch.device(sargs.device)
        if bandwidth is None and device.type == "cuda" and model is None:
            bandwidth = measure_copy_bandwidth(device)  # before the weights
            if bandwidth:
                say(f"# device copy bandwidth: {bandwidth / 1e9:.0f} GB/s (1 GiB, read + write)")
        runner = ModelRunner(sargs, model_config, model)  # the second variant reuses the weights
        model, model_config = runner.model, runner.model_config
        graph_modes = [False] + ([True] if runner.cuda_graph_runner is not None else [])
        if args.no_eager and len(graph_modes) > 1:
            graph_modes = [True]
        name = "fused" if fused else "unfused"
        say(
            f"# {name}: device={runner.device} dtype={runner.dtype} kv={runner.kv_dtype} "
            f"backend={sargs.attention_backend} page_size={sargs.page_size} "
            f"graphs={runner.cuda_graph_runner is not None}",
            flush=True,
        )
        say(f"# {runner.kv_memory_report.describe()}", flush=True)
        for use_graph in graph_modes:
            warmed: set[tuple[int, int]] = set()
            for bs, il, ol in shapes:
                if (bs, il) not in warmed:  # compile/tune this prefill and decode shape first
                    with _rope_report(sargs, runner, use_graph, say):
                        run_batch(runner, bs, il, min(ol, 4), use_graph, args.seed)
                    warmed.add((bs, il))
                trace = _trace_path(args, name, use_graph, (bs, il, ol)) if args.profile else None
                r = run_batch(runner, bs, il, ol, use_graph, args.seed, trace)
                reads = decode_reads(runner, bs, il + ol // 2)
                r.update(
                    run_name=args.run_name,
                    variant=name,
                    cuda_graph=use_graph,
                    device=str(runner.device),
                    model=args.model_preset or args.model_path or "tiny",
                    decode_floor_latency=reads.total / bandwidth if bandwidth else None,
                    decode_weight_bytes=reads.weight_bytes,
                    decode_kv_bytes=reads.kv_bytes,
                    copy_bandwidth=bandwidth,
                    **kv_report_fields(runner.kv_memory_report),
                )
                results.append(r)
                say(_fmt_row(name, use_graph, r), flush=True)
        runner.cuda_graph_runner = None
        del runner
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    mark_matches(results)
    if _is_rank0():
        _summary(results)
    return results


@contextlib.contextmanager
def _rope_report(sargs: ServerArgs, runner: Any, use_graph: bool, say: Any) -> Iterator[None]:
    """With an SGLang model file (eager runs): say how many of its RoPE calls went fused."""
    if sargs.model_impl != "sglang" or use_graph:
        yield
        return
    from srt.compat.sglang_model import count_rope_calls

    with count_rope_calls(runner.model) as counts:
        yield
    say(f"# SGLang model file {sargs.model_file}: {counts.describe()}", flush=True)


def kv_report_fields(report: Any) -> dict[str, Any]:
    """The memory report as result-row fields."""
    return dict(
        kv_hybrid_swa=report.shape.num_swa_layers > 0,
        kv_full_bytes_per_token=report.shape.full_bytes_per_token,
        kv_swa_bytes_per_token=report.shape.swa_bytes_per_token,
        kv_max_total_num_tokens=report.max_total_num_tokens,
        kv_swa_max_total_num_tokens=report.swa_max_total_num_tokens,
        kv_uniform_max_total_num_tokens=report.uniform_max_total_num_tokens,
        kv_total_bytes=report.total_bytes,
    )


def mark_matches(results: list[dict[str, Any]]) -> None:
    """Set ``tokens_match`` (and ``passed``): same output ids as the first result of the shape."""
    ref: dict[tuple[int, int, int], Any] = {}
    for r in results:
        key = (r["batch_size"], r["input_len"], r["output_len"])
        r["tokens_match"] = r["passed"] = r["output_ids"] == ref.setdefault(key, r["output_ids"])


def _summary(results: list[dict[str, Any]]) -> None:
    by_key = {(r["variant"], r["cuda_graph"], r["batch_size"], r["input_len"]): r for r in results}
    for (variant, graph, bs, il), r in sorted(by_key.items()):
        u = by_key.get(("unfused", graph, bs, il))
        if variant == "fused" and u is not None:
            gain = r["decode_tokens_per_s"] / u["decode_tokens_per_s"] - 1
            print(f"fused vs unfused graph={int(graph)} bs={bs} in={il}: decode {gain * 100:+.1f}%")
    mismatches = [
        f"{r['variant']}/graph={int(r['cuda_graph'])}/bs={r['batch_size']}/in={r['input_len']}"
        for r in results
        if not r["tokens_match"]
    ]
    variants = sorted({(r["variant"], r["cuda_graph"]) for r in results})
    names = ", ".join(f"{v}{'+graph' if g else ''}" for v, g in variants)
    if mismatches:
        print(f"output tokens: MISMATCH between variants ({names}): {', '.join(mismatches)}")
    else:
        print(f"output tokens: MATCH across all variants ({names})")


RESULT_FIELDS = (
    "run_name",
    "batch_size",
    "input_len",
    "output_len",
    "prefill_latency",
    "prefill_throughput",
    "median_decode_latency",
    "median_decode_throughput",
    "median_prepare_latency",
    "total_latency",
    "overall_throughput",
    "variant",
    "cuda_graph",
    "device",
    "model",
    "decode_floor_latency",
    "tokens_match",
    "kv_hybrid_swa",
    "kv_full_bytes_per_token",
    "kv_swa_bytes_per_token",
    "kv_max_total_num_tokens",
    "kv_uniform_max_total_num_tokens",
)


def write_results(args: argparse.Namespace, results: list[dict[str, Any]]) -> None:
    """Append SGLang-style rows to --result-filename; write --json-out (rank 0 only)."""
    if not _is_rank0():
        return
    if args.result_filename:
        with open(args.result_filename, "a", encoding="utf-8") as f:
            for r in results:
                f.write(json.dumps({k: r.get(k) for k in RESULT_FIELDS}) + "\n")
    if args.json_out:
        with open(args.json_out, "w", encoding="utf-8") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Run the benchmark (or the correctness test); return one dict per measurement, each with
    ``passed`` (its tokens match the other variants'). Bad input raises CLIError / ValueError
    before anything is allocated."""
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(message)s", stream=sys.stderr)
    check_model_path(args)
    started_tp = False
    if args.tp_size > 1:
        from srt.distributed import init_distributed_environment, model_parallel_is_initialized

        if not model_parallel_is_initialized():
            dev = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
            init_distributed_environment(args.tp_size, backend="nccl" if dev == "cuda" else "gloo")
            started_tp = True
    try:
        from srt.model_executor.model_builder import build_model_config

        model_config = build_model_config(build_server_args(args, True))
        if args.correctness_test:
            from srt.bench_correctness import correctness_test

            return correctness_test(args, model_config)
        check_lengths(model_config, args, args.input_len)
        results = latency_test(args, model_config)
        write_results(args, results)
        return results
    finally:
        if started_tp:
            from srt.distributed import destroy_distributed_environment

            destroy_distributed_environment()


__all__ = ["build_parser", "build_server_args", "cli_main", "main", "parse_args", "run_batch"]


def cli_main(argv: list[str] | None = None) -> int:
    """``python -m srt.bench_one_batch``: 0 when all outputs match, 1 on a mismatch, 2 on bad
    input (one ``error:`` line; ``--debug`` adds the traceback)."""
    debug = "--debug" in (sys.argv[1:] if argv is None else argv)

    def body() -> int:
        results = main(argv)
        return 0 if all(r["passed"] for r in results) else EXIT_MISMATCH

    return run_cli(body, debug)


if __name__ == "__main__":
    sys.exit(cli_main())
