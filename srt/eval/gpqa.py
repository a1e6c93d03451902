"""GPQA multiple-choice accuracy through the offline Engine, fused RoPE+KV vs unfused.

Usage::

    python -m srt.eval.gpqa --model-path /models/Qwen3-8B --data gpqa_diamond.csv \
        --num-repeats 4 --compare-unfused --output gpqa.jsonl
    python -m srt.eval.gpqa --load-format dummy --device cpu --data my.csv --max-new-tokens 8
    python -m srt.eval.gpqa --base-url http://127.0.0.1:30000/v1 --data gpqa_diamond.csv

``--data`` is a local CSV in the public GPQA schema (``Question``, ``Correct Answer``,
``Incorrect Answer 1..3``; other columns are ignored). No questions ship with this package:
the dataset's authors ask that it not be published in plain text.

Conventions follow openai/simple-evals: one ``random.Random(seed)`` first samples
``--num-examples`` rows (if fewer than the file has), then draws a permutation of the four
choices for every (row, repeat). The prompt goes through the tokenizer's chat template when it
has one. With ``--base-url`` the questions go to any OpenAI-compatible server's chat completions
instead (its chat template applies; srt/eval/openai_client.py). Without ``--max-new-tokens``
an answer may take up to 2048 tokens, capped to fit the context: offline, to the room each
prompt leaves; with ``--base-url``, to half the context the server reports (its prompt lengths
are the server's to count). A question the engine or server rejects (e.g. prompt +
``--max-new-tokens`` beyond the context length) is recorded as an error row (score 0, counted in
``num_errors``) and the run goes on. The last stdout line is a JSON object: ``accuracy``,
``stderr``, ``num_examples``, ``num_errors``, ``fused`` (and ``unfused_accuracy``, ``agreement``
with ``--compare-unfused``). Exit status 1 when every request failed; bad input (checked before
the run, ``--output`` included): one ``error: ...`` line, exit status 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from srt import settings
from srt.eval.engine_io import (
    Completion,
    context_length,
    fit_max_new_tokens,
    generate_completions,
    make_engine,
    prompt_token_ids,
)
from srt.eval.gpqa_data import (
    GPQADataError,
    GPQAExample,
    build_examples,
    load_gpqa_csv,
)
from srt.eval.multichoice import (
    extract_choice_letter,
    format_multichoice_question,
    mean_and_stderr,
)
from srt.server_args import DTYPES
from srt.utils.cli import (
    ArgumentParser,
    CLIError,
    add_model_impl_args,
    check_model_impl_args,
    run_cli,
)

DEFAULT_MAX_NEW_TOKENS = 2048  # what --max-new-tokens is capped from when not given


def score_responses(
    examples: Sequence[GPQAExample],
    prompts: Sequence[str],
    responses: Sequence[str | Completion],
) -> list[dict[str, Any]]:
    """One record per example: prompt, response, extracted letter, correct letter, score, and
    ``error`` (a rejected request: no response, score 0)."""
    records = []
    for ex, prompt, item in zip(examples, prompts, responses, strict=True):
        done = item if isinstance(item, Completion) else Completion(item)
        response = done.text
        extracted = extract_choice_letter(response) if response is not None else None
        records.append(
            {
                "row": ex.row,
                "repeat": ex.repeat,
                "record_id": ex.record_id,
                "permutation": list(ex.permutation),
                "prompt": prompt,
                "response": response,
                "extracted": extracted,
                "correct": ex.correct_letter,
                "score": float(extracted == ex.correct_letter),
                "error": done.error,
                "prompt_tokens": done.prompt_tokens,
                "cached_tokens": done.cached_tokens,
            }
        )
    return records


def summarize(
    records: Sequence[dict[str, Any]],
    fused: bool,
    unfused_records: Sequence[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The final JSON line: accuracy, stderr, counts, and the fused/unfused comparison."""
    accuracy, stderr = mean_and_stderr([r["score"] for r in records])
    summary: dict[str, Any] = {
        "accuracy": accuracy,
        "stderr": stderr,
        "num_examples": len({r["row"] for r in records}),
        "num_repeats": len({r["repeat"] for r in records}),
        "num_samples": len(records),
        "num_unparsed": sum(r["extracted"] is None and not r.get("error") for r in records),
        "num_errors": sum(bool(r.get("error")) for r in records),
        "fused": fused,
    }
    reported = [r for r in records if r.get("cached_tokens") is not None]
    if reported:  # the prefix cache at work: the shared chat template and instructions
        prompt = sum(r.get("prompt_tokens") or 0 for r in reported)
        cached = sum(r["cached_tokens"] for r in reported)
        summary["num_prompt_tokens"] = prompt
        summary["num_cached_tokens"] = cached
        summary["cache_hit_rate"] = round(cached / prompt, 4) if prompt else 0.0
    errors = [r["error"] for r in records if r.get("error")]
    if errors:
        summary["first_error"] = errors[0]
    if unfused_records is not None:
        pairs = list(zip(records, unfused_records, strict=True))
        u_acc, u_err = mean_and_stderr([u["score"] for u in unfused_records])
        same_text = sum(f["response"] == u["response"] for f, u in pairs)
        same_letter = sum(f["extracted"] == u["extracted"] for f, u in pairs)
        summary["unfused_accuracy"] = u_acc
        summary["unfused_stderr"] = u_err
        summary["agreement"] = same_text / len(pairs)  # identical response texts
        summary["answer_agreement"] = same_letter / len(pairs)  # identical extracted letters
    return summary


