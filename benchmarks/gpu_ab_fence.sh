#!/usr/bin/env bash
# One H100 call: A/B of the fenced key/value loads (SGL_EXT_TRITON_FENCE) and of the session-start
# kernel (.ab/base = `git archive b7aabe5`) against HEAD, small T and the merged range, bf16 and
# fp8 (tensor scales); then the Triton tests on the GPU.
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
B="python benchmarks/bench_rope_kv.py --only-fused"
row() { grep "^| " | grep -v "shape\|---" | awk -F'|' '{printf "%s T=%s %s\n", $2, $3, $4}'; }
for round in 1 2; do
  for kv in bf16 fp8_e4m3; do
    echo "== r$round $kv base";  (cd .ab/base && PYTHONPATH=. timeout 40 $B --kv-dtype $kv --tokens 1 8 32 64 2>&1 | row)
    echo "== r$round $kv fence0"; SGL_EXT_TRITON_FENCE=0 PYTHONPATH=. timeout 40 $B --kv-dtype $kv --tokens 1 8 32 64 2>&1 | row
    echo "== r$round $kv fence1"; PYTHONPATH=. timeout 40 $B --kv-dtype $kv --tokens 1 8 32 64 2>&1 | row
  done
done | tee "$OUT/ab_small.txt"
for kv in bf16 fp8_e4m3; do
  echo "== $kv base";  (cd .ab/base && PYTHONPATH=. timeout 60 $B --kv-dtype $kv --tokens 128 512 2048 2>&1 | row)
  echo "== $kv head"; PYTHONPATH=. timeout 60 $B --kv-dtype $kv --tokens 128 512 2048 2>&1 | row
done | tee "$OUT/ab_merged.txt"
PYTHONPATH=. timeout 200 python -m pytest -q -p no:cacheprovider tests/sgl_ext 2>&1 | tail -3 | tee "$OUT/pytest.txt"
exit 0
