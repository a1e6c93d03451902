#!/usr/bin/env bash
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 150 python -m pytest -q tests/sgl_ext 2>&1 | tail -3 | tee $OUT/pytest_sgl_ext.txt
timeout 70 python benchmarks/bench_rope_kv.py --json-out $OUT/bench_bf16.json --plot $OUT/bench_bf16.png 2>&1 | tail -20 | tee $OUT/bench_bf16.txt
timeout 30 python benchmarks/bench_rope_kv.py --no-compile --kv-dtype fp8_e4m3 --tokens 1 32 128 512 2048 8192 32768 2>&1 | tail -16 | tee $OUT/bench_fp8.txt
timeout 30 python benchmarks/bench_rope_kv.py --no-compile --gptj --tokens 1 32 128 512 2048 8192 32768 2>&1 | tail -16 | tee $OUT/bench_gptj.txt
timeout 30 python benchmarks/bench_rope_kv.py --no-compile --rot-frac 0.5 --tokens 1 32 128 512 2048 8192 32768 2>&1 | tail -16 | tee $OUT/bench_partial.txt
timeout 200 python -m pytest -q tests/srt -k "cuda or graph or gpu or shared_rope" 2>&1 | grep -E "passed|failed|FAILED|Error" | tail -15 | tee $OUT/pytest_srt_gpu.txt
timeout 40 python benchmarks/debug_engine_leak.py 2>&1 | tail -25 | tee $OUT/leak.txt
