"""Routed experts on Triton: `moe_align_block_size.py` groups token-expert pairs by expert,
`fused_moe_triton_kernels.py` holds the grouped GEMMs, `fused_moe.py` runs them
(`fused_experts`), `moe_sum.py` is the top-k combine (theirs and `TopKPairs.combine`'s),
`topk_experts.py` is the module (`TopKExperts`) with the torch reference paths, `layer.py`
SGLang's `FusedMoE` interface over it.

Kernel modules are imported lazily (on the first Triton call), so TRITON_INTERPRET set by a test
harness before that call still applies."""
