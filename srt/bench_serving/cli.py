"""``python -m srt.bench_serving``: build the dataset and the backend, warm up, run, report.

Exit status: 0 when every request finished, 1 when some failed (the report still prints), 2
on a user error (one ``error:`` line; ``--debug`` adds the traceback).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import sys
from typing import Any

from srt import settings
from srt.bench_args import check_model_path
from srt.bench_serving.args import engine_kwargs, parse_args
from srt.bench_serving.backends import Backend, EngineBackend, OpenAIBackend
from srt.bench_serving.datasets import (
    DatasetRow,
    sample_generated_shared_prefix,
    sample_long_prompt_arrival,
    sample_random_requests,
    warmup_rows,
)
from srt.bench_serving.http_stream import HTTPError
from srt.bench_serving.long_prompt import format_long_prompt, long_prompt_metrics
from srt.bench_serving.metrics import calculate_metrics
from srt.bench_serving.plot import plot_latency
from srt.bench_serving.report import append_jsonl, check_writable, format_report
from srt.bench_serving.runner import RunResult, run_requests, warm_up
from srt.utils.cli import CLIError, run_cli

EXIT_FAILED_REQUESTS = 1
logger = logging.getLogger(__name__)


def model_config(args: argparse.Namespace) -> Any:
    """The model's config (no weights): its vocabulary and context length."""
    from srt.model_executor.model_builder import build_model_config, preset_overrides
    from srt.server_args import ServerArgs

    preset = args.model_preset
    overrides = preset_overrides(preset) if preset else "{}"
    return build_model_config(
        ServerArgs(
            model_path=args.model_path,
            load_format="dummy" if preset else args.load_format,
            json_model_override_args=overrides,
        )
    )


def build_dataset(args: argparse.Namespace, vocab_size: int) -> list[DatasetRow]:
    """The rows of --dataset-name."""
    name = args.dataset_name
    if name == "random":
        return sample_random_requests(
            args.num_prompts,
            args.random_input_len,
            args.random_output_len,
            args.random_range_ratio,
            vocab_size,
            args.seed,
        )
    if name == "generated-shared-prefix":
        return sample_generated_shared_prefix(
            args.gsp_num_groups,
            args.gsp_prompts_per_group,
            args.gsp_system_prompt_len,
            args.gsp_question_len,
            args.gsp_output_len,
            vocab_size,
            args.seed,
        )
    return sample_long_prompt_arrival(
        args.lpa_decoders,
        args.lpa_decoder_input_len,
        args.lpa_decoder_output_len,
        args.lpa_long_len,
        args.lpa_long_output_len,
        args.lpa_delay_s,
        vocab_size,
        args.seed,
    )


def context_length(args: argparse.Namespace, config: Any, rows: list[DatasetRow]) -> int | None:
    """The engine's context length: --context-length (CLIError if a request does not fit),
    else the model's, raised to the longest request when that is longer (a benchmark of
    random prompts, not of the model's quality)."""
    need = max(r.prompt_len + r.output_len for r in rows)
    if args.context_length is not None:
        if need > args.context_length:
            raise CLIError("the longest request exceeds --context-length", need)
        return int(args.context_length)
    # as ModelRunner resolves it: the config's context_len where it has one, else its positions
    model_ctx = int(
        getattr(config, "context_len", 0) or getattr(config, "max_position_embeddings", 0) or 0
    )
    if model_ctx and need > model_ctx:
        logger.warning("context length raised from the model's %d to %d", model_ctx, need)
        return need
    return None


def _header(args: argparse.Namespace) -> dict[str, Any]:
    rate = args.request_rate
    return {
        "Backend:": args.backend,
        "Dataset:": args.dataset_name,
        "Traffic request rate:": "inf" if math.isinf(rate) else rate,
        "Max request concurrency:": args.max_concurrency or "not set",
    }