def _run_one(args: argparse.Namespace, examples, engine_factory, fused: bool):
    """Build an engine, generate every example's response, shut the engine down."""
    engine = engine_factory(args, fused)
    try:
        tokenizer = getattr(engine, "tokenizer", None)
        if tokenizer is None:
            raise ValueError("the engine has no tokenizer; GPQA needs one to build prompts")
        prompts, ids = [], []
        for ex in examples:
            text, tokens = prompt_token_ids(
                tokenizer, format_multichoice_question(ex.question, ex.choices)
            )
            prompts.append(text)
            ids.append(tokens)
        sampling_params: dict[str, Any] | list[dict[str, Any]] = {
            "max_new_tokens": args.max_new_tokens,
            "temperature": args.temperature,
            "seed": args.seed,
        }
        if args.max_new_tokens is None:
            sampling_params = _fitted_params(ids, context_length(engine), args)
        desc = f"GPQA ({'fused' if fused else 'unfused'})"
        responses = generate_completions(engine, ids, sampling_params, args.batch_size, desc)
    finally:
        engine.shutdown()
    return score_responses(examples, prompts, responses)


def _fitted_params(
    ids: Sequence[list[int]], context_len: int | None, args: argparse.Namespace
) -> list[dict[str, Any]]:
    """Per prompt: up to DEFAULT_MAX_NEW_TOKENS new tokens, capped to the prompt's room."""
    caps = fit_max_new_tokens(ids, DEFAULT_MAX_NEW_TOKENS, context_len)
    capped = sum(c < DEFAULT_MAX_NEW_TOKENS for c in caps)
    if capped:
        print(
            f"# --max-new-tokens not given: {DEFAULT_MAX_NEW_TOKENS} capped to the room each "
            f"prompt leaves in the {context_len}-token context ({capped} of {len(caps)} prompts)",
            file=sys.stderr,
            flush=True,
        )
    return [{"max_new_tokens": c, "temperature": args.temperature, "seed": args.seed} for c in caps]


