#!/usr/bin/env bash
# One H100 call: fp8-cache launch configurations at large T (the fp8 variant holds 48 registers,
# 10 resident 4-warp programs per SM instead of bf16's 12): register caps and block shapes.
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1
A="timeout 120 python benchmarks/ab_triton_config.py --rounds 5 --kv-dtype fp8_e4m3 --tokens 2048 8192 32768"
$A --shape llama3-8b --configs default 8,4,1,1,0,40 8,4,1,1,0,44 16,8,1,1 16,4,1,1 4,2,1,1 2>&1 | tee -a "$OUT/ab_fp8_large.txt"
$A --shape gpt-oss-20b --configs default 32,8,1,1,0,40 16,4,1,1 16,4,1,1,0,40 16,8,1,1 2>&1 | tee -a "$OUT/ab_fp8_large.txt"
# second round: where the fp8 block shapes start to win
A="timeout 150 python benchmarks/ab_triton_config.py --rounds 5 --kv-dtype fp8_e4m3 --tokens 768 1024 1536 2048 4096 16384"
$A --shape llama3-8b --configs default 16,4,1,1 16,4,1,1,0,40 16,4,2,1 2>&1 | tee -a "$OUT/ab_fp8_large2.txt"
$A --shape gpt-oss-20b --configs default 16,4,1,1,0,40 16,4,1,1,0,36 2>&1 | tee -a "$OUT/ab_fp8_large2.txt"
exit 0
