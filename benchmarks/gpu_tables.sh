#!/usr/bin/env bash
# One H100 call: every benchmark table with SGLang's kernel measured in the same run (carry
# .ab/peers, see gpu_peer.sh). bf16 with all variants and torch.compile; fp8, GPT-J, partial.
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=.:$PWD/.ab/peers/py312 PYTHONUNBUFFERED=1 SGL_BENCH_SGLANG_DIR=$PWD/.ab/peers/sg
export SGL_EXT_CACHE_DIR=/tmp/sgl_ext_cache
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/device.txt"
timeout 120 python benchmarks/peers.py > /dev/null 2>&1
B="python benchmarks/bench_rope_kv.py"
timeout 200 $B --json-out "$OUT/bench_bf16.json" --plot "$OUT/bench_bf16.png" 2>&1 | grep -v '^{' | tail -24 | tee "$OUT/bench_bf16.txt"
timeout 60 $B --no-compile --kv-dtype fp8_e4m3 --json-out "$OUT/bench_fp8.json" 2>&1 | grep -v '^{' | tail -20 | tee "$OUT/bench_fp8.txt"
timeout 60 $B --no-compile --gptj --json-out "$OUT/bench_gptj.json" 2>&1 | grep -v '^{' | tail -20 | tee "$OUT/bench_gptj.txt"
timeout 60 $B --no-compile --rot-frac 0.5 --json-out "$OUT/bench_partial.json" 2>&1 | grep -v '^{' | tail -20 | tee "$OUT/bench_partial.txt"
exit 0
