#!/usr/bin/env bash
# The whole GPU check in one device call (H100): every test file's GPU tests, the memcheck sweep,
# the kernel benchmarks and the end-to-end benchmark. Results under $OUT (or ./out).
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 170 python -m pytest -q tests/sgl_ext 2>&1 | tail -3 | tee "$OUT/pytest_sgl_ext.txt"
timeout 200 python -m pytest -q tests/srt -k "cuda or graph or gpu or shared_rope" 2>&1 | tail -3 | tee "$OUT/pytest_srt_gpu.txt"
timeout 120 compute-sanitizer --tool memcheck --error-exitcode 9 python tests/sgl_ext/gpu_memcheck_sweep.py 2>&1 | tail -2 | tee "$OUT/memcheck.txt"
[ -n "${RACE:-}" ] && timeout 120 compute-sanitizer --tool racecheck --error-exitcode 9 python tests/srt/mem_cache/gpu_stream_check.py --replays 20 2>&1 | tail -2 | tee "$OUT/racecheck.txt"
timeout 150 python benchmarks/bench_rope_kv.py --json-out "$OUT/bench_bf16.json" --plot "$OUT/bench_bf16.png" 2>&1 | tail -20 | tee "$OUT/bench_bf16.txt"
for v in "--kv-dtype fp8_e4m3" "--gptj" "--rot-frac 0.5"; do
  timeout 60 python benchmarks/bench_rope_kv.py --no-compile $v 2>&1 | tail -18
done | tee "$OUT/bench_variants.txt"
[ -n "${E2E:-}" ] && timeout 200 python benchmarks/bench_e2e.py --preset llama3-8b 2>&1 | tail -7 | tee "$OUT/e2e_llama.txt"
[ -n "${E2E:-}" ] && timeout 170 python benchmarks/bench_e2e.py --preset gpt-oss-20b 2>&1 | tail -7 | tee "$OUT/e2e_gptoss.txt"
