#!/usr/bin/env bash
# One H100 call: A/B of a register cap (16 resident 4-warp programs per SM instead of 12) and
# finer merged blocks, against the default launch configuration, in alternating rounds.
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1
A="timeout 100 python benchmarks/ab_triton_config.py --rounds 5 --tokens 128 512 2048"
$A --shape llama3-8b --configs default 8,4,1,1,0,32 4,2,1,1 4,2,1,1,0,32 4,4,1,1 16,8,1,1,0,32 2>&1 | tee -a "$OUT/ab_maxnreg.txt"
$A --shape gpt-oss-20b --configs default 16,4,1,1,0,32 32,8,1,1,0,32 8,2,1,1 16,8,1,1 2>&1 | tee -a "$OUT/ab_maxnreg.txt"
$A --shape llama3-8b --gptj --configs default 8,4,1,1,0,32 2>&1 | tee -a "$OUT/ab_maxnreg.txt"
exit 0
