#!/usr/bin/env bash
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 200 python benchmarks/bench_e2e.py --preset llama3-8b --json-out $OUT/e2e_llama.json 2>&1 | tail -8 | tee $OUT/e2e_llama.txt
timeout 170 python benchmarks/bench_e2e.py --preset gpt-oss-20b --json-out $OUT/e2e_gptoss.json 2>&1 | tail -8 | tee $OUT/e2e_gptoss.txt
timeout 60 python -m pytest -q tests/srt/entrypoints/test_engine.py tests/srt/eval -k "cuda" 2>&1 | tail -3 | tee $OUT/pytest_final.txt
timeout 40 python -m srt.bench_one_batch 2>&1 | tail -12 | tee $OUT/bench_one_batch.txt
