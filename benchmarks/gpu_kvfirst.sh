#!/usr/bin/env bash
# One H100 call: A/B of the key/value-first grid order (ORDER_KV_FIRST) against token-major
# (default) and the 2-D grid, alternating rounds; then the launch-config tests on the GPU.
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1
A="timeout 120 python benchmarks/ab_triton_config.py --rounds 5 --tokens 128 256 512 1024 2048 8192"
$A --shape llama3-8b --configs default 8,4,2,1 8,4,0,1 2>&1 | tee -a "$OUT/ab_kvfirst.txt"
$A --shape llama3-8b --kv-dtype fp8_e4m3 --configs default 8,4,2,1 8,4,0,1 2>&1 | tee -a "$OUT/ab_kvfirst.txt"
$A --shape gpt-oss-20b --configs default 16,4,2,1 32,8,2,1 2>&1 | tee -a "$OUT/ab_kvfirst.txt"
$A --shape llama3-8b --gptj --configs default 8,4,2,1 2>&1 | tee -a "$OUT/ab_kvfirst.txt"
timeout 150 python -m pytest -q -p no:cacheprovider tests/sgl_ext/test_rope.py -k "launch or triton" 2>&1 | tail -2 | tee "$OUT/pytest.txt"
exit 0
