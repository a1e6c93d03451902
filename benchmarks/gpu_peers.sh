#!/usr/bin/env bash
# One H100 call: both peers (SGLang's fused kernel, FlashInfer's RoPE and fp8 fused append) in
# the benchmark tables. Carry .ab/peers: sg/ and fi/ (unzipped wheel subsets), py312/ (the
# apache-tvm-ffi cp312 wheel unzipped), cache/ (modules prebuilt by `python benchmarks/peers.py`
# on a CPU machine with nvcc). None of it is part of the repository.
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
P=$PWD/.ab/peers
export PYTHONPATH=.:$P/py312 PYTHONUNBUFFERED=1 SGL_BENCH_SGLANG_DIR=$P/sg SGL_BENCH_FLASHINFER_DIR=$P/fi
export SGL_EXT_CACHE_DIR=$P/cache
timeout 200 python benchmarks/peers.py 2>&1 | tail -5 | tee "$OUT/peers_build.txt"
B="python benchmarks/bench_rope_kv.py --only-fused"
timeout 90 $B --json-out "$OUT/bf16.json" 2>&1 | grep -v '^{' | tail -24 | tee "$OUT/bf16.txt"
timeout 60 $B --kv-dtype fp8_e4m3 --json-out "$OUT/fp8.json" 2>&1 | grep -v '^{' | tail -24 | tee "$OUT/fp8.txt"
timeout 60 $B --gptj --tokens 1 128 512 2048 32768 --json-out "$OUT/gptj.json" 2>&1 | grep -v '^{' | tail -16 | tee "$OUT/gptj.txt"
timeout 60 $B --rot-frac 0.5 --tokens 1 128 512 2048 32768 --json-out "$OUT/partial.json" 2>&1 | grep -v '^{' | tail -16 | tee "$OUT/partial.txt"
exit 0
