"""Sweep the Triton launch configuration (heads per program, warps, PDL) of the fused op.

python benchmarks/tune_rope_kv.py [--tokens ...] [--block-h ...] [--warps ...] [--json-out F];
prints the best per point.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from bench_rope_kv import Case  # noqa: E402
from bench_util import copy_bandwidth, graph_time_us  # noqa: E402

import sgl_ext  # noqa: E402
from sgl_ext import FusedSetKVBufferArg, settings  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 128, 512, 2048, 32768])
    p.add_argument("--shapes", nargs="+", default=["llama3-8b", "gpt-oss-20b"])
    p.add_argument("--block-h", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--warps", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--kv-dtype", default="bf16")
    p.add_argument("--pdl", type=int, nargs="+", default=[1, 0])
    p.add_argument("--order", type=int, nargs="+", default=[1], help="grid order 0-2")
    p.add_argument("--merged", type=int, nargs="+", default=[0], help="1: q and k/v in one program")
    p.add_argument("--spread", type=int, nargs="+", default=[0], help="1: k/v heads spread")
    p.add_argument("--gptj", action="store_true")
    p.add_argument("--json-out")
    args = p.parse_args()
    kv = {"bf16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn}[args.kv_dtype]
    results = []
    copy_bandwidth()  # warm-up: the first small-T points read 0.05-0.1 µs high on a cold GPU
    for shape in args.shapes:
        for t in args.tokens:
            c = Case(shape, t, kv, 1.0, not args.gptj)
            reps = max(4, min(200, int(2e5 / max(1.0, c.bytes / 3e3))))
            best = None
            for pdl in map(bool, args.pdl):

                def fn(i, c=c, pdl=pdl):
                    pos, q, k, v, loc = c.split(i)
                    arg = FusedSetKVBufferArg(v, c.kb, c.vb, c.k_scale, c.k_scale, loc)
                    sgl_ext.apply_rope_with_cos_sin_cache_inplace(
                        pos, q, k, c.d, c.cs, c.neox, arg, enable_pdl=pdl
                    )

                grid = itertools.product(
                    args.block_h, args.warps, args.order, args.merged, args.spread
                )
                for bh, nw, order, merged, spread in grid:
                    if bh * c.d // 2 < 32 * nw // 2:  # too few elements for the warps
                        continue
                    os.environ["SGL_EXT_TRITON_CONFIG"] = f"{bh},{nw},{order},{merged},{spread}"
                    settings.reload()  # the ops read SGL_EXT_* once
                    us = graph_time_us(fn, reps, replays=10)
                    r = {
                        "shape": shape,
                        "T": t,
                        "bh": bh,
                        "nw": nw,
                        "order": order,
                        "merged": merged,
                    }
                    r.update(spread=spread, pdl=pdl)
                    r["us"] = us
                    results.append(r)
                    if best is None or us < best["us"]:
                        best = r
            os.environ.pop("SGL_EXT_TRITON_CONFIG", None)
            settings.reload()  # the ops read SGL_EXT_* once
            default = [r for r in results if r["shape"] == shape and r["T"] == t]
            print(f"BEST {shape} T={t}: {best}", flush=True)
            line = sorted(default, key=lambda r: r["us"])[:5]
            top = [
                (
                    (r["bh"], r["nw"], r["merged"], r["spread"]),
                    f"pdl{int(r['pdl'])}",
                    round(r["us"], 2),
                )
                for r in line
            ]
            print("   top5:", top)
            del c
            torch.cuda.empty_cache()
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main()
