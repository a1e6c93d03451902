#!/usr/bin/env bash
# One H100 call for the CUDA C++ kernel: its tests, memcheck, CUDA vs Triton tables, a launch
# configuration sweep. Usage: OUT=dir bash benchmarks/gpu_cuda.sh
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 60 python -c "
import time, torch; from sgl_ext.cuda import jit
t = time.time(); jit.build('rope_kv', torch.cuda.get_device_capability()); print(f'nvcc build {time.time()-t:.1f} s')
" 2>&1 | tee "$OUT/build.txt"
timeout 200 python -m pytest -q tests/sgl_ext/test_cuda_rope_kv.py tests/sgl_ext/test_compile_and_graphs.py 2>&1 | tail -15 | tee "$OUT/pytest_cuda.txt"
SGL_EXT_BACKEND=cuda timeout 100 compute-sanitizer --tool memcheck --error-exitcode 9 python tests/sgl_ext/gpu_memcheck_sweep.py 2>&1 | tail -3 | tee "$OUT/memcheck_cuda.txt"
B="python benchmarks/bench_rope_kv.py --compare --only-fused"
timeout 70 $B --json-out "$OUT/cmp_bf16.json" 2>&1 | tail -20 | tee "$OUT/cmp_bf16.txt"
timeout 50 $B --kv-dtype fp8_e4m3 --tokens 1 8 32 128 512 2048 --json-out "$OUT/cmp_fp8.json" 2>&1 | tail -16 | tee "$OUT/cmp_fp8.txt"
timeout 50 $B --gptj --tokens 1 8 32 128 512 2048 --json-out "$OUT/cmp_gptj.json" 2>&1 | tail -16 | tee "$OUT/cmp_gptj.txt"
timeout 50 $B --rot-frac 0.5 --tokens 1 8 32 128 512 2048 --json-out "$OUT/cmp_partial.json" 2>&1 | tail -16 | tee "$OUT/cmp_partial.txt"
timeout 60 python benchmarks/tune_rope_kv.py --pdl 1 0 --tokens 1 --shapes llama3-8b --cuda-configs 64,1 128,1 2>&1 | grep -A1 BEST | tee "$OUT/pdl_cuda.txt"
timeout 60 python benchmarks/tune_rope_kv.py --pdl 1 0 --tokens 1 --shapes llama3-8b --block-h 1 --warps 4 --order 0 2>&1 | grep -A1 BEST | tee "$OUT/pdl_triton.txt"
timeout 150 python benchmarks/tune_rope_kv.py --pdl 1 --tokens 1 8 32 128 512 2048 8192 \
  --cuda-configs ${CUDA_CONFIGS:-32,1 64,1 128,1 32,1,4 64,1,4 128,1,4 256,1,4 64,4,4 128,2,4} \
  --json-out "$OUT/tune_cuda.json" 2>&1 | grep -A1 BEST | tee "$OUT/tune_cuda.txt"
exit 0
