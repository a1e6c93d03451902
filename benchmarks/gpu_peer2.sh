#!/usr/bin/env bash
# One H100 call: ours vs SGLang's kernel (measured, peers.py) at every T, twice; GPT-J;
# same-size copies for the bandwidth goal; A/B rounds of T=1 launch configurations.
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=.:$PWD/.ab/peers/py312 PYTHONUNBUFFERED=1 SGL_BENCH_SGLANG_DIR=$PWD/.ab/peers/sg
export SGL_EXT_CACHE_DIR=/tmp/sgl_ext_cache
timeout 120 python benchmarks/peers.py > /dev/null 2>&1
B="python benchmarks/bench_rope_kv.py --only-fused"
for i in 1 2; do
  timeout 80 $B --json-out "$OUT/peer_bf16_$i.json" 2>&1 | grep -v '^{' | tail -40 | tee "$OUT/peer_bf16_$i.txt"
done
timeout 60 $B --gptj --tokens 1 8 32 128 512 2048 --json-out "$OUT/peer_gptj.json" 2>&1 | grep -v '^{' | tail -30 | tee "$OUT/peer_gptj.txt"
A="timeout 60 python benchmarks/ab_triton_config.py --rounds 7"
$A --shape gpt-oss-20b --configs default 2,4,0 2,2,0 4,2,0 1,2,0 1,1,0 2>&1 | tee "$OUT/ab_gptoss_t1.txt"
$A --shape llama3-8b --kv-dtype fp8_e4m3 --configs default 1,2,0 1,1,0 2,4,0 2,2,0 2>&1 | tee "$OUT/ab_fp8_t1.txt"
$A --shape llama3-8b --configs default 1,2,0 1,1,0 2,4,0 2>&1 | tee "$OUT/ab_llama_t1.txt"
exit 0
