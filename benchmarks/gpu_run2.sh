#!/usr/bin/env bash
# Device call: sgl_ext GPU tests, memcheck sweep, launch-config tuning, kernel benchmarks.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv
python -m pytest -q tests/sgl_ext 2>&1 | tail -4 | tee $OUT/pytest_sgl_ext.txt
compute-sanitizer --tool memcheck --error-exitcode 9 python tests/sgl_ext/gpu_memcheck_sweep.py 2>&1 | tail -3 | tee $OUT/memcheck.txt
python benchmarks/tune_rope_kv.py --json-out $OUT/tune.json 2>&1 | grep -E "BEST|top5" | tee $OUT/tune.txt
python benchmarks/bench_rope_kv.py --json-out $OUT/bench_bf16.json 2>&1 | tail -20 | tee $OUT/bench_bf16.txt
python benchmarks/bench_rope_kv.py --no-compile --kv-dtype fp8_e4m3 --tokens 1 128 512 2048 32768 2>&1 | tail -11 | tee $OUT/bench_fp8.txt
python benchmarks/bench_rope_kv.py --no-compile --gptj --rot-frac 0.5 --tokens 1 128 512 2048 32768 2>&1 | tail -11 | tee $OUT/bench_gptj_partial.txt
