#!/usr/bin/env bash
# Small-T A/B in one call: an older kernel against HEAD. Prepare the older copies first (on the
# dev machine; the device copy has no git):
#   mkdir -p .ab/old && git archive d6f4ed8 sgl_ext benchmarks/bench_rope_kv.py | tar -x -C .ab/old
# (likewise .ab/<commit> for bisection steps; list them in the loop below).
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
b() { timeout 40 python benchmarks/bench_rope_kv.py --no-compile --tokens 1 8 --shapes llama3-8b 2>&1 | grep "^| l" | cut -d'|' -f3,4,5; }
for round in 1 2; do
  for d in old; do echo "== $d r$round"; (cd .ab/$d && PYTHONPATH=. b); done
  echo "== HEAD r$round"; PYTHONPATH=. b
  echo "== HEAD head-major r$round"; SGL_EXT_TRITON_CONFIG=1,4,0,0 PYTHONPATH=. b
done | tee "$OUT/ab.txt"
