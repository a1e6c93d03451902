#!/usr/bin/env bash
# One H100 call: ours vs SGLang's kernel (measured) at T <= 2048 with fresh inputs for the
# agreement check, twice; GPT-J; A/B of GPT-J launch configurations against neox.
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=.:$PWD/.ab/peers/py312 PYTHONUNBUFFERED=1 SGL_BENCH_SGLANG_DIR=$PWD/.ab/peers/sg
export SGL_EXT_CACHE_DIR=/tmp/sgl_ext_cache
timeout 120 python benchmarks/peers.py > /dev/null 2>&1
B="python benchmarks/bench_rope_kv.py --only-fused --tokens 1 8 32 128 512 2048"
for i in 1 2; do
  timeout 60 $B --json-out "$OUT/peer_bf16_$i.json" 2>&1 | grep -v '^{' | tail -32 | tee "$OUT/peer_bf16_$i.txt"
done
timeout 60 $B --gptj --json-out "$OUT/peer_gptj.json" 2>&1 | grep -v '^{' | tail -32 | tee "$OUT/peer_gptj.txt"
A="timeout 50 python benchmarks/ab_triton_config.py --rounds 5 --tokens 128 512"
for s in gpt-oss-20b llama3-8b; do
  $A --shape $s 2>&1 | tee -a "$OUT/ab_gptj.txt"
  $A --shape $s --gptj --configs default 8,4,1,1 16,4,1,1 32,8,1,1 16,8,1,1 2>&1 | tee -a "$OUT/ab_gptj.txt"
done
exit 0
