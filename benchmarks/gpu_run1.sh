#!/usr/bin/env bash
# One device call: GPU tests of sgl_ext, memcheck sweep, kernel benchmarks.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
python -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())"
python -m pytest -q tests/sgl_ext -x 2>&1 | tail -5 | tee $OUT/pytest_sgl_ext.txt
compute-sanitizer --tool memcheck --error-exitcode 9 python tests/sgl_ext/gpu_memcheck_sweep.py 2>&1 | tail -4 | tee $OUT/memcheck.txt
python benchmarks/bench_rope_kv.py --json-out $OUT/bench_bf16.json --plot $OUT/bench_bf16.png 2>&1 | tee $OUT/bench_bf16.txt | tail -22
python benchmarks/bench_rope_kv.py --no-compile --kv-dtype fp8_e4m3 --tokens 1 128 2048 32768 2>&1 | tail -11 | tee $OUT/bench_fp8.txt
python benchmarks/bench_rope_kv.py --no-compile --rot-frac 0.5 --tokens 1 128 2048 32768 2>&1 | tail -11 | tee $OUT/bench_partial.txt
python benchmarks/bench_rope_kv.py --no-compile --gptj --tokens 1 128 2048 32768 2>&1 | tail -11 | tee $OUT/bench_gptj.txt
