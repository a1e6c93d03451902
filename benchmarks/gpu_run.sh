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
#   gputests   only the tests that need CUDA (pytest --gpu-only: a "needs CUDA" skipif or a cuda
#              parameter), kernels | the runtime in two processes: the quick GPU pass after a merge
#   fast       the C fast path's tests and the op tests that go through it (issue 14)
#   layers     the decoder-layer tests only (norm / SiLU kernels, attention backends, models,
#              graph runner), for a quick check of issue 15's work
#   sweep      the fused write against float64 (tests/sgl_ext/rope_kv_sweep.py, 6 processes): random
#              cases at every launch-table bound (T 1..32768; dtypes, caches, layouts, slots),
#              issue 51's case over 400 seeds and every table row forced; then the in-place
#              fence check of every compiled layout (inplace_race_check.py)
#   memcheck   compute-sanitizer memcheck over the kernel sweep
#   rope       bench_rope_kv tables: bf16 graph + eager, fp8, GPT-J, partial rotary, vs peers
#   eager      host time per eager call: ours (RoPE, q/k-norm op) vs SGLang / FlashInfer and
#              set_kv_buffer vs indexing, both shapes, T 1..32768 (interleaved rounds, medians)
#   qknorm     q/k-norm op + Qwen3 GPU tests, bench_qk_norm_rope tables (Qwen3-8B / -32B shapes)
#   qknorm_sweep  tune_qk_norm.py (issue 17): per T (1 8 32 128 512; QKNORM_TOKENS), RoPE + KV
#              alone vs the q/k-norm op under each candidate layout / POS_LAST of its row of
#              sgl_ext/tables/qk_norm.json, both Qwen3 shapes, 2 rounds; QKNORM_ROW winners and
#              the rows as qk_norm.json takes them; then the POS_LAST GPU bit tests (< 8 min)
#   moe        MoE tests (test_moe*.py incl. the GEMV kernels, gpt-oss MXFP4 model tests, GPU ones included) + bench_moe
#              (gpt-oss-20b shape): routed-expert kernel vs torch, read floor; bf16 experts, then
#              MXFP4 experts (ours = table mode, alt = the other MXFP4 mode)
#   router     gpt-oss's fused router (router GEMM + top-k + x's fp16 words in one launch): its
#              tests, the top-k and gpt-oss MXFP4 model GPU tests, bench_router (vs two launches)
#   moe_sweep  bench_moe --sweep: launch configurations per T, best printed as moe.json rows
#              (MOE_SWEEP_ARGS=--mxfp4 for the MXFP4 kernels)
#   moe_sweep_mxfp4  bench_moe --mxfp4 --sweep at decode sizes (T 1 8 32 64; dot_scaled, the
#              scale prefetch on / off), floor per T, best printed as moe.json rows
#              (MXFP4_SWEEP_ARGS="--mxfp4-modes dot_scaled split" adds the split mode)
#   moe_gemv   the per-pair GEMV MoE kernels: tests + bench_moe --sweep-gemv (MXFP4, bf16) at
#              T in GEMV_TOKENS (default 1 2 4 8)
#   e2e        bench_one_batch on llama3-8b / qwen3-8b / gpt-oss-20b, eager + graph
#   engine     the overlap schedule: its GPU tests (greedy kernel, scheduler, hybrid pool), then
#              bench_engine (Engine decode step, overlap off / on, beside the graph alone and
#              the read floor) on ENGINE_PRESETS (default gpt-oss-20b-mxfp4 at bs 1 8, llama3-8b)
#   cli        bench_one_batch / gpqa CLI GPU tests, --correctness-test with graphs, floor + --profile
#   layerbench bench_layers: add+RMSNorm / RMSNorm / SiLU-and-mul kernels vs torch-native and
#              split-KV decode attention, device time in CUDA graphs with floors (llama3-8b,
#              qwen3-8b shapes); eager µs per call of every layer op, direct launch on / off
#   profile    per-kernel breakdown of one decode step (PROFILE_PRESETS, default llama3-8b and
#              qwen3-8b; bs 1 and 64), eager wall per decoder layer
#   ablation   bench_graph_ablation --replays: each per-layer kernel of a decode step launched
#              twice or left out, all variants' graphs replayed in turn (ABLATION_PRESET, default
#              gpt-oss-20b-mxfp4, bs 1; ABLATION_VARIANTS overrides the list)
#   small      small-T tables (T 1/8/32), bf16 and fp8, positions over the whole cos/sin table
#              and below 1024 (cos/sin rows in L2), ours vs peers
#   peers      build SGLang's / FlashInfer's kernels from .ab/peers and check they load
#   pool       KV-pool GPU tests; racecheck + memcheck of the two-stream K/V write under graphs
#   tune       launch-configuration sweep of the Triton kernel (tune_rope_kv.py)
#   tp         needs 2 GPUs (nvidia-h200-x2): TP GPU tests, TP 1 vs 2 decode tokens/s
#   reliab     allocator / scheduler failure-path and context tests; host time of the decode path
#   swa        hybrid sliding-window KV pool (issue 20): its tests (GPU graph == eager included),
#              bench_one_batch gpt-oss-20b input 4096 hybrid vs uniform (same batch), and
#              bench_swa.py: N long prompts through the scheduler in the same KV memory
#   hostprof   where an eager decode step's host time goes: cProfile of eager steps (llama3-8b,
#              qwen3-8b, bs 1), top functions by own time
#   attn       issue 15 attention: backend + scrub + layernorm GPU tests, decode / extend tile
#              sweeps (graph-timed per layer over per-layer caches, floors printed), shared-prefix
#              (cascade) decode vs plain at B 256 in 8 groups, split-KV extend after a long prefix
#              (issue 48)
#   serving    issue 48's serving measurements (python -m srt.bench_serving, in-process Engine,
#              SERVING_PRESET default llama3-8b, random bf16 weights): (a) generated-shared-prefix
#              16 groups x 32 prompts, system 2048, question 128, output 256, radix cache on (cascade
#              decode on / off) / off; (b) random 512 prompts, in 1024 / out 256, cache on / off;
#              (c) 32 decoders (in 512, out 256) while a 32768-token prompt arrives after 1 s,
#              chunked prefill at the GPU's default size with chunks of 256 (default) / 128 /
#              512 / the whole size (SGLang) while others decode, and off. One jsonl line per run in ${OUT:-$LOGS}/serving.jsonl,
#              then the goals' ratios. Sizes: SERVING_GSP_GROUPS, SERVING_GSP_PER_GROUP,
#              SERVING_RANDOM_PROMPTS, SERVING_LPA_LONG, SERVING_LPA_DECODERS
#   gemm       issue 15 decode GEMMs: skinny Triton GEMM + gemm_choice GPU tests, then
#              bench_gemm (F.linear / mv / x@w_t / Triton sweep at M 1..64, L2-cold graph timing,
#              floors); ends with rows for sgl_ext/tables/gemm.json and the
#              per-layer sums (GEMM_ARGS: extra bench_gemm arguments; "--lm-head": the
#              presets' LM heads instead of the decoder layers' linears)
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
  python benchmarks/bench_util.py  # device-copy bandwidth, as every bench's floor measures it
}
t_tests() {
  # two pytest processes side by side (kernels + layers | the rest), each with its own log and
  # timeout, so a slow half cannot cut the other's failure summary
  local T="timeout ${TESTS_TIMEOUT:-560} python -m pytest -q -p no:cacheprovider -rfE --tb=line"
  $T tests/sgl_ext tests/srt/layers >"$LOGS/tests_a.txt" 2>&1 &
  local a=$!
  $T tests --ignore=tests/sgl_ext --ignore=tests/srt/layers >"$LOGS/tests_b.txt" 2>&1 &
  local b=$!
  wait $a; local ra=$?
  wait $b; local rb=$?
  for f in tests_a tests_b; do echo "== $f"; grep -E "^(FAILED|ERROR)|passed|failed" "$LOGS/$f.txt" | tail -40; done
  echo "rc a=$ra b=$rb"
  [ $ra -eq 0 ] && [ $rb -eq 0 ]
}
t_gputests() {
  # four shards side by side (one GPU, 16 cores: Triton's compiles and the engines' graph
  # captures are host-bound), each with its own log and timeout
  local T="timeout -k 5 ${TESTS_TIMEOUT:-560} python -m pytest --gpu-only -q -p no:cacheprovider -rfE --tb=short"
  $T tests/sgl_ext >"$LOGS/gputests_a.txt" 2>&1 &
  $T tests/srt/layers tests/srt/models tests/srt/model_executor >"$LOGS/gputests_b.txt" 2>&1 &
  $T tests/srt/managers tests/srt/mem_cache tests/srt/compat >"$LOGS/gputests_c.txt" 2>&1 &
  local d skip=()
  for d in sgl_ext srt/layers srt/models srt/model_executor srt/managers srt/mem_cache srt/compat; do
    skip+=("--ignore=tests/$d")
  done
  $T tests "${skip[@]}" >"$LOGS/gputests_d.txt" 2>&1 &
  local rc=0 p
  for p in $(jobs -p); do wait "$p" || rc=1; done
  for f in gputests_a gputests_b gputests_c gputests_d; do
    echo "== $f"; grep -E "^(FAILED|ERROR)|passed|failed|skipped" "$LOGS/$f.txt" | tail -40
  done
  return $rc
}
t_fast() {
  # the C fast path (issue 14): its tests and the op tests whose second calls go through it
  timeout 300 python -m pytest -q -p no:cacheprovider -rfE tests/sgl_ext/test_fast_launch.py \
    tests/sgl_ext/test_plan_cache.py tests/sgl_ext/test_validation.py \
    tests/sgl_ext/test_compile_and_graphs.py tests/sgl_ext/test_launcher.py
}
t_layers() {
  timeout 400 python -m pytest -q -p no:cacheprovider -rfE tests/sgl_ext/test_norm.py \
    tests/sgl_ext/test_activation.py tests/srt/layers tests/srt/models tests/srt/model_executor
}
t_sweep() {
  local i pids=()
  for i in 0 1 2 3 4 5; do
    timeout 400 python -m tests.sgl_ext.rope_kv_sweep --cases 8 --repro 400 --rows --shard $i/6 \
      >"$LOGS/sweep_$i.txt" 2>&1 &
    pids+=($!)
  done
  local rc=0
  for i in "${pids[@]}"; do wait "$i" || rc=1; done
  grep -h -A8 FAIL "$LOGS"/sweep_*.txt | head -80
  tail -qn1 "$LOGS"/sweep_*.txt
  timeout 600 python -m tests.sgl_ext.inplace_race_check || rc=1
  return $rc
}
t_memcheck() {
  # every case twice (the second call is a direct launch of the compiled kernel), NaN / inf into
  # fp8 caches
  timeout 300 compute-sanitizer --tool memcheck --error-exitcode 9 \
    python -m tests.sgl_ext.gpu_memcheck_sweep
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
  # eager µs per call (host + device, and host only): ours fused / RoPE-only / q/k-norm,
  # SGLang fused / RoPE-only, FlashInfer, unfused, set_kv_buffer vs indexing, floor x.add_(1);
  # all warmed up, then 15 interleaved rounds (medians, fused / sglang IQR); both shapes,
  # T 1 8 64 512 2048 8192 32768 (~2-3 min)
  timeout 330 python benchmarks/bench_rope_kv.py --eager --rounds 15 --json-out "$LOGS/eager.json"
  # the C fast path off (the Python direct launch per call): what the C path saves
  SGL_EXT_FAST_LAUNCH=0 timeout 90 python benchmarks/bench_rope_kv.py --eager --rounds 5 \
    --tokens 1 64 512 --shapes llama3-8b
  # the same with direct launches off (the JIT path per call): what the direct launch saves
  SGL_EXT_DIRECT_LAUNCH=0 timeout 90 python benchmarks/bench_rope_kv.py --eager --rounds 5 \
    --tokens 1 64 512 --shapes llama3-8b
}
t_qknorm() {
  # issue 17: the op's and Qwen3's GPU tests, then the tables (bf16 with the SGLang columns,
  # fp8 without). Prebuilt peer modules: benchmarks/prepare_peers.sh (else nvcc builds them).
  timeout 420 python -m pytest -q -p no:cacheprovider -rfE tests/sgl_ext/test_qk_norm_rope.py \
    tests/sgl_ext/test_qk_norm_layouts.py tests/srt/models/test_qwen3.py
  timeout 120 python -m pytest -q -p no:cacheprovider -rfE tests/sgl_ext/test_compile_and_graphs.py \
    -k qk_norm
  peers_env
  timeout 420 python benchmarks/bench_qk_norm_rope.py
  timeout 240 python benchmarks/bench_qk_norm_rope.py --kv-dtype fp8_e4m3 --no-peers \
    --tokens 1 32 512 8192 32768
  # layout / sum-dtype tuning: the qknorm_sweep target
}
t_qknorm_sweep() {
  # the SASS checks (the POS_LAST line must say True)
  timeout 45 python benchmarks/compile_check.py 2>&1 | grep -v -i warn | tail -12
  # QKNORM_SWEEP lines per (T, shape) as they finish (T outer: a cut run keeps the small T),
  # then QKNORM_ROW (worst ratio to RoPE + KV alone over the row's points; goal <= 1.05)
  timeout 330 python benchmarks/tune_qk_norm.py --tokens ${QKNORM_TOKENS:-1 8 32 128 512} \
    --json-out "$LOGS/qknorm_sweep.json"
  # POS_LAST on / off and the table's layouts: the same q/k bits, float64 reference held
  timeout 90 python -m pytest -q -p no:cacheprovider -rfE tests/sgl_ext/test_qk_norm_layouts.py
}
t_moe() {
  # MXFP4 tests in their own process: a compiler crash there cannot hide the bf16 results
  timeout 300 python -m pytest -q -p no:cacheprovider tests/srt/layers/test_moe.py \
    tests/srt/layers/test_moe_triton.py tests/srt/layers/test_moe_gemv.py -k "not mxfp4" -rfE
  timeout 400 python -m pytest -q -p no:cacheprovider tests/srt/layers/test_moe_triton_mxfp4.py \
    tests/srt/layers/test_moe_gemv.py tests/srt/models/test_gpt_oss_mxfp4.py -k "mxfp4" -rfE
  timeout 240 python benchmarks/bench_moe.py
  timeout 300 python benchmarks/bench_moe.py --mxfp4
}
t_router() {
  timeout 300 python -m pytest -q -p no:cacheprovider -rfE tests/srt/layers/test_router_topk.py \
    tests/srt/layers/test_topk.py tests/srt/models/test_gpt_oss_mxfp4.py
  timeout 200 python benchmarks/bench_router.py
}
t_moe_sweep() {
  timeout 560 python benchmarks/bench_moe.py --tokens 1 8 32 64 512 4096 --sweep ${MOE_SWEEP_ARGS:-}
}
t_moe_sweep_mxfp4() {
  timeout 540 python benchmarks/bench_moe.py --mxfp4 --tokens ${MXFP4_SWEEP_TOKENS:-1 8 32 64} \
    --sweep ${MXFP4_SWEEP_ARGS:-}
}
t_moe_gemv() {
  # the per-pair GEMV kernels (MoeConfig.gemv): their tests, then the GEMV-only sweep at decode
  # sizes, MXFP4 then bf16 experts (GEMV_TOKENS), floor per T, best as *_CONFIGS lines
  timeout 300 python -m pytest -q -p no:cacheprovider -rfE tests/srt/layers/test_moe_gemv.py
  timeout 300 python benchmarks/bench_moe.py --mxfp4 --tokens ${GEMV_TOKENS:-1 2 4 8} --sweep-gemv
  timeout 300 python benchmarks/bench_moe.py --tokens ${GEMV_TOKENS:-1 2 4 8} --sweep-gemv
}
t_e2e() {
  for m in $E2E_PRESETS; do
    timeout 400 python -m srt.bench_one_batch --model-preset "$m" --batch-size $E2E_BS \
      --input-len 512 --output-len 32 --result-filename "$LOGS/e2e_result.jsonl"
  done
}
t_engine() {
  timeout 240 python -m pytest -q -p no:cacheprovider -rfE tests/srt/sampling/test_greedy.py \
    tests/srt/managers tests/srt/models/test_gpt_oss_swa.py
  for m in ${ENGINE_PRESETS:-gpt-oss-20b-mxfp4 llama3-8b}; do
    bs="1 8"; [ "$m" = llama3-8b ] && bs=1
    timeout 300 python benchmarks/bench_engine.py --preset "$m" --batch-size $bs \
      --json-out "$LOGS/engine_$m.json"
  done
}
t_layerbench() {
  # device µs in CUDA graphs vs floors, then eager µs per call of every per-layer op (T 1, 512)
  # with the direct launch on / off beside x.add_(1) (issue 14/15: "on host" near the floor)
  timeout 480 python benchmarks/bench_layers.py --eager
}
PROFILE_PRESETS=${PROFILE_PRESETS:-llama3-8b qwen3-8b}
t_profile() {
  for m in $PROFILE_PRESETS; do
    for bs in 1 64; do
      timeout 200 python benchmarks/profile_decode.py --model-preset "$m" --batch-size $bs \
        || echo "profile $m bs=$bs: FAILED rc=$?"
    done
  done
}
t_ablation() {
  local v="base dup:module:input_layernorm skip:module:input_layernorm+skip:module:post_attention_layernorm
    dup:module:self_attn.qkv_proj dup:module:self_attn.o_proj dup:module:self_attn.attn
    dup:kernel:rope_kv_kernel dup:module:mlp.router dup:kernel:_topk_softmax_kernel
    dup:kernel:moe_gemv_f16_gate_up_kernel dup:kernel:moe_gemv_f16_down_kernel
    dup:kernel:_rmsnorm_kernel skip:kernel:_topk_softmax_kernel"
  # shellcheck disable=SC2086
  timeout 400 python benchmarks/bench_graph_ablation.py --model-preset \
    "${ABLATION_PRESET:-gpt-oss-20b-mxfp4}" --batch-size 1 --replays 40 --rounds 6 \
    --variants ${ABLATION_VARIANTS:-$v}
}
t_cli() {
  timeout 300 python -m pytest -q -p no:cacheprovider -rfE tests/srt/test_bench_one_batch.py \
    tests/srt/eval tests/srt/model_loader/test_hub_and_memory.py
  timeout 200 python -m srt.bench_one_batch --correctness-test --result-filename ""
  timeout 200 python -m srt.bench_one_batch --correctness-test --model-preset llama3-8b \
    --output-len 8 --result-filename ""
  SGLANG_TORCH_PROFILER_DIR=/tmp/traces timeout 300 python -m srt.bench_one_batch \
    --model-preset llama3-8b --batch-size 1 64 --input-len 512 --output-len 32 --profile \
    --result-filename "$LOGS/cli_result.jsonl"
  echo "exit status of the last bench: $?"
}
t_small() {
  peers_env
  for r in "" "--pos-range 1024"; do
    for kv in bf16 fp8_e4m3; do
      echo "== kv $kv ${r:-positions over the whole table}"
      timeout 90 python benchmarks/bench_rope_kv.py --only-fused --tokens 1 8 32 --kv-dtype $kv $r
    done
  done
}
t_peers() { peers_env; timeout 300 python benchmarks/peers.py; }
t_pool() {
  timeout 200 python -m pytest -q -p no:cacheprovider tests/srt/mem_cache -rfE
  local S="timeout 150 compute-sanitizer --error-exitcode 9"
  $S --tool racecheck python -m tests.srt.mem_cache.gpu_stream_check --replays 20
  echo "racecheck rc=$?"
  $S --tool memcheck python -m tests.srt.mem_cache.gpu_stream_check --replays 10
  echo "memcheck rc=$?"
}
t_tune() {
  timeout 500 python benchmarks/tune_rope_kv.py --tokens 1 32 512 2048 32768 \
    --block-h 1 2 4 8 16 --warps 2 4 8 --pdl 1
}
t_tp() {
  local n
  n=$(nvidia-smi -L | wc -l)
  if [ "$n" -lt 2 ]; then echo "tp needs 2 GPUs, this machine has $n: skipped"; return 0; fi
  timeout 300 python -m pytest -q -p no:cacheprovider tests/srt/distributed -rfE
  timeout 240 python benchmarks/bench_tp.py --batch-size 1 8 32
}
t_reliab() {
  timeout 300 python -m pytest -q -p no:cacheprovider -rfEs tests/srt/mem_cache/test_allocator.py \
    tests/srt/managers tests/srt/model_executor/test_context_length.py \
    tests/srt/layers/test_rope_table_growth.py
  timeout 200 python benchmarks/bench_schedule_batch.py --device cuda
}
t_swa() {
  timeout 300 python -m pytest -q -p no:cacheprovider -rfEs tests/srt/models/test_gpt_oss_swa.py \
    tests/srt/mem_cache/test_swa_pool.py
  for flag in "" --disable-hybrid-swa-memory; do
    timeout 420 python -m srt.bench_one_batch --model-preset gpt-oss-20b --batch-size 1 8 16 \
      --input-len 4096 --output-len 32 --no-eager $flag --run-name "swa${flag}" \
      --result-filename "$LOGS/swa_result.jsonl"
  done
  timeout 560 python benchmarks/bench_swa.py --num-prompts ${SWA_PROMPTS:-64} --input-len 4096 \
    --output-len 64 --kv-gib ${SWA_KV_GIB:-8}
}
t_hostprof() {
  for m in ${PROFILE_PRESETS}; do
    timeout 200 python benchmarks/profile_decode.py --model-preset "$m" --batch-size 1 \
      --steps 5 --top 12 --host-profile 45 || echo "hostprof $m: FAILED rc=$?"
  done
}
t_attn() {
  timeout 200 python -m pytest -q -p no:cacheprovider -rfE tests/srt/layers/attention \
    tests/srt/mem_cache/test_scrub.py tests/srt/layers/test_layernorm.py
  timeout 150 python benchmarks/bench_layers.py --presets llama3-8b --decode-sweep
  timeout 90 python benchmarks/bench_layers.py --presets llama3-8b --extend-sweep
  timeout 90 python benchmarks/bench_layers.py --presets llama3-8b --cascade
  timeout 120 python benchmarks/bench_layers.py --presets llama3-8b --extend-split
}
t_gemm() {
  timeout 150 python -m pytest -q -p no:cacheprovider -rfE tests/sgl_ext/test_gemm.py \
    tests/srt/layers/test_gemm_choice.py tests/srt/layers/test_linear.py \
    tests/srt/layers/test_vocab_parallel_embedding.py tests/srt/test_bench_gemm.py
  timeout 320 python benchmarks/bench_gemm.py --budget-s 230 --hard-extra-s 40 \
    --json-out "$LOGS/gemm.json" ${GEMM_ARGS:-}
}
t_serving() {
  local dir=${OUT:-$LOGS} m=${SERVING_PRESET:-llama3-8b}
  local f=$dir/serving.jsonl
  local B="python -m srt.bench_serving --model-preset $m --disable-tqdm --output-file $f"
  local gsp="--dataset-name generated-shared-prefix --gsp-num-groups ${SERVING_GSP_GROUPS:-16}
    --gsp-prompts-per-group ${SERVING_GSP_PER_GROUP:-32} --gsp-system-prompt-len 2048
    --gsp-question-len 128 --gsp-output-len 256"
  local rnd="--dataset-name random --num-prompts ${SERVING_RANDOM_PROMPTS:-512}
    --random-input-len 1024 --random-output-len 256 --random-range-ratio 1"
  local lpa="--dataset-name long-prompt-arrival --lpa-decoders ${SERVING_LPA_DECODERS:-32}
    --lpa-decoder-input-len 512 --lpa-decoder-output-len 256
    --lpa-long-len ${SERVING_LPA_LONG:-32768} --lpa-delay-s 1"
  # Time (H100): a run's process and Engine take ~20 s; then gsp ~10 s with the cache, ~25 s
  # with it but without the cascade decode, ~64 s without the cache; random ~27 s each; a
  # long-prompt run ~10-30 s. About 7 min in all: SERVING_* shrink it.
  # shellcheck disable=SC2086
  {
    timeout 80 $B $gsp --tag gsp_cache
    timeout 90 $B $gsp --tag gsp_cache_nocascade --disable-cascade-attn
    timeout 120 $B $gsp --tag gsp_nocache --disable-radix-cache
    timeout 75 $B $rnd --tag random_cache
    timeout 75 $B $rnd --tag random_nocache --disable-radix-cache
    timeout 60 $B $lpa --tag lpa_chunked --plot "$dir/serving_lpa_chunked.png"
    timeout 60 $B $lpa --tag lpa_decode128 --decode-chunked-prefill-size 128
    timeout 60 $B $lpa --tag lpa_decode512 --decode-chunked-prefill-size 512
    timeout 60 $B $lpa --tag lpa_sglang --decode-chunked-prefill-size -1
    timeout 60 $B $lpa --tag lpa_unchunked --chunked-prefill-size -1 \
      --plot "$dir/serving_lpa_unchunked.png"
  }
  python - "$f" <<'PY'
import json, os, sys
rows = {}
if not os.path.exists(sys.argv[1]):
    sys.exit(f"no results in {sys.argv[1]}")
for line in open(sys.argv[1]):
    r = json.loads(line)
    rows[r["tag"]] = r  # the last run of each tag
def ratio(a, b, key):
    if a in rows and b in rows and rows[b][key]:
        return f"{rows[a][key] / rows[b][key]:.2f}"
    return "n/a"
print("gsp: total throughput cache/nocache", ratio("gsp_cache", "gsp_nocache", "total_throughput"),
      "(goal >= 3); median TTFT cache/nocache", ratio("gsp_cache", "gsp_nocache", "median_ttft_ms"),
      "(goal <= 0.2)")
print("gsp, cascade decode off: total throughput cache/nocache",
      ratio("gsp_cache_nocascade", "gsp_nocache", "total_throughput"), "; median TTFT",
      ratio("gsp_cache_nocascade", "gsp_nocache", "median_ttft_ms"))
print("random: total throughput cache/nocache", ratio("random_cache", "random_nocache",
      "total_throughput"), "(goal >= 0.98)")
for t in ("gsp_cache", "gsp_cache_nocascade", "gsp_nocache", "random_cache", "random_nocache"):
    if t in rows:
        print(f"{t}: hit rate {rows[t]['cache_hit_rate']}, failed {rows[t]['failed']}")
for t in ("lpa_chunked", "lpa_decode128", "lpa_decode512", "lpa_sglang", "lpa_unchunked"):
    r = rows.get(t, {})
    print(f"{t}: decoder ITL median {r.get('lpa_decoder_itl_median_ms')} ms, p99",
          f"{r.get('lpa_decoder_itl_p99_ms')} ms, p99/median {r.get('lpa_itl_p99_over_median')}",
          f"(goal <= 3 chunked), max {r.get('lpa_decoder_itl_max_ms')} ms,",
          f"before / during the prefill {r.get('lpa_before_itl_median_ms')} /",
          f"{r.get('lpa_prefill_gap_median_ms')} ms, long TTFT {r.get('lpa_long_ttft_ms')} ms")
PY
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
