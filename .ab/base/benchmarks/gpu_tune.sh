#!/usr/bin/env bash
# One H100 call: the Triton GPU tests and the launch-config sweep (heads per program, warps,
# merged programs, k/v spread) at the T where the layout is merged. Results under $OUT.
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 120 python -m pytest -q tests/sgl_ext/test_rope.py -k triton 2>&1 | tail -2 | tee "$OUT/pytest_triton.txt"
timeout 300 python benchmarks/tune_rope_kv.py --tokens 128 512 2048 8192 32768 --block-h 8 16 32 --warps 2 4 8 --pdl 1 --merged 0 1 --spread 0 1 --json-out "$OUT/tune.json" 2>&1 | grep -A1 BEST | tee "$OUT/tune.txt"
