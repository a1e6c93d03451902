"""The command line of ``python -m srt.bench_serving``: SGLang's bench_serving flags, the model
flags of ``srt.bench_one_batch`` (`srt.bench_args.add_model_args`) and the Engine's serving
flags; `validate_args` rejects what can never work before anything is built."""

from __future__ import annotations

import argparse
import math
from typing import Any

from srt.bench_args import add_model_args, validate_model_args
from srt.utils.cli import (
    ArgumentParser,
    CLIError,
    add_prefix_cache_args,
    check_positive,
    check_prefix_cache_args,
)

DATASETS = ("random", "generated-shared-prefix", "long-prompt-arrival")
BACKENDS = ("engine", "openai")


def build_parser() -> ArgumentParser:
    p = ArgumentParser(
        prog="python -m srt.bench_serving",
        description="Online serving benchmark (SGLang's bench_serving): requests streamed to "
        "the in-process Engine or to an OpenAI-compatible server; throughput, TTFT, ITL, "
        "TPOT, E2E latency and the prefix-cache hit rate.",
    )
    s = p.add_argument_group("backend")
    s.add_argument("--backend", default="engine", choices=BACKENDS, help="where requests go")
    s.add_argument(
        "--base-url",
        default=None,
        help="openai backend: the server (http://host:port, or its .../v1 prefix)",
    )
    s.add_argument("--model", default=None, help="openai backend: model name (default: first)")
    s.add_argument(
        "--flush-cache",
        action="store_true",
        help="openai backend: POST /flush_cache after the warm-up (the engine's is always flushed)",
    )
    d = p.add_argument_group("dataset (prompts are random token ids of the model's vocabulary)")
    d.add_argument("--dataset-name", default="random", choices=DATASETS)
    d.add_argument("--num-prompts", type=int, default=1000, help="random: requests")
    d.add_argument("--random-input-len", type=int, default=1024)
    d.add_argument("--random-output-len", type=int, default=1024)
    d.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="lengths uniform in [max(len * ratio, 1), len]",
    )
    d.add_argument("--gsp-num-groups", type=int, default=64, help="shared system prompts")
    d.add_argument("--gsp-prompts-per-group", type=int, default=16)
    d.add_argument("--gsp-system-prompt-len", type=int, default=2048)
    d.add_argument("--gsp-question-len", type=int, default=128)
    d.add_argument("--gsp-output-len", type=int, default=256)
    d.add_argument("--lpa-decoders", type=int, default=32, help="requests decoding at once")
    d.add_argument("--lpa-decoder-input-len", type=int, default=512)
    d.add_argument(
        "--lpa-decoder-output-len",
        type=int,
        default=1024,
        help="long enough to outlast the long prompt's prefill",
    )
    d.add_argument("--lpa-long-len", type=int, default=32768, help="the long prompt's tokens")
    d.add_argument("--lpa-long-output-len", type=int, default=8)
    d.add_argument("--lpa-delay-s", type=float, default=1.0, help="when the long prompt is sent")
    r = p.add_argument_group("load and results")
    r.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="requests per second (Poisson arrivals); inf: all at once",
    )
    r.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    r.add_argument(
        "--warmup-requests",
        type=int,
        default=1,
        help="untimed requests first (fresh prompts shaped like the first and the longest)",
    )
    r.add_argument("--output-file", default=None, help="append the result row here (jsonl)")
    r.add_argument(
        "--output-details", action="store_true", help="the row also lists every request's data"
    )
    r.add_argument("--plot", default=None, metavar="PATH", help="TTFT / ITL picture")
    r.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    r.add_argument("--tag", default=None, help="a label stored in the result row")
    add_model_args(
        p.add_argument_group("model (engine backend; the openai backend takes its vocabulary)"),
        pool_default="0.85, SGLang's",
        graph_default="64",
    )
    e = p.add_argument_group("engine")
    add_prefix_cache_args(e)
    e.add_argument("--max-running-requests", type=int, default=None)
    e.add_argument("--max-total-tokens", type=int, default=None, help="KV pool size in tokens")
    e.add_argument("--disable-overlap-schedule", action="store_true")
    e.add_argument("--disable-fused-rope-kv", action="store_true", help="the unfused write")
    e.add_argument("--log-level", default="warning", help="level of srt's loggers")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse and check (a bad flag: one ``error:`` line, exit 2)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        validate_args(args)
    except CLIError as e:
        parser.error(str(e))
    return args


