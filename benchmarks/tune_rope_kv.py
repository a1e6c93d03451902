"""Sweep the Triton launch layout (heads per program, warps, grid order, programs, load order,
PDL) of the fused op.

python benchmarks/tune_rope_kv.py [--tokens ...] [--block-h ...] [--warps ...] [--order ...]
    [--programs ...] [--load ...] [--json-out F];
prints the best per point, then each point's best as a row for sgl_ext/tables/rope_kv.json
(tokens [T, T]: widen each to the range it should serve).
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
from sgl_ext.launch_layout import (  # noqa: E402
    GridOrder,
    LaunchConfig,
    LoadOrder,
    Programs,
    tuning_string,
)
from sgl_ext.launch_tables import row_line  # noqa: E402

ORDERS = [o.value for o in GridOrder]
PROGRAMS = [p.value for p in Programs]
LOADS = [x.value for x in LoadOrder]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 128, 512, 2048, 32768])
    p.add_argument("--shapes", nargs="+", default=["llama3-8b", "gpt-oss-20b"])
    p.add_argument("--block-h", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--warps", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--kv-dtype", default="bf16")
    p.add_argument("--pdl", type=int, nargs="+", default=[1, 0])
    p.add_argument("--order", nargs="+", default=["token"], choices=ORDERS, help="grid order")
    p.add_argument(
        "--programs", nargs="+", default=["separate"], choices=PROGRAMS, help="program kinds"
    )
    p.add_argument("--load", nargs="+", default=["start"], choices=LOADS, help="load orders")
    p.add_argument("--gptj", action="store_true")
    p.add_argument("--json-out")
    args = p.parse_args()
    kv = {"bf16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn}[args.kv_dtype]
    cache = "fp8" if args.kv_dtype.startswith("fp8") else "16bit"
    results = []
    rows = []
    copy_bandwidth()  # warm-up: the first small-T points read 0.05-0.1 µs high on a cold GPU
    for shape in args.shapes:
        for t in args.tokens:
            c = Case(shape, t, kv, 1.0, not args.gptj)
            reps = max(4, min(200, int(2e5 / max(1.0, c.bytes / 3e3))))
            best, best_cfg = None, None
            for pdl in map(bool, args.pdl):

                def fn(i, c=c, pdl=pdl):
                    pos, q, k, v, loc = c.split(i)
                    arg = FusedSetKVBufferArg(v, c.kb, c.vb, c.k_scale, c.k_scale, loc)
                    sgl_ext.apply_rope_with_cos_sin_cache_inplace(
                        pos, q, k, c.d, c.cs, c.neox, arg, enable_pdl=pdl
                    )

                grid = itertools.product(
                    args.block_h, args.warps, args.order, args.programs, args.load
                )
                for bh, nw, order, programs, load in grid:
                    if bh * c.d // 2 < 32 * nw // 2:  # too few elements for the warps
                        continue
                    order_, programs_ = GridOrder(order), Programs(programs)
                    cfg = LaunchConfig(bh, nw, order_, programs_, LoadOrder(load))
                    os.environ["SGL_EXT_TRITON_CONFIG"] = tuning_string(cfg)
                    settings.reload()  # the ops read SGL_EXT_* once
                    us = graph_time_us(fn, reps, replays=10)
                    r = {"shape": shape, "T": t, "layout": tuning_string(cfg), "pdl": pdl}
                    r["us"] = us
                    results.append(r)
                    if best is None or us < best["us"]:
                        best = r
                        best_cfg = cfg
            os.environ.pop("SGL_EXT_TRITON_CONFIG", None)
            settings.reload()  # the ops read SGL_EXT_* once
            default = [r for r in results if r["shape"] == shape and r["T"] == t]
            print(f"BEST {shape} T={t}: {best}", flush=True)
            line = sorted(default, key=lambda r: r["us"])[:5]
            top = [(r["layout"], f"pdl{int(r['pdl'])}", round(r["us"], 2)) for r in line]
            print("   top5:", top)
            if best is not None:
                head = {"head_dim": c.d, "cache": cache, "tokens": [t, t]}
                rows.append((f"{shape} T={t}: {best['us']:.2f} us", {**head, **best_cfg.to_row()}))
            del c
            torch.cuda.empty_cache()
    print("\n# rows for sgl_ext/tables/rope_kv.json (each point's best layout)")
    for what, row in rows:
        print(f"# {what}\n    {row_line(row)},")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main()
