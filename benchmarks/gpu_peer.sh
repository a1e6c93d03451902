#!/usr/bin/env bash
# One H100 call: SGLang's own fused kernel built from the sglang wheel (peers.py) and timed
# in the same run as ours. Carry .ab/peers (unzipped sglang wheel subset in .ab/peers/sg, the
# apache-tvm-ffi cp312 wheel unzipped in .ab/peers/py312); neither is part of the repository.
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=.:$PWD/.ab/peers/py312 PYTHONUNBUFFERED=1 SGL_BENCH_SGLANG_DIR=$PWD/.ab/peers/sg
export SGL_EXT_CACHE_DIR=/tmp/sgl_ext_cache
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/device.txt"
python -c "import torch, triton, sys; print(sys.version.split()[0], torch.__version__, triton.__version__, hasattr(torch.Tensor, '__dlpack_c_exchange_api__'))" | tee -a "$OUT/device.txt"
( time timeout 120 python benchmarks/peers.py ) 2>&1 | tail -8 | tee "$OUT/peer_build.txt"
B="python benchmarks/bench_rope_kv.py"
timeout 200 $B --json-out "$OUT/bench_bf16.json" --plot "$OUT/bench_bf16.png" 2>&1 | tail -24 | tee "$OUT/bench_bf16.txt"
timeout 60 $B --only-fused --gptj --json-out "$OUT/bench_gptj.json" 2>&1 | tail -20 | tee "$OUT/bench_gptj.txt"
timeout 60 python benchmarks/tune_rope_kv.py --tokens 1 --shapes gpt-oss-20b llama3-8b --block-h 1 2 4 --warps 1 2 4 --pdl 1 --order 0 2>&1 | tail -30 | tee "$OUT/tune_t1.txt"
exit 0
