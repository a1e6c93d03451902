#!/usr/bin/env bash
# One H100 call: where does the key/value-first order win? Llama shape (D=128), T around 512.
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1
A="timeout 120 python benchmarks/ab_triton_config.py --rounds 5 --tokens 320 384 448 512 576 640 768 896"
$A --shape llama3-8b --configs default 8,4,2,1 2>&1 | tee -a "$OUT/ab_kvfirst2.txt"
$A --shape llama3-8b --kv-dtype fp8_e4m3 --configs default 8,4,2,1 2>&1 | tee -a "$OUT/ab_kvfirst2.txt"
exit 0
