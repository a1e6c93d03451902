"""Small-T probe: the fused op at T = 1 and 8 (Llama-3-8B heads) for each backend, cache dtype
and scale kind, in one process (CUDA graph, median µs per call).

python benchmarks/probe_small_t.py [--tokens 1 8]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from bench_rope_kv import Case, copy_bandwidth, graph_time_us  # noqa: E402

import sgl_ext  # noqa: E402
from sgl_ext import FusedSetKVBufferArg  # noqa: E402

VARIANTS = {  # name: (cache dtype, scale kind)
    "rope-only": (None, None),
    "bf16": (torch.bfloat16, None),
    "bf16+float-scale": (torch.bfloat16, "float"),
    "fp8-no-scale": (torch.float8_e4m3fn, None),
    "fp8+float-scale": (torch.float8_e4m3fn, "float"),
    "fp8+tensor-scale": (torch.float8_e4m3fn, "tensor"),
}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8])
    p.add_argument("--backends", nargs="+", default=["triton", "cuda"])
    args = p.parse_args()
    copy_bandwidth()  # warm the GPU up
    for t in args.tokens:
        for name, (kv, scale) in VARIANTS.items():
            c = Case("llama3-8b", t, kv or torch.bfloat16, 1.0, True)
            s = {"float": 0.5, "tensor": torch.tensor(0.5, device="cuda"), None: None}[scale]

            def fn(i, c=c, s=s, kv=kv):
                pos, q, k, v, loc = c.split(i)
                arg = FusedSetKVBufferArg(v, c.kb, c.vb, s, s, loc) if kv is not None else None
                sgl_ext.apply_rope_with_cos_sin_cache_inplace(pos, q, k, c.d, c.cs, True, arg)

            res = []
            for b in args.backends:
                os.environ["SGL_EXT_BACKEND"] = b
                res.append(f"{b} {graph_time_us(fn, 200, replays=20):.3f}")
                os.environ.pop("SGL_EXT_BACKEND")
            print(f"T={t} {name:18s} " + "  ".join(res), flush=True)


if __name__ == "__main__":
    main()
