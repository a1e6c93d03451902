#!/usr/bin/env bash
# One H100 call: the srt tests that failed in the whole-suite GPU run, at the session-start commit
# (.ab/base, from `git archive b7aabe5`) and now; then CUDA-vs-Triton tables with final defaults.
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
T="tests/srt/entrypoints/test_engine.py::test_triton_attention_backend_agrees_with_torch_native tests/srt/layers/test_rotary_embedding.py::test_triton_backend_fused tests/srt/mem_cache/test_memory_pool.py::test_set_kv_buffer_triton_backend_cross_layer tests/srt/models/test_gpt_oss.py"
python -c "import transformers, torch; print('transformers', transformers.__version__, 'torch', torch.__version__)" | tee "$OUT/versions.txt"
(cd .ab/base && PYTHONPATH=. timeout 150 python -m pytest -q -p no:cacheprovider $T 2>&1 | grep -E "passed|failed|FAILED|Error" | tail -15) | sed 's/^/[base] /' | tee "$OUT/base.txt"
PYTHONPATH=. timeout 150 python -m pytest -q -p no:cacheprovider $T 2>&1 | grep -E "passed|failed|FAILED|Error" | tail -15 | sed 's/^/[head] /' | tee "$OUT/head.txt"
export PYTHONPATH=.
B="python benchmarks/bench_rope_kv.py --compare --only-fused"
timeout 60 $B --json-out "$OUT/cmp_bf16.json" 2>&1 | tail -19 | tee "$OUT/cmp_bf16.txt"
timeout 45 $B --kv-dtype fp8_e4m3 --tokens 1 8 32 128 512 2048 --json-out "$OUT/cmp_fp8.json" 2>&1 | tail -15 | tee "$OUT/cmp_fp8.txt"
timeout 45 $B --gptj --tokens 1 8 32 128 512 2048 --json-out "$OUT/cmp_gptj.json" 2>&1 | tail -15 | tee "$OUT/cmp_gptj.txt"
timeout 45 $B --rot-frac 0.5 --tokens 1 8 32 128 512 2048 --json-out "$OUT/cmp_partial.json" 2>&1 | tail -15 | tee "$OUT/cmp_partial.txt"
exit 0