def validate_args(args: argparse.Namespace) -> None:
    """Raise CLIError for a flag value that can never work."""
    positive = [
        "num_prompts",
        "random_input_len",
        "random_output_len",
        "gsp_num_groups",
        "gsp_prompts_per_group",
        "gsp_system_prompt_len",
        "gsp_question_len",
        "gsp_output_len",
        "lpa_decoders",
        "lpa_decoder_input_len",
        "lpa_decoder_output_len",
        "lpa_long_len",
        "lpa_long_output_len",
    ]
    for name in positive:
        check_positive("--" + name.replace("_", "-"), getattr(args, name))
    check_positive("--warmup-requests", args.warmup_requests, minimum=0)
    if not 0.0 <= args.random_range_ratio <= 1.0:
        raise CLIError("--random-range-ratio must be in [0, 1]", args.random_range_ratio)
    if not args.request_rate > 0:
        raise CLIError("--request-rate must be > 0 (inf: all at once)", args.request_rate)
    if not (args.lpa_delay_s >= 0 and math.isfinite(args.lpa_delay_s)):
        raise CLIError("--lpa-delay-s must be a finite number >= 0", args.lpa_delay_s)
    for flag in ("max_concurrency", "max_running_requests", "max_total_tokens"):
        value = getattr(args, flag)
        if value is not None:
            check_positive("--" + flag.replace("_", "-"), value)
    check_prefix_cache_args(args)
    if args.backend == "openai":
        url = args.base_url
        if not url:
            raise CLIError("--backend openai needs --base-url", url)
        if not url.startswith(("http://", "https://")):
            raise CLIError("--base-url must start with http:// or https://", url)
    elif args.base_url is not None:
        raise CLIError("--base-url is for --backend openai", args.base_url)
    else:
        if args.tp_size != 1:
            raise CLIError("--backend engine streams from one process: --tp-size 1", args.tp_size)
        validate_model_args(args, "srt.bench_serving")
    if args.model_preset and args.model_path:
        raise CLIError("--model-preset and --model-path exclude each other", args.model_preset)


def engine_kwargs(args: argparse.Namespace, context_length: int | None) -> dict[str, Any]:
    """`srt.Engine` arguments of the flags: prompts are ids (no tokenizer), chunks incremental
    (each carries its step's ids only, so streaming costs the loop thread no copying)."""
    from srt.model_executor.model_builder import preset_overrides

    preset = args.model_preset
    kw: dict[str, Any] = dict(
        model_path=args.model_path,
        load_format="dummy" if preset else args.load_format,
        device=args.device,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        page_size=args.page_size,
        attention_backend=args.attention_backend,
        enable_fused_rope_kv=not args.disable_fused_rope_kv,
        cuda_graph=not args.disable_cuda_graph,
        disable_hybrid_swa_memory=args.disable_hybrid_swa_memory,
        max_total_tokens=args.max_total_tokens,
        mem_fraction_static=args.mem_fraction_static or 0.85,
        max_running_requests=args.max_running_requests,
        context_length=context_length,
        random_seed=args.seed,
        json_model_override_args=preset_overrides(preset) if preset else "{}",
        model_impl=args.model_impl,
        model_file=args.model_file,
        disable_radix_cache=args.disable_radix_cache,
        disable_cascade_attn=args.disable_cascade_attn,
        chunked_prefill_size=args.chunked_prefill_size,
        decode_chunked_prefill_size=args.decode_chunked_prefill_size,
        disable_overlap_schedule=args.disable_overlap_schedule,
        skip_tokenizer_init=True,
        incremental_streaming_output=True,
        log_level=args.log_level,
    )
    if args.cuda_graph_max_bs is not None:
        kw["cuda_graph_max_bs"] = args.cuda_graph_max_bs
    return kw


__all__ = ["BACKENDS", "DATASETS", "build_parser", "engine_kwargs", "parse_args", "validate_args"]
