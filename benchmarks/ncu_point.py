"""Eager calls of the fused op at one benchmark point, for Nsight Compute:

ncu --kernel-name regex:rope_kv --launch-skip 3 --launch-count 1 --metrics ... \\
    python benchmarks/ncu_point.py --shape gpt-oss-20b --tokens 512 [--gptj] [--kv-dtype fp8_e4m3]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from bench_rope_kv import KV_DTYPES, SHAPES, Case  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="llama3-8b", choices=SHAPES)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--kv-dtype", default="bf16", choices=KV_DTYPES)
    p.add_argument("--rot-frac", type=float, default=1.0)
    p.add_argument("--gptj", action="store_true")
    p.add_argument("--calls", type=int, default=6)
    args = p.parse_args()
    c = Case(args.shape, args.tokens, KV_DTYPES[args.kv_dtype], args.rot_frac, not args.gptj)
    for i in range(args.calls):
        c.fused(i)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
