#!/usr/bin/env bash
# One H100 call: merged programs on the 2-D (tokens, blocks) grid, i.e. every token's key/value
# (heavy) program launched before any query-only program, against the token-major default.
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1
A="timeout 100 python benchmarks/ab_triton_config.py --rounds 5 --tokens 128 512 2048"
$A --shape llama3-8b --configs default 8,4,0,1 16,4,1,1 16,4,0,1 2>&1 | tee -a "$OUT/ab_order.txt"
$A --shape gpt-oss-20b --configs default 16,4,0,1 32,8,0,1 2>&1 | tee -a "$OUT/ab_order.txt"
$A --shape llama3-8b --kv-dtype fp8_e4m3 --configs default 8,4,0,1 2>&1 | tee -a "$OUT/ab_order.txt"
$A --shape gpt-oss-20b --gptj --configs default 16,4,0,1 32,8,0,1 2>&1 | tee -a "$OUT/ab_order.txt"
exit 0
