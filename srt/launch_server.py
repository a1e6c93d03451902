"""`python -m srt.launch_server`: serve a model over HTTP (OpenAI API + SGLang's /generate).

Flags as SGLang's launch_server. Without --model-path it serves the embedded tiny Llama (random
weights: the text is not meant to read well). Needs the `server` extra (fastapi, uvicorn).
What cannot serve is refused before any weight loads, as one `error: ...` line and exit status
2: a bad flag, a device or backend this machine cannot run, a port already in use, a model
config (or --json-model-override-args) no model runs with.

    python -m srt.launch_server --model-path /path/to/llama --port 30000
    curl http://127.0.0.1:30000/v1/completions -H 'Content-Type: application/json' \\
        -d '{"model": "default", "prompt": "Hello", "max_tokens": 8}'
"""

from __future__ import annotations

import argparse
import logging
import socket
import sys
import traceback
from typing import Any

from srt.server_args import (
    ATTENTION_BACKENDS,
    DTYPES,
    KV_CACHE_DTYPES,
    LOAD_FORMATS,
    LOG_LEVELS,
    ServerArgs,
)
from srt.utils.cli import (
    EXIT_USAGE,
    ArgumentParser,
    CLIError,
    add_model_impl_args,
    add_prefix_cache_args,
    check_model_impl_args,
    check_positive,
    error_line,
)


def build_parser() -> ArgumentParser:
    """The command line (defaults shown in --help; --debug shows start-up tracebacks)."""
    p = ArgumentParser(prog="python -m srt.launch_server", description=__doc__.split("\n\n")[0])
    a = p.add_argument
    a("--model-path", default=None, help="HF checkpoint directory (default: the tiny model)")
    a("--tokenizer-path", default=None, help="tokenizer directory (default: the model's)")
    a("--skip-tokenizer-init", action="store_true", help="no tokenizer: token ids only")
    a("--served-model-name", default=None, help="the name /v1/models reports")
    a("--host", default="127.0.0.1", help="address to listen on")
    a("--port", type=int, default=30000, help="port to listen on")
    a("--load-format", default="auto", choices=LOAD_FORMATS, help="weights to load")
    a("--device", default=None, choices=("cuda", "cpu"), help="default: cuda if available")
    a("--dtype", default="auto", choices=DTYPES, help="weight/activation dtype")
    a("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES, help="KV cache dtype")
    a("--page-size", type=int, default=1, help="KV cache page size in tokens")
    a("--attention-backend", default=None, choices=ATTENTION_BACKENDS, help="default: per device")
    a("--context-length", type=int, default=None, help="default: the model's")
    a("--max-total-tokens", type=int, default=None, help="KV pool size in tokens")
    a("--max-running-requests", type=int, default=None, help="concurrent requests")
    a("--mem-fraction-static", type=float, default=0.85, help="GPU memory for weights + KV")
    a("--tp-size", type=int, default=1, help="tensor-parallel ranks")
    a("--random-seed", type=int, default=0, help="seed of dummy weights and unseeded sampling")
    a("--disable-cuda-graph", action="store_true", help="run decode eagerly")
    a("--cuda-graph-max-bs", type=int, default=64, help="largest captured decode batch")
    a("--disable-fused-rope-kv", action="store_true", help="write K/V outside the RoPE kernel")
    a("--json-model-override-args", default="{}", help="JSON merged into the HF config")
    a("--disable-hybrid-swa-memory", action="store_true", help="one uniform KV pool")
    a(
        "--disable-overlap-schedule",
        action="store_true",
        help="prepare each decode step only after the previous one is read back",
    )
    add_prefix_cache_args(p)
    a(
        "--enable-cache-report",
        action="store_true",
        help="OpenAI usage reports prompt_tokens_details.cached_tokens",
    )
    a("--allow-auto-truncate", action="store_true", help="cut over-long requests to fit")
    a(
        "--incremental-streaming-output",
        action="store_true",
        help="/generate streams send only the new text and ids (default: all so far, as SGLang)",
    )
    a("--log-level", default="info", choices=LOG_LEVELS, help="log level")
    add_model_impl_args(p)
    return p


def _engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(
        model_path=args.model_path,
        tokenizer_path=args.tokenizer_path,
        skip_tokenizer_init=args.skip_tokenizer_init,
        load_format=args.load_format,
        device=args.device,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        page_size=args.page_size,
        attention_backend=args.attention_backend,
        context_length=args.context_length,
        max_total_tokens=args.max_total_tokens,
        max_running_requests=args.max_running_requests,
        mem_fraction_static=args.mem_fraction_static,
        tp_size=args.tp_size,
        random_seed=args.random_seed,
        cuda_graph=not args.disable_cuda_graph,
        cuda_graph_max_bs=args.cuda_graph_max_bs,
        enable_fused_rope_kv=not args.disable_fused_rope_kv,
        json_model_override_args=args.json_model_override_args,
        allow_auto_truncate=args.allow_auto_truncate,
        disable_hybrid_swa_memory=args.disable_hybrid_swa_memory,
        disable_overlap_schedule=args.disable_overlap_schedule,
        disable_radix_cache=args.disable_radix_cache,
        disable_cascade_attn=args.disable_cascade_attn,
        chunked_prefill_size=args.chunked_prefill_size,
        decode_chunked_prefill_size=args.decode_chunked_prefill_size,
        enable_cache_report=args.enable_cache_report,
        incremental_streaming_output=args.incremental_streaming_output,
        log_level=args.log_level,
        model_impl=args.model_impl,
        model_file=args.model_file,
    )


def _check_args(kwargs: dict[str, Any]) -> ServerArgs:
    """The ServerArgs the Engine will build, resolved for this machine (raises ValueError for a
    value, device or backend that cannot serve) without loading anything."""
    fields = {k: v for k, v in kwargs.items() if k != "cuda_graph"}
    return ServerArgs(**fields, disable_cuda_graph=not kwargs["cuda_graph"]).resolved()


def bind_socket(host: str, port: int) -> socket.socket:
    """A socket bound to (host, port), to serve from once the model is loaded: a port in use is
    found before the weights load, and nobody can take it meanwhile."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except socket.gaierror as e:
        raise CLIError(f"--host {host!r} cannot be resolved: {e.strerror}", host) from None
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # uvicorn's own setting
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise CLIError(f"--port {port} cannot be used on {host}: {e.strerror}", port) from None
    return sock


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="[%(asctime)s] %(levelname)s %(name)s: %(message)s"
    )
    try:
        import uvicorn

        from srt.entrypoints.engine import Engine
        from srt.entrypoints.http_server import create_app
    except ImportError as e:
        print(
            f"error: the server needs the 'server' extra: pip install -e '.[server]' ({e})",
            file=sys.stderr,
        )
        return EXIT_USAGE
    kwargs = _engine_kwargs(args)
    sock = None
    try:
        if not 0 <= args.port < 65536:
            raise CLIError("--port must be in [0, 65535]", args.port)
        if args.context_length is not None:
            check_positive("--context-length", args.context_length)
        check_model_impl_args(args)
        _check_args(kwargs)
        sock = bind_socket(args.host, args.port)
        engine = Engine(**kwargs)
    except (ValueError, TypeError, OSError, NotImplementedError) as e:
        if sock is not None:
            sock.close()
        if args.debug:
            traceback.print_exc()
        print(error_line(e), file=sys.stderr)
        return EXIT_USAGE
    name = args.served_model_name or args.model_path or "default"
    loop = engine.engine_loop()
    app = create_app(loop, name)  # streaming mode: the engine's incremental_streaming_output
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level)
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        loop.close()
        engine.shutdown()
        sock.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
