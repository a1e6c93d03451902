#!/usr/bin/env bash
# One H100 call: memcheck sweep (now with merged and key/value-first batches); two more runs of
# ours vs SGLang's kernel at the goal points.
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=.:$PWD/.ab/peers/py312 PYTHONUNBUFFERED=1 SGL_BENCH_SGLANG_DIR=$PWD/.ab/peers/sg
export SGL_EXT_CACHE_DIR=/tmp/sgl_ext_cache
timeout 200 compute-sanitizer --tool memcheck --error-exitcode 9 python tests/sgl_ext/gpu_memcheck_sweep.py 2>&1 | tail -2 | tee "$OUT/memcheck.txt"
timeout 120 python benchmarks/peers.py > /dev/null 2>&1
for i in 1 2; do
  timeout 60 python benchmarks/bench_rope_kv.py --only-fused --tokens 1 8 128 512 2048 --json-out "$OUT/peer_$i.json" 2>&1 | grep -v '^{' | grep -v '^# sglang' | tail -14 | tee "$OUT/peer_$i.txt"
done
timeout 60 python benchmarks/bench_rope_kv.py --only-fused --kv-dtype fp8_e4m3 --tokens 1 8 512 --json-out "$OUT/fp8.json" 2>&1 | grep -v '^{' | tail -10 | tee "$OUT/fp8.txt"
exit 0
