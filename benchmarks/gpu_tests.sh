#!/usr/bin/env bash
# One H100 call: the kernel tests and the memcheck sweep on the GPU.
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 300 python -m pytest -q -p no:cacheprovider tests/sgl_ext 2>&1 | tail -3 | tee "$OUT/pytest_sgl_ext.txt"
timeout 150 compute-sanitizer --tool memcheck --error-exitcode 9 python tests/sgl_ext/gpu_memcheck_sweep.py 2>&1 | tail -2 | tee "$OUT/memcheck.txt"
timeout 100 python -m pytest -q -p no:cacheprovider tests/srt -k "rotary or memory_pool or graph" 2>&1 | tail -2 | tee "$OUT/pytest_srt.txt"
exit 0
