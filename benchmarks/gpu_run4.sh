#!/usr/bin/env bash
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
python -m pytest -q tests/sgl_ext 2>&1 | tail -3 | tee $OUT/pytest_sgl_ext.txt
python benchmarks/tune_rope_kv.py --pdl 1 --tokens 1 32 128 512 2048 32768 --block-h 1 2 4 8 16 32 --warps 1 2 4 --json-out $OUT/tune.json 2>&1 | grep -E "BEST" | tee $OUT/tune.txt
python benchmarks/tune_rope_kv.py --pdl 1 --gptj --tokens 128 2048 32768 --block-h 4 8 16 32 --warps 1 2 4 2>&1 | grep -E "BEST" | tee $OUT/tune_gptj.txt
python benchmarks/bench_rope_kv.py --no-compile --kv-dtype fp8_e4m3 --tokens 1 32 128 512 2048 32768 2>&1 | tail -15 | tee $OUT/bench_fp8.txt
python benchmarks/bench_rope_kv.py --no-compile --gptj --tokens 1 32 128 512 2048 32768 2>&1 | tail -15 | tee $OUT/bench_gptj.txt
python -m pytest -q tests/srt -k "cuda or graph or shared_rope" 2>&1 | tail -3 | tee $OUT/pytest_layers_gpu.txt
compute-sanitizer --tool racecheck --error-exitcode 9 python tests/srt/mem_cache/gpu_stream_check.py 2>&1 | tail -3 | tee $OUT/racecheck.txt
compute-sanitizer --tool memcheck --error-exitcode 9 python tests/srt/mem_cache/gpu_stream_check.py --replays 50 2>&1 | tail -3 | tee $OUT/memcheck_pool.txt
