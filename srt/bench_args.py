"""The command line of ``python -m srt.bench_one_batch`` and the checks that need no GPU.

SGLang's flag names (model flags of its ServerArgs, benchmark flags of its BenchArgs), help on
every flag with its default shown. `add_model_args` / `validate_model_args` are the model flags
and their checks, shared with ``python -m srt.bench_serving``. `validate_args` and
`check_model_path` reject bad values before anything is built; `check_lengths` needs the model
config (its context length). `build_server_args` turns the flags into the runner's ServerArgs
(the latency test's and the correctness test's).
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch

from sgl_ext import settings as sgl_ext_settings
from srt.model_executor.model_builder import PRESETS, preset_overrides
from srt.server_args import DTYPES, ServerArgs
from srt.utils.cli import (
    ArgumentParser,
    CLIError,
    add_model_impl_args,
    check_model_impl_args,
    check_positive,
)


def build_parser() -> ArgumentParser:
    """The command line of ``python -m srt.bench_one_batch`` (SGLang's flag names)."""
    p = ArgumentParser(
        prog="python -m srt.bench_one_batch",
        description="Benchmark one static batch: prefill, then decode, fused vs unfused "
        "RoPE + KV write (SGLang's bench_one_batch).",
    )
    add_model_args(p.add_argument_group("model"))
    b = p.add_argument_group("benchmark")
    b.add_argument("--run-name", default="default", help="run_name of the result rows")
    b.add_argument("--batch-size", type=int, nargs="+", default=[1, 8], help="batch sizes")
    b.add_argument("--input-len", type=int, nargs="+", default=[128], help="prompt lengths")
    b.add_argument("--output-len", type=int, nargs="+", default=[32], help="tokens generated")
    b.add_argument(
        "--result-filename",
        default="result.jsonl",
        help="append one JSON row per measurement (SGLang's fields); '' to skip",
    )
    b.add_argument("--json-out", default=None, help="also write all results as one JSON file")
    b.add_argument(
        "--correctness-test",
        action="store_true",
        help="decode real prompts and check the outputs across variants instead of timing",
    )
    b.add_argument(
        "--cut-len",
        type=int,
        default=4,
        help="correctness test: prefill this many prompt tokens, then feed the rest one by one",
    )
    b.add_argument(
        "--profile",
        action="store_true",
        help="torch-profiler trace of one decode step per shape (in $SGLANG_TORCH_PROFILER_DIR)",
    )
    b.add_argument("--profile-prefix", default="profile", help="trace file name prefix")
    b.add_argument(
        "--no-eager", action="store_true", help="with CUDA graphs, skip the eager decode variant"
    )
    b.add_argument(
        "--disable-fused-rope-kv",
        action="store_true",
        help="run only the unfused path (RoPE op + set_kv_buffer)",
    )
    b.add_argument("--log-level", default="info", help="logging level (loading messages: info)")
    return p


def add_model_args(
    m: Any,
    pool_default: str = "just what the batch needs",
    graph_default: str = "max bs",
) -> None:
    """The model flags (SGLang's ServerArgs names) on a parser or argument group; shared by
    every job that builds a model runner or an Engine (bench_one_batch, bench_serving).
    ``pool_default`` / ``graph_default``: what the job does without --mem-fraction-static /
    --cuda-graph-max-bs (shown in --help)."""
    m.add_argument(
        "--model-path", default=None, help="HF checkpoint dir or Hub id (default: tiny config)"
    )
    m.add_argument(
        "--load-format",
        default="auto",
        choices=["auto", "dummy", "safetensors", "pt"],
        help="how weights are read; dummy = seeded random weights",
    )
    m.add_argument(
        "--model-preset",
        default=None,
        choices=sorted(PRESETS),
        help="dummy model of a real model's shape (implies dummy weights)",
    )
    m.add_argument("--device", default=None, choices=["cuda", "cpu"], help="default: cuda if any")
    m.add_argument("--dtype", default="auto", choices=DTYPES, help="auto: bf16 on CUDA, fp32 CPU")
    m.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "fp8_e4m3", "fp8_e5m2"],
        help="KV-cache dtype (auto = --dtype)",
    )
    m.add_argument("--page-size", type=int, default=1, help="KV-cache page size in tokens")
    m.add_argument(
        "--attention-backend",
        default=None,
        choices=["torch_native", "triton"],
        help="default: triton on CUDA, torch_native on CPU (triton on CPU: TRITON_INTERPRET=1)",
    )
    m.add_argument("--context-length", type=int, default=None, help="default: the model's")
    m.add_argument("--tp-size", type=int, default=1, help="tensor-parallel ranks (torchrun)")
    m.add_argument(
        "--mem-fraction-static",
        type=float,
        default=None,
        help=f"size the KV pool from this share of GPU memory (default: {pool_default})",
    )
    m.add_argument("--disable-cuda-graph", action="store_true", help="decode eagerly only")
    m.add_argument(
        "--disable-hybrid-swa-memory",
        action="store_true",
        help="one uniform KV pool even for models with sliding-window layers",
    )
    m.add_argument(
        "--cuda-graph-max-bs",
        type=int,
        default=None,
        help=f"largest graph (default: {graph_default})",
    )
    m.add_argument("--seed", type=int, default=0, help="seed of the weights and prompts")
    add_model_impl_args(m)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse and check the flags that need no model (bad ones: one ``error:`` line, exit 2)."""
    args = build_parser().parse_args(argv)
    try:
        validate_args(args)
    except CLIError as e:
        build_parser().error(str(e))
    return args


def validate_args(args: argparse.Namespace) -> None:
    """Raise CLIError for a flag value that can never work."""
    check_positive("--batch-size", args.batch_size)
    check_positive("--input-len", args.input_len)
    check_positive("--output-len", args.output_len)
    if args.correctness_test:
        check_positive("--cut-len", args.cut_len, minimum=0)
    validate_model_args(args, "srt.bench_one_batch")


def validate_model_args(args: argparse.Namespace, module: str) -> None:
    """Raise CLIError for a model flag (`add_model_args`) that can never work; ``module`` is
    the job's ``python -m`` name (for the torchrun hint)."""
    check_positive("--page-size", args.page_size)
    check_positive("--tp-size", args.tp_size)
    check_model_impl_args(args)
    if args.context_length is not None:
        check_positive("--context-length", args.context_length)
    if args.cuda_graph_max_bs is not None:
        check_positive("--cuda-graph-max-bs", args.cuda_graph_max_bs)
    frac = args.mem_fraction_static
    if frac is not None and not 0.0 < frac <= 1.0:
        raise CLIError("--mem-fraction-static must be in (0, 1]", frac)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise CLIError("--device cuda but no CUDA device is visible", args.device)
    on_cpu = args.device == "cpu" or (args.device is None and not torch.cuda.is_available())
    if args.attention_backend == "triton" and on_cpu:
        if not sgl_ext_settings.get().interpret:
            raise CLIError(
                "--attention-backend triton on CPU runs only in Triton's interpreter: "
                "set TRITON_INTERPRET=1 (slow) or use torch_native",
                args.attention_backend,
            )
    if args.tp_size > 1:
        from srt.distributed import launched_by_torchrun, torchrun_world_size

        if not launched_by_torchrun():
            raise CLIError(
                f"--tp-size > 1 runs one process per rank: torchrun --nproc-per-node "
                f"{args.tp_size} -m {module} ...",
                args.tp_size,
            )
        if torchrun_world_size() != args.tp_size:
            raise CLIError("--tp-size must equal torchrun's WORLD_SIZE", args.tp_size)


