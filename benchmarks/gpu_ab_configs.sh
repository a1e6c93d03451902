#!/usr/bin/env bash
# One H100 call: the launch-configuration A/B runs of NOTES.md (fourth session), each in
# alternating rounds of one process (ab_triton_config.py): a register cap, heavy-first orders
# (2-D grid, key/value first) and the token window where key/value first wins. "default" is the
# launch_config heuristic of the commit under test.
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1
A="timeout 100 python benchmarks/ab_triton_config.py --rounds 5"
T="--tokens 128 512 2048"
# register cap (6th field) and finer merged blocks
$A $T --shape llama3-8b --configs default 8,4,1,1,0,32 4,2,1,1 4,4,1,1 16,8,1,1,0,32 2>&1 | tee -a "$OUT/ab.txt"
$A $T --shape gpt-oss-20b --configs default 16,4,1,1,0,32 32,8,1,1,0,32 8,2,1,1 2>&1 | tee -a "$OUT/ab.txt"
# grid order (3rd field): 0 2-D (tokens, blocks), 1 token-major, 2 key/value programs first
T="--tokens 128 256 512 1024 2048 8192"
$A $T --shape llama3-8b --configs 8,4,1,1 8,4,2,1 8,4,0,1 2>&1 | tee -a "$OUT/ab.txt"
$A $T --shape llama3-8b --kv-dtype fp8_e4m3 --configs 8,4,1,1 8,4,2,1 2>&1 | tee -a "$OUT/ab.txt"
$A $T --shape gpt-oss-20b --configs default 16,4,2,1 32,8,2,1 2>&1 | tee -a "$OUT/ab.txt"
T="--tokens 320 384 448 512 576 640 768 896"
$A $T --shape llama3-8b --configs 8,4,1,1 8,4,2,1 2>&1 | tee -a "$OUT/ab.txt"
$A $T --shape llama3-8b --kv-dtype fp8_e4m3 --configs 8,4,1,1 8,4,2,1 2>&1 | tee -a "$OUT/ab.txt"
exit 0
