#!/usr/bin/env bash
# Kernel tests, tuning sweep, kernel benchmarks, then the runtime's GPU tests (each time-boxed).
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 170 python -m pytest -q tests/sgl_ext 2>&1 | tail -4 | tee $OUT/pytest_sgl_ext.txt
timeout 130 python benchmarks/tune_rope_kv.py --pdl 1 --tokens 1 32 128 512 2048 32768 --block-h 1 2 4 8 16 32 --warps 1 2 4 --json-out $OUT/tune.json 2>&1 | grep -E "BEST|Error" | tee $OUT/tune.txt
timeout 60 python benchmarks/tune_rope_kv.py --pdl 1 --gptj --tokens 32 512 32768 --block-h 2 8 16 32 --warps 1 2 4 2>&1 | grep -E "BEST|Error" | tee $OUT/tune_gptj.txt
timeout 45 python benchmarks/bench_rope_kv.py --no-compile --kv-dtype fp8_e4m3 --tokens 1 32 128 512 2048 32768 2>&1 | tail -14 | tee $OUT/bench_fp8.txt
timeout 45 python benchmarks/bench_rope_kv.py --no-compile --gptj --tokens 1 32 128 512 2048 32768 2>&1 | tail -14 | tee $OUT/bench_gptj.txt
timeout 150 python -m pytest -q -x tests/srt -k "cuda or graph or gpu or shared_rope" 2>&1 | tail -8 | tee $OUT/pytest_srt_gpu.txt
