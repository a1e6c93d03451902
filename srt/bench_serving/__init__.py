"""``python -m srt.bench_serving``: SGLang's online serving benchmark (bench_serving) for the
in-process `srt.Engine` or any OpenAI-compatible server.

    python -m srt.bench_serving --dataset-name random --num-prompts 64 --random-input-len 256 \
        --random-output-len 64                               # embedded tiny model, this device
    python -m srt.bench_serving --model-preset llama3-8b --dataset-name generated-shared-prefix \
        --gsp-num-groups 16 --gsp-prompts-per-group 32 --output-file serving.jsonl
    python -m srt.bench_serving --backend openai --base-url http://127.0.0.1:30000 \
        --model-preset llama3-8b --dataset-name random      # any OpenAI-compatible server

Modules: `args` (the command line), `datasets` (random, generated-shared-prefix and
long-prompt-arrival rows of token ids), `backends` (Engine and OpenAI streaming clients),
`http_stream` (the stdlib asyncio HTTP / SSE client), `runner` (arrivals, concurrency, tqdm),
`metrics` (TTFT / ITL / TPOT / E2E and throughput, SGLang's names), `long_prompt` (the
chunked-prefill scenario's decoder ITL), `report` (printed table, jsonl row), `plot`
(`--plot`), `cli` (the command).
"""