def remote_max_new_tokens(context_len: int | None) -> tuple[int, str]:
    """The --base-url default: DEFAULT_MAX_NEW_TOKENS, or half the server's context when that
    is smaller (prompt lengths are the server's to count), and why."""
    if context_len is None or context_len >= 2 * DEFAULT_MAX_NEW_TOKENS:
        return DEFAULT_MAX_NEW_TOKENS, "the default"
    return max(1, context_len // 2), f"half the server's {context_len}-token context"


def _run_remote(args: argparse.Namespace, examples: Sequence[GPQAExample]):
    """Every example through an OpenAI-compatible server's chat completions."""
    from srt.eval.openai_client import ChatSampling, OpenAIChatClient

    client = OpenAIChatClient(
        args.base_url, args.model, api_key=args.api_key, timeout=args.request_timeout
    )
    print(f"# server {client.base_url}, model {client.model}", file=sys.stderr, flush=True)
    prompts = [format_multichoice_question(ex.question, ex.choices) for ex in examples]
    max_new_tokens = args.max_new_tokens
    if max_new_tokens is None:
        max_new_tokens, why = remote_max_new_tokens(client.context_length)
        print(
            f"# --max-new-tokens not given: {max_new_tokens} ({why})", file=sys.stderr, flush=True
        )
    sampling = ChatSampling(max_new_tokens, args.temperature, args.seed)
    responses = client.complete_all(prompts, sampling, args.batch_size, f"GPQA ({client.model})")
    return score_responses(examples, prompts, responses)


def run_gpqa(
    args: argparse.Namespace,
    engine_factory: Callable[[argparse.Namespace, bool], Any] = make_engine,
) -> dict[str, Any]:
    """Run the eval described by parsed ``args``; write ``--output``; return the summary."""
    rows = load_gpqa_csv(args.data)
    examples = build_examples(rows, args.num_examples, args.num_repeats, args.seed)
    start = time.perf_counter()
    if getattr(args, "base_url", None):
        records = _run_remote(args, examples)
    else:
        records = _run_one(args, examples, engine_factory, fused=True)
    unfused = None
    if args.compare_unfused:
        unfused = _run_one(args, examples, engine_factory, fused=False)
    summary = summarize(records, fused=True, unfused_records=unfused)
    summary["elapsed_s"] = round(time.perf_counter() - start, 3)
    if args.output:
        out = Path(args.output)
        out.parent.mkdir(parents=True, exist_ok=True)  # check_output_path saw it is possible
        with out.open("w", encoding="utf-8") as f:
            for i, rec in enumerate(records):
                rec = {**rec, "fused": True}
                if unfused is not None:
                    u = unfused[i]
                    rec |= {
                        "unfused_response": u["response"],
                        "unfused_extracted": u["extracted"],
                        "unfused_score": u["score"],
                        "same_response": u["response"] == rec["response"],
                    }
                f.write(json.dumps(rec, ensure_ascii=False) + "\n")
    return summary


def build_parser() -> ArgumentParser:
    """The command line of ``python -m srt.eval.gpqa`` (defaults shown in --help)."""
    p = ArgumentParser(prog="python -m srt.eval.gpqa", description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True, help="local GPQA CSV (UTF-8)")
    e = p.add_argument_group("offline engine (default)")
    e.add_argument("--model-path", default=None, help="HF checkpoint folder or Hub id")
    e.add_argument(
        "--load-format",
        default="auto",
        choices=["auto", "dummy"],
        help="dummy: seeded random weights (the embedded tiny model without --model-path)",
    )
    e.add_argument("--device", default=None, choices=["cuda", "cpu"], help="default: cuda if any")
    e.add_argument("--dtype", default="auto", choices=DTYPES, help="model dtype")
    e.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "fp8_e4m3", "fp8_e5m2"],
        help="KV-cache dtype (auto = --dtype)",
    )
    e.add_argument("--page-size", type=int, default=1, help="KV-cache page size in tokens")
    e.add_argument("--disable-cuda-graph", action="store_true", help="decode eagerly")
    e.add_argument("--compare-unfused", action="store_true", help="also run unfused, compare")
    e.add_argument(
        "--disable-radix-cache", action="store_true", help="no prefix cache: compute every prompt"
    )
    add_model_impl_args(e)
    s = p.add_argument_group("OpenAI-compatible server")
    s.add_argument(
        "--base-url",
        default=None,
        help="e.g. http://127.0.0.1:30000/v1: ask this server instead of the offline engine",
    )
    s.add_argument("--model", default=None, help="model name (default: the server's first)")
    s.add_argument(
        "--api-key",
        default=settings.get().openai_api_key,
        help="bearer token (default: $OPENAI_API_KEY, else EMPTY)",
    )
    s.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    r = p.add_argument_group("eval")
    r.add_argument("--num-examples", type=int, default=None, help="sample this many rows")
    r.add_argument("--num-repeats", type=int, default=1, help="passes over the rows")
    r.add_argument("--seed", type=int, default=0, help="choice shuffling and sampling seed")
    r.add_argument(
        "--max-new-tokens",
        type=int,
        default=None,
        # "%(default).0s" prints nothing: it keeps argparse from adding "(default: None)".
        help=f"tokens per answer (default: {DEFAULT_MAX_NEW_TOKENS}, capped to fit the "
        "context)%(default).0s",
    )
    r.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    r.add_argument(
        "--batch-size", type=int, default=32, help="prompts per generate call / concurrent requests"
    )
    r.add_argument("--output", default=None, help="per-example JSONL")
    r.add_argument("--log-level", default="info", help="logging level (loading messages: info)")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse and validate the command line (errors: one ``error:`` line, exit status 2)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.base_url is None and args.model_path is None and args.load_format != "dummy":
        parser.error(
            "give --model-path, --load-format dummy for the embedded tiny model, or --base-url"
        )
    if args.base_url is not None and args.compare_unfused:
        parser.error("--compare-unfused needs the offline engine, not --base-url")
    try:
        check_model_impl_args(args)
    except CLIError as e:
        parser.error(str(e))
    for name in ("num_repeats", "max_new_tokens", "batch_size", "page_size"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1 ({getattr(args, name)})")
    if args.num_examples is not None and args.num_examples < 1:
        parser.error(f"--num-examples must be >= 1 ({args.num_examples})")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        parser.error(f"--temperature must be a finite number >= 0 ({args.temperature})")
    if args.request_timeout <= 0:
        parser.error(f"--request-timeout must be > 0 ({args.request_timeout})")
    if args.device == "cuda" and args.base_url is None:
        import torch

        if not torch.cuda.is_available():
            parser.error("--device cuda but no CUDA device is visible (cuda)")
    return args


def check_output_path(path: str | None) -> None:
    """Raise CLIError unless ``--output`` can be written: not a directory, and its folder is one
    or can be made (no file in the way). Checked before the run, which may take hours."""
    if path is None:
        return
    out = Path(path)
    if out.is_dir():
        raise CLIError("--output is a directory, not a file", path)
    parent = out.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise CLIError(f"--output cannot be created: {parent} is a file, not a folder", path)
    if not os.access(parent, os.W_OK | os.X_OK):
        raise CLIError(f"--output cannot be created: {parent} is not writable", path)
    if out.exists() and not os.access(out, os.W_OK):
        raise CLIError("--output is not writable", path)


def _check_model_path(args: argparse.Namespace) -> None:
    """--model-path: a local checkpoint folder or a Hub id (resolved in place)."""
    if args.model_path is None or args.base_url is not None:
        return
    from srt.model_loader.hub import resolve_model_path

    path = resolve_model_path(args.model_path, name="--model-path")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(
            f"--model-path has no config.json: not an HF checkpoint ({args.model_path})"
        )
    args.model_path = path


def main(
    argv: Sequence[str] | None = None,
    engine_factory: Callable[[argparse.Namespace, bool], Any] = make_engine,
) -> int:
    """Entry point: run, print the summary as the last line of JSON; 2 (one ``error:`` line,
    ``--debug`` adds the traceback) on bad input."""
    argv = sys.argv[1:] if argv is None else list(argv)

    def body() -> int:
        args = parse_args(argv)
        logging.basicConfig(level=args.log_level.upper(), format="%(message)s")
        check_output_path(args.output)
        _check_model_path(args)
        summary = run_gpqa(args, engine_factory)
        failed, total = summary["num_errors"], summary["num_samples"]
        if failed:
            print(
                f"# {failed} of {total} requests failed: error rows (score 0) in --output",
                file=sys.stderr,
            )
        print(json.dumps(summary))
        if failed == total:
            first = summary.get("first_error") or "see --output"
            print(f"error: every request failed ({first})", file=sys.stderr)
            return 1
        return 0

    return run_cli(body, "--debug" in argv)


__all__ = [
    "GPQADataError",
    "GPQAExample",
    "build_examples",
    "build_parser",
    "load_gpqa_csv",
    "main",
    "run_gpqa",
    "score_responses",
    "summarize",
]

if __name__ == "__main__":
    sys.exit(main())
