#!/usr/bin/env bash
# Two-GPU check (H200 pair): final-kernel memcheck sweep, TP GPU tests, TP decode benchmark.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 60 compute-sanitizer --tool memcheck --error-exitcode 9 python tests/sgl_ext/gpu_memcheck_sweep.py 2>&1 | tail -2; echo "memcheck rc=${PIPESTATUS[0]}"
timeout 80 python -m pytest -q tests/srt/distributed -k gpu 2>&1 | grep -E "passed|failed|FAILED|Error" | tail -6
timeout 75 python benchmarks/bench_tp.py --batch-size 1 8 32 2>&1 | tail -8
