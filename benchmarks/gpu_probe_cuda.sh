#!/usr/bin/env bash
# One H100 call: small-T probe of CUDA-kernel build variants (compile-time switches).
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
python benchmarks/probe_small_t.py --tokens 1 --backends triton 2>&1 | tail -6 | sed 's/^/[triton] /'
for f in "" "-DSGL_EXT_NO_GUARD" "-DSGL_EXT_WAIT_FIRST" "-DSGL_EXT_WAIT_FIRST -DSGL_EXT_NO_GUARD"; do
  SGL_EXT_NVCC_FLAGS="$f" timeout 60 python benchmarks/probe_small_t.py --tokens 1 8 --backends cuda 2>&1 | tail -12 | sed "s/^/[cuda $f] /"
done
python benchmarks/probe_small_t.py --tokens 1 --backends triton 2>&1 | tail -6 | sed 's/^/[triton] /'
