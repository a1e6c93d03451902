#!/usr/bin/env bash
# Short H100 check after a launch-layout change: Triton GPU tests, small-T tables (all variants).
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 100 python -m pytest -q tests/sgl_ext/test_rope.py tests/sgl_ext/test_compile_and_graphs.py 2>&1 | tail -1 | tee "$OUT/pytest.txt"
for v in "" "--kv-dtype fp8_e4m3" "--gptj" "--rot-frac 0.5"; do
  echo "== $v"; timeout 40 python benchmarks/bench_rope_kv.py --no-compile --tokens 1 8 32 128 512 $v 2>&1 | grep "^| [lg]"
done | tee "$OUT/small_t.txt"
