#!/usr/bin/env bash
# One H100 call: Nsight Compute metrics of the fused kernel, neox against GPT-J (gpt-oss shape,
# T=512 and 128) and bf16 against fp8 at T=1 (Llama shape).
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1
M=gpu__time_duration.sum,launch__registers_per_thread,launch__grid_size,launch__block_size,sm__warps_active.avg.pct_of_peak_sustained_active,dram__bytes_read.sum,dram__bytes_write.sum,l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum,l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum,l1tex__t_requests_pipe_lsu_mem_global_op_st.sum,l1tex__t_sectors_pipe_lsu_mem_global_op_st.sum,smsp__inst_executed.sum,lts__t_sectors_op_write.sum
which ncu || ls /usr/local/cuda/bin | grep -i ncu
run() { timeout 90 ncu --kernel-name regex:rope_kv --launch-skip 3 --launch-count 1 --metrics $M --csv python benchmarks/ncu_point.py "$@" 2>&1 | grep -E '^"' | awk -F'","' '{print $(NF-3)" "$(NF-2)" "$NF}' | tr -d '"'; }
for t in 512 128; do
  for s in "" "--gptj"; do echo "== gpt-oss-20b T=$t $s"; run --shape gpt-oss-20b --tokens $t $s; done
done 2>&1 | tee "$OUT/ncu.txt"
for kv in bf16 fp8_e4m3; do echo "== llama3-8b T=1 $kv"; run --shape llama3-8b --tokens 1 --kv-dtype $kv; done 2>&1 | tee -a "$OUT/ncu.txt"
exit 0
