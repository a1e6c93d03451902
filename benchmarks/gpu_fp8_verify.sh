#!/usr/bin/env bash
# One H100 call after the fp8 large-T block shape: kernel tests, memcheck sweep, the fp8 table
# (with FlashInfer's fp8 fused op; carry .ab/peers as for gpu_peers.sh) and bf16 large T.
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
P=$PWD/.ab/peers
export PYTHONPATH=.:$P/py312 PYTHONUNBUFFERED=1 SGL_BENCH_SGLANG_DIR=$P/sg SGL_BENCH_FLASHINFER_DIR=$P/fi
export SGL_EXT_CACHE_DIR=$P/cache
timeout 240 python -m pytest -q -p no:cacheprovider tests/sgl_ext -x 2>&1 | tail -2 | tee "$OUT/pytest_sgl_ext.txt"
timeout 180 compute-sanitizer --tool memcheck --error-exitcode 9 python tests/sgl_ext/gpu_memcheck_sweep.py 2>&1 | tail -2 | tee "$OUT/memcheck.txt"
timeout 60 python benchmarks/bench_rope_kv.py --no-compile --kv-dtype fp8_e4m3 --json-out "$OUT/fp8.json" 2>&1 | grep -v '^{' | tail -20 | tee "$OUT/fp8.txt"
exit 0
