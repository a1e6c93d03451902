"""`python -m srt.launch_server`: serve a model over HTTP (OpenAI API + SGLang's /generate).

Flags as SGLang's launch_server. Without --model-path it serves the embedded tiny Llama (random
weights: the text is not meant to read well). Needs the `server` extra (fastapi, uvicorn).

    python -m srt.launch_server --model-path /path/to/llama --port 30000
    curl http://127.0.0.1:30000/v1/completions -H 'Content-Type: application/json' \\
        -d '{"model": "default", "prompt": "Hello", "max_tokens": 8}'
"""

from __future__ import annotations

import argparse
import logging
import sys

from srt.server_args import ATTENTION_BACKENDS, DTYPES, KV_CACHE_DTYPES, LOAD_FORMATS, LOG_LEVELS


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m srt.launch_server",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
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
    a("--allow-auto-truncate", action="store_true", help="cut over-long requests to fit")
    a("--log-level", default="info", choices=LOG_LEVELS, help="log level")
    a("--debug", action="store_true", help="show tracebacks of start-up errors")
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
        log_level=args.log_level,
    )


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
        return 2
    if not 0 <= args.port < 65536:
        print(f"error: --port must be in [0, 65535] ({args.port})", file=sys.stderr)
        return 2
    try:
        engine = Engine(**_engine_kwargs(args))
    except (ValueError, TypeError, OSError) as e:
        if args.debug:
            raise
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"error: {msg}", file=sys.stderr)
        return 2
    name = args.served_model_name or args.model_path or "default"
    loop = engine.engine_loop()
    try:
        uvicorn.run(
            create_app(loop, name), host=args.host, port=args.port, log_level=args.log_level
        )
    finally:
        loop.close()
        engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