def result_row(
    args: argparse.Namespace, server_info: dict[str, Any], rows: list[DatasetRow], run: RunResult
) -> tuple[dict[str, Any], list[str]]:
    """The jsonl row (SGLang's keys first; ``server_info`` from the backend) and the report's
    lines."""
    metrics = calculate_metrics(run.outputs, run.duration)
    lines = format_report(metrics, _header(args))
    rate = args.request_rate
    row: dict[str, Any] = {
        "tag": args.tag,
        "backend": args.backend,
        "dataset_name": args.dataset_name,
        "request_rate": "inf" if math.isinf(rate) else rate,
        "max_concurrency": args.max_concurrency,
        "num_prompts": len(rows),
        "random_input_len": args.random_input_len,
        "random_output_len": args.random_output_len,
        "random_range_ratio": args.random_range_ratio,
        "model": args.model_preset or args.model_path or "tiny",
        "server_info": server_info,
    }
    if args.dataset_name == "generated-shared-prefix":
        row.update({k: v for k, v in vars(args).items() if k.startswith("gsp_")})
    row.update(metrics.as_row())
    if args.dataset_name == "long-prompt-arrival":
        row.update({k: v for k, v in vars(args).items() if k.startswith("lpa_")})
        try:
            lpa = long_prompt_metrics(run.outputs)
        except ValueError as e:
            lines.append(f"long-prompt-arrival: {e}")
        else:
            row.update(lpa.as_row())
            lines += format_long_prompt(lpa)
    lines.append("=" * 50)
    if args.output_details:
        outs = run.outputs
        row.update(
            input_lens=[o.prompt_len for o in outs],
            output_lens=[o.output_len for o in outs],
            ttfts=[o.ttft for o in outs],
            itls=[o.itl for o in outs],
            cached_tokens=[o.cached_tokens for o in outs],
            errors=[o.error for o in outs],
        )
    return row, lines


async def _measure(
    args: argparse.Namespace, backend: Backend, rows: list[DatasetRow], vocab: int
) -> RunResult:
    warm = warmup_rows(rows, args.warmup_requests, vocab, args.seed)
    if warm:
        flush = args.backend == "engine" or args.flush_cache
        await warm_up(backend, warm, flush)
    elif args.flush_cache:
        await backend.flush_cache()
    return await run_requests(
        backend,
        rows,
        args.request_rate,
        args.max_concurrency,
        args.seed,
        progress=not args.disable_tqdm,
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; returns the result row (with ``outputs``: the measurements)."""
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(message)s", stream=sys.stderr)
    check_writable("--output-file", args.output_file)
    check_writable("--plot", args.plot)
    check_model_path(args)
    config = model_config(args)
    vocab = int(config.vocab_size)
    rows = build_dataset(args, vocab)
    engine = None
    if args.backend == "engine":
        import srt

        engine = srt.Engine(**engine_kwargs(args, context_length(args, config, rows)))
    try:
        if engine is not None:
            backend: Backend = EngineBackend(engine)
            run = asyncio.run(_measure(args, backend, rows, vocab))
        else:
            key = settings.get().openai_api_key

            async def remote() -> tuple[Backend, RunResult]:
                try:
                    b = await OpenAIBackend.connect(args.base_url, args.model, key)
                except (OSError, HTTPError) as e:
                    raise CLIError(f"cannot reach --base-url: {e}", args.base_url) from e
                return b, await _measure(args, b, rows, vocab)

            backend, run = asyncio.run(remote())
        server_info = backend.describe()  # (the engine's, before it is shut down)
    finally:
        if engine is not None:
            engine.shutdown()
    row, lines = result_row(args, server_info, rows, run)
    print("\n".join(lines), flush=True)
    errors = [o.error for o in run.outputs if not o.success]
    if errors:
        print(f"{len(errors)} requests failed; the first: {errors[0]}", flush=True)
    if args.output_file:
        append_jsonl(args.output_file, row)
    if args.plot:
        ok = [o for o in run.outputs if o.success]
        written = plot_latency(
            args.plot,
            [o.ttft * 1e3 for o in ok if o.token_times],
            [x * 1e3 for o in ok for x in o.itl],
            title=f"{args.backend} {args.dataset_name}",
        )
        print(f"latency picture: {written}", flush=True)
    row["outputs"] = run.outputs
    return row


def cli_main(argv: list[str] | None = None) -> int:
    """The command: 0, 1 when some request failed, 2 on a user error."""
    debug = "--debug" in (sys.argv[1:] if argv is None else argv)

    def body() -> int:
        row = main(argv)
        return EXIT_FAILED_REQUESTS if row["failed"] else 0

    return run_cli(body, debug)


__all__ = ["build_dataset", "cli_main", "context_length", "main", "result_row"]
