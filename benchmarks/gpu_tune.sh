#!/usr/bin/env bash
# One H100 call: the kernel's GPU tests, the fp8 small-T check and the launch-config sweep.
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 170 python -m pytest -q tests/sgl_ext 2>&1 | tail -3 | tee "$OUT/pytest_sgl_ext.txt"
timeout 60 python benchmarks/bench_rope_kv.py --no-compile --kv-dtype fp8_e4m3 --tokens 1 8 32 128 512 2>&1 | tail -12 | tee "$OUT/fp8_small.txt"
timeout 60 python benchmarks/bench_rope_kv.py --no-compile --tokens 1 8 32 128 512 2>&1 | tail -12 | tee "$OUT/bf16_small.txt"
timeout 300 python benchmarks/tune_rope_kv.py --tokens 128 512 2048 8192 --block-h 4 8 16 32 --warps 2 4 8 --pdl 1 --order 1 0 --json-out "$OUT/tune.json" 2>&1 | grep -A1 BEST | tee "$OUT/tune.txt"
