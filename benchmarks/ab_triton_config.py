"""A/B of Triton launch configurations at one point, in alternating rounds of one process (so
drift and noise hit every configuration alike).

python benchmarks/ab_triton_config.py --shape gpt-oss-20b --tokens 1 --configs default 2,4,0
    [--kv-dtype fp8_e4m3] [--gptj] [--rounds 5]
A configuration is `default` or an SGL_EXT_TRITON_CONFIG value ("block_h,num_warps[,order
[,merged]]"). Prints each round's medians and the median over rounds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from bench_rope_kv import KV_DTYPES, SHAPES, Case, copy_bandwidth, graph_time_us  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="llama3-8b", choices=SHAPES)
    p.add_argument("--tokens", type=int, nargs="+", default=[1])
    p.add_argument("--configs", nargs="+", default=["default"])
    p.add_argument("--kv-dtype", default="bf16", choices=KV_DTYPES)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--gptj", action="store_true")
    args = p.parse_args()
    copy_bandwidth()  # warm the GPU clocks as the benchmark does
    for t in args.tokens:
        c = Case(args.shape, t, KV_DTYPES[args.kv_dtype], 1.0, not args.gptj)
        reps = max(4, min(200, int(2e5 / max(1.0, c.bytes / 3e3))))
        res = {cfg: [] for cfg in args.configs}
        for _ in range(args.rounds):
            for cfg in args.configs:
                if cfg != "default":
                    os.environ["SGL_EXT_TRITON_CONFIG"] = cfg  # read at capture
                res[cfg].append(graph_time_us(c.fused, reps))
                os.environ.pop("SGL_EXT_TRITON_CONFIG", None)
        for cfg, ts in res.items():
            med = statistics.median(ts)
            rounds = " ".join(f"{x:.2f}" for x in ts)
            point = f"{args.shape} {args.kv_dtype} {'gptj' if args.gptj else 'neox'} T={t}"
            print(f"{point} {cfg:>10}: median {med:.3f} µs, {rounds}")
        del c
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
