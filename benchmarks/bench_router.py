"""Benchmark of gpt-oss's router on the gpt-oss-20b shape (GPU only): the router GEMM followed by
the routing kernel (top-k softmax + x's fp16 words), against the fused router
(`srt/layers/moe/router_topk.py`, one launch).

Shape: hidden 2880, 32 experts, top 4, bf16 x, weight and bias. `--layers` routers with their
own weights are called in turn inside one CUDA graph (a decode step's pattern: the weight is not
in L2). Columns, µs per call (median of graph replays):
  two       dispatch_linear (the GEMM table's config) + select_experts_x_f16: two launches
  fused     router_select_experts_x_f16: one launch
  floor     the router's weight + bias bytes over the copy bandwidth measured here

Usage: python benchmarks/bench_router.py [--tokens 1 2 4 8 16 32] [--layers 24]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_util import copy_bandwidth, graph_time_us  # noqa: E402  (benchmarks/)

from srt.layers.gemm_choice import dispatch_linear  # noqa: E402
from srt.layers.moe.router_topk import (  # noqa: E402
    MAX_TOKENS,
    TicketCounts,
    router_select_experts_x_f16,
)
from srt.layers.moe.topk import select_experts_x_f16  # noqa: E402

H, E, TOP_K = 2880, 32, 4  # gpt-oss-20b
TOKENS = [1, 2, 4, 8, 16, 32]


def rows(tokens: list[int], n_layers: int, bw: float) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    ws = [torch.randn(E, H, device="cuda", generator=g).bfloat16() * 0.05 for _ in range(n_layers)]
    bs = [torch.randn(E, device="cuda", generator=g).bfloat16() for _ in range(n_layers)]
    counts = [TicketCounts() for _ in range(n_layers)]
    floor = (E * H + E) * 2 / (bw * 1e3)  # µs
    print(f"{'T':>4} {'two':>8} {'fused':>8} {'floor':>8} {'fused/two':>10} {'fused/floor':>12}")
    for T in tokens:
        x = torch.randn(T, H, device="cuda", generator=g).bfloat16()

        def two(i, x=x):
            logits = dispatch_linear(x, ws[i], bs[i])
            return select_experts_x_f16(logits, TOP_K, x, weights_dtype=x.dtype)

        def fused(i, x=x, T=T):
            c = counts[i].get(T, x.device)
            return router_select_experts_x_f16(x, ws[i], bs[i], TOP_K, c, weights_dtype=x.dtype)

        t_two = graph_time_us(two, n_layers, warmup=None)
        t_fused = graph_time_us(fused, n_layers, warmup=None)
        print(
            f"{T:>4} {t_two:>8.2f} {t_fused:>8.2f} {floor:>8.3f} {t_fused / t_two:>10.3f}"
            f" {t_fused / floor:>12.1f}"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=TOKENS)
    p.add_argument("--layers", type=int, default=24)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("error: bench_router needs CUDA", file=sys.stderr)
        sys.exit(2)
    if args.layers < 1 or any(not 1 <= t <= MAX_TOKENS for t in args.tokens):
        print(f"error: --layers must be >= 1 and --tokens in [1, {MAX_TOKENS}]", file=sys.stderr)
        sys.exit(2)
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw:.0f} GB/s")
    rows(args.tokens, args.layers, bw)


if __name__ == "__main__":
    main()
