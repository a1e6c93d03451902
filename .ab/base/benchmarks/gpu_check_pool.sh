set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 80 python -m pytest -q tests/srt/mem_cache tests/srt/entrypoints/test_engine.py -k "cuda or graph or gpu or stream" 2>&1 | tail -2
timeout 100 compute-sanitizer --tool racecheck --error-exitcode 9 python tests/srt/mem_cache/gpu_stream_check.py --replays 20 2>&1 | tail -2; echo "racecheck rc=${PIPESTATUS[0]}"
timeout 100 compute-sanitizer --tool memcheck --error-exitcode 9 python tests/srt/mem_cache/gpu_stream_check.py --replays 10 2>&1 | tail -2; echo "memcheck rc=${PIPESTATUS[0]}"
timeout 60 python benchmarks/bench_rope_kv.py --shapes gpt-oss-20b 2>&1 | tail -10
