#!/usr/bin/env bash
# One H100 call: small T with positions over the whole 131072-row cos/sin table (the default:
# rows mostly miss in L2) against positions below 1024 (rows stay in L2), ours and SGLang's
# kernel, bf16 and fp8. Carry .ab/peers as for gpu_peers.sh.
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
P=$PWD/.ab/peers
export PYTHONPATH=.:$P/py312 PYTHONUNBUFFERED=1 SGL_BENCH_SGLANG_DIR=$P/sg SGL_EXT_CACHE_DIR=$P/cache
B="timeout 60 python benchmarks/bench_rope_kv.py --only-fused --tokens 1 8 32"
for r in "" "--pos-range 1024"; do
  for kv in bf16 fp8_e4m3; do
    $B --kv-dtype $kv $r 2>&1 | grep -v '^{' | grep -v '^#' | tail -9 | tee -a "$OUT/pos_range.txt"
  done
done
exit 0
