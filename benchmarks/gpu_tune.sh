#!/usr/bin/env bash
# One H100 call: small-T A/B of the session-start kernel (.ab/old) against the current one, and
# the fp8 launch-config sweep at small T.
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
for round in 1 2; do
  for kv in bf16 fp8_e4m3; do
    echo "== old $kv round $round"; (cd .ab/old && timeout 60 python benchmarks/bench_rope_kv.py --no-compile --kv-dtype $kv --tokens 1 8 32 128 2>&1 | grep "^| [lg]")
    echo "== new $kv round $round"; timeout 60 python benchmarks/bench_rope_kv.py --no-compile --kv-dtype $kv --tokens 1 8 32 128 2>&1 | grep "^| [lg]"
  done
done | tee "$OUT/ab.txt"
timeout 200 python benchmarks/tune_rope_kv.py --kv-dtype fp8_e4m3 --tokens 1 8 32 128 --block-h 1 2 4 8 --warps 1 2 4 --pdl 1 --merged 0 1 --json-out "$OUT/tune_fp8.json" 2>&1 | grep -A1 BEST | tee "$OUT/tune_fp8.txt"
