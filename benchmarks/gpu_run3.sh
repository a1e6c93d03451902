#!/usr/bin/env bash
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
python -m pytest -q tests/sgl_ext 2>&1 | tail -3 | tee $OUT/pytest_sgl_ext.txt
python benchmarks/tune_rope_kv.py --tokens 1 512 2048 32768 --block-h 1 8 16 32 --warps 1 2 4 8 --json-out $OUT/tune.json 2>&1 | grep -E "BEST|top5" | tee $OUT/tune.txt
python benchmarks/bench_rope_kv.py --json-out $OUT/bench_bf16.json --plot $OUT/bench_bf16.png 2>&1 | tail -20 | tee $OUT/bench_bf16.txt
python benchmarks/bench_rope_kv.py --no-compile --kv-dtype fp8_e4m3 --tokens 1 32 128 512 2048 32768 2>&1 | tail -15 | tee $OUT/bench_fp8.txt
python benchmarks/bench_rope_kv.py --no-compile --gptj --tokens 1 32 128 512 2048 32768 2>&1 | tail -15 | tee $OUT/bench_gptj.txt
python benchmarks/bench_rope_kv.py --no-compile --rot-frac 0.5 --tokens 1 32 128 512 2048 32768 2>&1 | tail -15 | tee $OUT/bench_partial.txt
