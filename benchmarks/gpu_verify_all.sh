#!/usr/bin/env bash
# One H100 call: memcheck of both GPU kernels, then the whole test suite on the GPU.
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
for b in triton cuda; do
  SGL_EXT_BACKEND=$b timeout 90 compute-sanitizer --tool memcheck --error-exitcode 9 python tests/sgl_ext/gpu_memcheck_sweep.py 2>&1 | tail -2 | sed "s/^/[$b] /" | tee -a "$OUT/memcheck.txt"
done
timeout 400 python -m pytest -q tests -p no:cacheprovider 2>&1 | tail -25 | tee "$OUT/pytest_all.txt"
exit 0