def check_model_path(args: argparse.Namespace) -> None:
    """Resolve --model-path (a local dir or a Hub id) in place; raise CLIError if unusable."""
    if args.model_path is None:
        return
    from srt.model_loader.hub import resolve_model_path

    path = resolve_model_path(args.model_path, name="--model-path")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise CLIError("--model-path has no config.json: not an HF checkpoint", args.model_path)
    args.model_path = path


def check_lengths(model_config: Any, args: argparse.Namespace, lens: list[int]) -> None:
    """Raise CLIError when the longest prompt + --output-len exceeds the context length."""
    model_ctx = int(getattr(model_config, "max_position_embeddings", 0) or 0)
    ctx = args.context_length or model_ctx
    need = max(lens) + max(args.output_len)
    if ctx and need > ctx:
        source = "--context-length" if args.context_length else "the model's context length"
        raise CLIError(
            f"--input-len + --output-len exceeds {source} {ctx}",
            f"{max(lens)} + {max(args.output_len)} = {need}",
        )


def _as_list(x: int | list[int]) -> list[int]:
    return list(x) if isinstance(x, (list, tuple)) else [int(x)]


def build_server_args(
    args: argparse.Namespace, fused: bool, max_len: int | None = None
) -> ServerArgs:
    """The runner's ServerArgs: a KV pool just big enough for the largest batch, unless
    --mem-fraction-static asks for SGLang's memory-sized pool. ``max_len``: longest request."""
    max_bs = max(args.batch_size)
    if max_len is None:
        max_len = max(_as_list(args.input_len)) + max(_as_list(args.output_len))
    ps = args.page_size
    per_req = -(-max_len // ps) * ps + ps
    frac = getattr(args, "mem_fraction_static", None)
    ctx = getattr(args, "context_length", None)
    if ctx is None and args.model_path is None:
        ctx = max_len + 8  # embedded/preset configs: a small req_to_token pool
    preset = args.model_preset
    return ServerArgs(
        model_path=args.model_path,
        load_format="dummy" if preset else args.load_format,
        device=args.device,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        page_size=ps,
        attention_backend=args.attention_backend,
        enable_fused_rope_kv=fused,
        disable_cuda_graph=args.disable_cuda_graph,
        disable_hybrid_swa_memory=getattr(args, "disable_hybrid_swa_memory", False),
        cuda_graph_max_bs=getattr(args, "cuda_graph_max_bs", None) or max_bs,
        max_total_tokens=None if frac is not None else max_bs * per_req,
        mem_fraction_static=frac if frac is not None else 0.85,
        max_running_requests=max_bs,
        context_length=ctx,
        random_seed=args.seed,
        tp_size=getattr(args, "tp_size", 1),
        json_model_override_args=preset_overrides(preset) if preset else "{}",
        model_impl=getattr(args, "model_impl", "srt"),
        model_file=getattr(args, "model_file", None),
    ).resolved()
