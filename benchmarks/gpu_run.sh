#!/usr/bin/env bash
# The one GPU runner: named targets, run in the order given, in one device call.
#
#   bash benchmarks/gpu_run.sh info tests memcheck rope e2e profile
#
# Every target logs to $LOGS/<target>.txt (default /tmp/gpu_logs); at the end the logs are packed
# into $OUT/gpu_logs.tgz (when $OUT is set) and a short summary of each target is printed, so the
# end of the output says how each went. Targets that need the peers' kernels read the ignored
# .ab/peers folder made by benchmarks/prepare_peers.sh (carry it to the device).
#
# Targets:
#   info       GPU name, torch/triton versions, device-copy bandwidth
#   tests      every test file's GPU tests (the CPU ones too: the whole suite)
#   memcheck   compute-sanitizer memcheck over the kernel sweep
#   rope       bench_rope_kv tables: bf16 graph + eager, fp8, GPT-J, partial rotary, vs peers
#   eager      host time per eager call: ours vs SGLang / FlashInfer and set_kv_buffer vs indexing
#   qknorm     bench_qk_norm_rope tables (Qwen3-8B / Qwen3-32B shapes)
#   moe        bench_moe (gpt-oss-20b shape): routed-expert kernel vs torch, floor
#   e2e        bench_one_batch on llama3-8b / qwen3-8b / gpt-oss-20b, eager + graph
#   profile    per-kernel breakdown of one decode step (llama3-8b bs 1 and 64)
set -u
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}. PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
LOGS=${LOGS:-/tmp/gpu_logs}
mkdir -p "$LOGS"
P=$PWD/.ab/peers
peers_env() {
  if [ -d "$P/sg" ]; then
    export PYTHONPATH=$PYTHONPATH:$P/py312 SGL_BENCH_SGLANG_DIR=$P/sg
    export SGL_BENCH_FLASHINFER_DIR=$P/fi SGL_EXT_CACHE_DIR=$P/cache
  fi
}
E2E_PRESETS=${E2E_PRESETS:-llama3-8b qwen3-8b gpt-oss-20b}
E2E_BS=${E2E_BS:-1 8 32 64}

t_info() {
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
  python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  python - <<'EOF'
import torch, triton.testing as tt
x = torch.empty(1 << 28, dtype=torch.float32, device="cuda"); y = torch.empty_like(x)
ms = tt.do_bench(lambda: y.copy_(x), warmup=50, rep=200, return_mode="median")
print(f"device copy 1 GiB: {2 * x.numel() * 4 / ms / 1e6:.0f} GB/s (read + write)")
EOF
}
t_tests() { timeout 540 python -m pytest -q -p no:cacheprovider tests -x -rfE; }
t_memcheck() {
  # every case twice (the second call is a direct launch of the compiled kernel), NaN / inf into
  # fp8 caches
  timeout 300 compute-sanitizer --tool memcheck --error-exitcode 9 \
    python tests/sgl_ext/gpu_memcheck_sweep.py
}
t_rope() {
  peers_env
  local B="timeout 150 python benchmarks/bench_rope_kv.py"
  $B --only-fused
  $B --only-fused --kv-dtype fp8_e4m3
  $B --only-fused --gptj --tokens 1 128 512 2048 32768
  $B --only-fused --rot-frac 0.5 --tokens 1 128 512 2048 32768
}
t_eager() {
  peers_env
  # eager µs per call (host + device, and host only): ours fused / RoPE-only / CUDA C++ backend,
  # SGLang fused / RoPE-only, FlashInfer, unfused, set_kv_buffer vs indexing; floor x.add_(1)
  timeout 420 python benchmarks/bench_rope_kv.py --eager --json-out "$LOGS/eager.json"
  # the same with direct launches off (the JIT path per call): what the direct launch saves
  SGL_EXT_DIRECT_LAUNCH=0 timeout 150 python benchmarks/bench_rope_kv.py --eager \
    --tokens 1 64 512 --shapes llama3-8b
}
t_qknorm() { peers_env; timeout 300 python benchmarks/bench_qk_norm_rope.py; }
t_moe() { timeout 300 python benchmarks/bench_moe.py; }
t_e2e() {
  for m in $E2E_PRESETS; do
    timeout 400 python -m srt.bench_one_batch --model-preset "$m" --batch-size $E2E_BS \
      --input-len 512 --output-len 32
  done
}
t_profile() {
  for bs in 1 64; do
    timeout 200 python benchmarks/profile_decode.py --model-preset llama3-8b --batch-size $bs
  done
}

summary=()
for t in "$@"; do
  if ! declare -F "t_$t" >/dev/null; then echo "unknown target: $t" >&2; exit 2; fi
  echo "===== $t" | tee "$LOGS/$t.txt"
  start=$(date +%s)
  ( "t_$t" ) 2>&1 | tee -a "$LOGS/$t.txt"
  rc=${PIPESTATUS[0]}
  summary+=("$t: rc=$rc $(($(date +%s) - start))s | $(grep -E 'passed|failed|ERROR|error' \
    "$LOGS/$t.txt" | tail -1 | cut -c1-150)")
done
[ -n "${OUT:-}" ] && tar -C "$LOGS" -czf "$OUT/gpu_logs.tgz" .
printf '%s\n' "===== summary" "${summary[@]}"
