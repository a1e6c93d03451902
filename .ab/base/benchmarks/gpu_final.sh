#!/usr/bin/env bash
# One H100 call for the kernel: GPU tests, memcheck, every benchmark table.
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 170 python -m pytest -q tests/sgl_ext 2>&1 | tail -2 | tee "$OUT/pytest_sgl_ext.txt"
timeout 100 compute-sanitizer --tool memcheck --error-exitcode 9 python tests/sgl_ext/gpu_memcheck_sweep.py 2>&1 | tail -2 | tee "$OUT/memcheck.txt"
timeout 150 python benchmarks/bench_rope_kv.py --json-out "$OUT/bench_bf16.json" --plot "$OUT/bench_bf16.png" 2>&1 | tail -20 | tee "$OUT/bench_bf16.txt"
timeout 60 python benchmarks/bench_rope_kv.py --no-compile --kv-dtype fp8_e4m3 --json-out "$OUT/bench_fp8.json" 2>&1 | tail -18 | tee "$OUT/bench_fp8.txt"
timeout 60 python benchmarks/bench_rope_kv.py --no-compile --gptj --json-out "$OUT/bench_gptj.json" 2>&1 | tail -18 | tee "$OUT/bench_gptj.txt"
timeout 60 python benchmarks/bench_rope_kv.py --no-compile --rot-frac 0.5 --json-out "$OUT/bench_partial.json" 2>&1 | tail -18 | tee "$OUT/bench_partial.txt"
exit 0
