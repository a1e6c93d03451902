"""Benchmark of the fused RoPE + KV-cache write on real model shapes.

Variants (all inside CUDA graphs, median over replays, µs per call):
  fused      ours: apply_rope_with_cos_sin_cache_inplace with FusedSetKVBufferArg (default
             dispatch); with --compare also `triton`: the same call with the backend forced
             (SGL_EXT_BACKEND)
  unfused    ours: RoPE op alone + sgl_ext.set_kv_buffer
  native     torch-native unfused: rotate in torch + two index copies into the cache
  compile    torch.compile(dynamic=False) of the native function
  floor      bytes the fused op must move / device-copy bandwidth measured in this run
  copy       a device copy moving the same bytes (T >= 2048), timed like the variants
  sglang     SGLang's own fused kernel (rope.cuh of the sglang wheel); fi_rope: FlashInfer's
  fi_rope    RoPE alone (no cache write); fi_fp8: FlashInfer's RoPE + fp8 quantise + paged
  fi_fp8     append. Built from the wheels by peers.py when SGL_BENCH_SGLANG_DIR /
             SGL_BENCH_FLASHINFER_DIR are set; checked against ours first (peer_columns.py)
  sglang_ref SGLang's kernel as quoted in issue #2 (another run), where `sglang` is absent

Usage: python benchmarks/bench_rope_kv.py [--tokens 1 8 ...] [--shapes llama3-8b gpt-oss-20b]
           [--kv-dtype bf16|fp8_e4m3] [--rot-frac 0.5] [--gptj] [--no-compile] [--json-out F]
           [--plot F.png] [--compare] [--only-fused] [--pos-range N] [--eager [--rounds R]]

--eager: the cost of one call made eagerly (no graph), host and device together, and the
host-only part (the loop before the sync), timed by eager_timing.py: every column of every
point is built and warmed up first; then in each of --rounds rounds (default 15) every column of
every point runs one loop of n calls (n >= 200, and enough for a 2 ms host loop) synchronised at
the end, in a column order that rotates per round; a column's figure is its median over rounds
and the table prints the fused and sglang interquartile ranges. Columns (bf16 cache):
  fused / rope   ours with and without the FusedSetKVBufferArg
  qknorm         ours, apply_qk_norm_rope_with_cos_sin_cache_inplace with the KV write
  sglang / sglang_rope / fi_rope   the peers' kernels, called straight through tvm-ffi
                 (without SGLang's custom-op wrapper: their cost as the lowest it can be)
  unfused        ours: RoPE alone + set_kv_buffer
  set_kv / index sgl_ext.set_kv_buffer vs `k_buffer[loc] = k; v_buffer[loc] = v`
  floor          `x.add_(1)`: a bare eager kernel launch from Python, timed as a column
The JSON (--json-out) has, per row and column, the median, _host, _q1/_q3, _min/_max and
_rounds (every round's µs per call).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench_util, peers, peer_columns

from bench_util import copy_bandwidth, graph_time_us  # noqa: E402  (benchmarks/)
from peer_columns import peer_columns  # noqa: E402  (benchmarks/)

import sgl_ext  # noqa: E402
from sgl_ext import FusedSetKVBufferArg, settings  # noqa: E402
from sgl_ext.native import rotate_native  # noqa: E402

SHAPES = {  # name: (Hq, Hkv, D)
    "llama3-8b": (32, 8, 128),
    "gpt-oss-20b": (64, 8, 64),
    "qwen3-8b": (32, 8, 128),
    "qwen3-32b": (64, 8, 128),
}
TOKENS = [1, 8, 32, 128, 512, 2048, 8192, 32768]
# SGLang 0.5.23 JIT rope.cuh fused kernel, H100, CUDA graph (from issue #2; not measured here).
SGLANG_REF = {
    "llama3-8b": {
        1: 1.10,
        8: 1.72,
        32: 1.90,
        128: 3.47,
        512: 6.89,
        2048: 20.7,
        8192: 80.2,
        32768: 322,
    },
    "gpt-oss-20b": {
        1: 1.65,
        8: 1.36,
        32: 1.66,
        128: 3.02,
        512: 6.07,
        2048: 17.1,
        8192: 64.7,
        32768: 256,
    },
}
# Timed columns in table order (each present where it applies).
COLUMNS = [
    "fused",
    "triton",
    "sglang",
    "fi_rope",
    "fi_fp8",
    "unfused",
    "native",
    "compile",
    "floor",
    "copy",
    "sglang_ref",
]
KV_DTYPES = {"bf16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def same_size_copy_us(nbytes: int, reps: int) -> float:
    """µs of one device copy moving nbytes (half read, half written), in the same graph harness
    and rotated over buffers like the input sets: the floor's bandwidth at this size."""
    n = max(2, math.ceil(256e6 / nbytes))
    half = nbytes // 2
    bufs = [
        (
            torch.empty(half, dtype=torch.uint8, device="cuda"),
            torch.empty(half, dtype=torch.uint8, device="cuda"),
        )
        for _ in range(n)
    ]
    return graph_time_us(lambda i: bufs[i % n][1].copy_(bufs[i % n][0]), reps)


def empty_kernel_us() -> float:
    x = torch.zeros(1, device="cuda")
    return graph_time_us(lambda i: x.add_(1), reps=200)


class Case:
    """Input sets for one (shape, T) point, rotated across graph calls to defeat the L2 cache."""

    def __init__(self, shape, t, kv_dtype, rot_frac, neox, dtype=torch.bfloat16, pos_range=None):
        hq, hkv, d = SHAPES[shape]
        self.hq, self.hkv, self.d, self.t, self.neox = hq, hkv, d, t, neox
        self.rot = int(d * rot_frac)
        es, kes = 2, torch.empty(0, dtype=kv_dtype).element_size()
        self.bytes = (
            2 * t * (hq + hkv) * self.rot * es  # q/k rotary dims read + written
            + t * hkv * (d - self.rot) * es  # k pass-through dims read for the cache
            + t * hkv * d * es  # v read
            + 2 * t * hkv * d * kes  # K and V written to the cache
            + t * self.rot * 4  # cos/sin rows
            + 2 * t * 8  # positions + slots
        )
        self.nsets = max(2, min(32, math.ceil(256e6 / self.bytes)))
        max_pos = 131072
        self.cs = torch.randn(max_pos, self.rot, device="cuda")
        slots = max(65536, t * self.nsets)
        self.kb = torch.randn(slots, hkv, d, device="cuda").to(kv_dtype)
        self.vb = torch.randn(slots, hkv, d, device="cuda").to(kv_dtype)
        self.sets = []
        perm = torch.randperm(slots, device="cuda")
        for i in range(self.nsets):
            qkv = torch.randn(t, (hq + 2 * hkv) * d, device="cuda", dtype=dtype)
            # positions over the whole table by default (at small T the rows the sets touch
            # still stay in L2: docs/performance.md, `gpu_run.sh small`)
            pos = torch.randint(0, pos_range or max_pos, (t,), device="cuda")
            loc = perm[i * t : (i + 1) * t].clone() if (i + 1) * t <= slots else perm[:t].clone()
            self.sets.append((qkv, pos, loc))
        self.k_scale = torch.tensor(0.5, device="cuda") if kv_dtype != torch.bfloat16 else None

    def split(self, i):
        qkv, pos, loc = self.sets[i % self.nsets]
        q, k, v = qkv.split([self.hq * self.d, self.hkv * self.d, self.hkv * self.d], dim=-1)
        return pos, q, k, v, loc

    def fused(self, i):
        pos, q, k, v, loc = self.split(i)
        arg = FusedSetKVBufferArg(v, self.kb, self.vb, self.k_scale, self.k_scale, loc)
        sgl_ext.apply_rope_with_cos_sin_cache_inplace(pos, q, k, self.d, self.cs, self.neox, arg)

    def unfused(self, i):
        pos, q, k, v, loc = self.split(i)
        sgl_ext.apply_rope_with_cos_sin_cache_inplace(pos, q, k, self.d, self.cs, self.neox)
        sgl_ext.set_kv_buffer(k, v, self.kb, self.vb, loc, self.k_scale, self.k_scale)


def native_unfused(pos, q, k, v, cs, kb, vb, loc, d, neox, scale):
    """The torch-native unfused path as model code writes it: rotate, then two index copies."""
    rotate_native(pos, q, d, cs, neox)
    rotate_native(pos, k, d, cs, neox)
    kk, vv = k.view(k.shape[0], -1, d), v.view(v.shape[0], -1, d)  # [T, Hkv, D]
    if scale is not None:
        kk, vv = (kk.float() / scale).to(kb.dtype), (vv.float() / scale).to(vb.dtype)
    kb[loc] = kk
    vb[loc] = vv


def run(args) -> list[dict]:
    kv_dtype = KV_DTYPES[args.kv_dtype]
    bw = copy_bandwidth()
    empty = empty_kernel_us()
    print(
        f"# device {torch.cuda.get_device_name()}, copy bandwidth {bw:.0f} GB/s (read+write), "
        f"empty kernel in graph {empty:.2f} µs, kv {args.kv_dtype}, rot_frac {args.rot_frac}, "
        f"{'neox' if not args.gptj else 'gptj'}"
    )
    # One static compile per (shape, T): lift dynamo's recompile limit (default 8) above that.
    torch._dynamo.config.cache_size_limit = max(64, torch._dynamo.config.cache_size_limit)
    compiled = torch.compile(native_unfused, dynamic=False) if not args.no_compile else None
    rows = []
    for shape in args.shapes:
        for t in args.tokens:
            c = Case(shape, t, kv_dtype, args.rot_frac, not args.gptj, pos_range=args.pos_range)
            reps = max(4, min(200, int(2e5 / max(1.0, c.bytes / 3e3))))
            r = {"shape": shape, "T": t, "bytes": c.bytes}
            r["fused"] = graph_time_us(c.fused, reps)
            r["floor"] = c.bytes / (bw * 1e9) * 1e6
            r["fused_GBps"] = c.bytes / (r["fused"] * 1e-6) / 1e9
            r["pct_of_copy_bw"] = 100 * r["fused_GBps"] / bw
            for name in ("triton",) if args.compare else ():
                try:
                    with settings.override(backend=name):  # the plan is made at capture
                        r[name] = graph_time_us(c.fused, reps)
                except RuntimeError as err:  # the backend cannot take this call
                    print(f"# {name} skipped: {err}")
            if t >= 2048:  # where the bandwidth goal applies
                r["copy"] = same_size_copy_us(c.bytes, reps)
            for name, fn in peer_columns(c, args.kv_dtype).items():
                r[name] = graph_time_us(fn, reps)
            if not args.only_fused:
                r["unfused"] = graph_time_us(c.unfused, reps)

                def nat(i, fn=native_unfused, c=c):
                    pos, q, k, v, loc = c.split(i)
                    fn(pos, q, k, v, c.cs, c.kb, c.vb, loc, c.d, c.neox, c.k_scale)

                r["native"] = graph_time_us(nat, reps)
                if compiled is not None:
                    r["compile"] = graph_time_us(lambda i, c=c: nat(i, compiled, c), reps)
            ref = SGLANG_REF.get(shape, {}).get(t) if "sglang" not in r else None
            if ref and args.kv_dtype == "bf16" and args.rot_frac == 1.0 and not args.gptj:
                r["sglang_ref"] = ref
            rows.append(r)
            print(
                json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}),
                flush=True,
            )
            del c
            torch.cuda.empty_cache()
    return rows, bw, empty


def eager_fns(c) -> dict:
    """{column: fn(i)} of the eager table for one Case; argument objects are made up front."""
    d, cs, neox, ks = c.d, c.cs, c.neox, c.k_scale
    sets = [c.split(i) for i in range(c.nsets)]
    fused_args = [FusedSetKVBufferArg(v, c.kb, c.vb, ks, ks, loc) for _, _, _, v, loc in sets]
    rows = [(k.view(c.t, -1, d), v.view(c.t, -1, d), loc) for _, _, k, v, loc in sets]
    op, set_kv = sgl_ext.apply_rope_with_cos_sin_cache_inplace, sgl_ext.set_kv_buffer
    n = c.nsets

    def fused(i):
        pos, q, k, v, loc = sets[i % n]
        op(pos, q, k, d, cs, neox, fused_args[i % n])

    def rope(i):
        pos, q, k, v, loc = sets[i % n]
        op(pos, q, k, d, cs, neox)

    def unfused(i):
        pos, q, k, v, loc = sets[i % n]
        op(pos, q, k, d, cs, neox)
        set_kv(k, v, c.kb, c.vb, loc, ks, ks)

    qk_op = sgl_ext.apply_qk_norm_rope_with_cos_sin_cache_inplace
    qkv0 = sets[0][1]
    qw = torch.rand(d, device=qkv0.device, dtype=qkv0.dtype) + 0.5
    kw = torch.rand(d, device=qkv0.device, dtype=qkv0.dtype) + 0.5

    def qknorm(i):  # issue 17's op (Qwen3): q/k RMSNorm + RoPE + KV write
        pos, q, k, v, loc = sets[i % n]
        qk_op(pos, q, k, d, cs, qw, kw, 1e-6, neox, fused_args[i % n])

    def set_kv_only(i):
        pos, q, k, v, loc = sets[i % n]
        set_kv(k, v, c.kb, c.vb, loc, ks, ks)

    def index(i):
        k, v, loc = rows[i % n]
        c.kb[loc] = k
        c.vb[loc] = v

    fns = {"fused": fused, "rope": rope, "qknorm": qknorm, "unfused": unfused}
    fns["set_kv"] = set_kv_only
    if ks is None:  # plain indexing stores no scaled fp8
        fns["index"] = index
    return fns


EAGER_COLUMNS = [
    "fused",
    "rope",
    "qknorm",
    "sglang",
    "sglang_rope",
    "fi_rope",
    "unfused",
    "set_kv",
    "index",
]
EAGER_HOST = ["fused", "rope", "qknorm", "set_kv", "sglang"]
EAGER_SPREAD = ["fused", "sglang"]  # columns whose spread over rounds the table prints


def run_eager(args) -> tuple[list[dict], float]:
    """Build every point's columns, then time them all interleaved (eager_timing.py)."""
    from eager_timing import Column, time_points

    kv_dtype = KV_DTYPES[args.kv_dtype]
    x = torch.zeros(1, device="cuda")
    cases, points = {}, {}
    for shape in args.shapes:
        for t in args.tokens:
            c = Case(shape, t, kv_dtype, args.rot_frac, not args.gptj, pos_range=args.pos_range)
            fns = eager_fns(c)
            fns.update(peer_columns(c, args.kv_dtype, rope_only=True))
            cols = {}
            for name in EAGER_COLUMNS:
                if name in fns:
                    cols[name] = Column(fns[name])
            cols["floor"] = Column(lambda i: x.add_(1))
            cases[(shape, t)], points[(shape, t)] = c, cols
    print(
        f"# {len(points)} points built; warm-up, then {args.rounds} interleaved rounds", flush=True
    )
    timings, calls = time_points(points, rounds=args.rounds)
    rows = []
    for (shape, t), cols in timings.items():
        r = {"shape": shape, "T": t, "n": calls[(shape, t)], "rounds": args.rounds}
        for name, tm in cols.items():
            r[name], r[name + "_host"] = tm.median, tm.host_median
            r[name + "_q1"], r[name + "_q3"] = tm.quartiles()
            r[name + "_min"], r[name + "_max"] = min(tm.total), max(tm.total)
            r[name + "_rounds"] = [round(v, 3) for v in tm.total]
        rows.append(r)
        brief = {k: round(tm.median, 2) for k, tm in cols.items()}
        print(json.dumps({"shape": shape, "T": t, "n": r["n"], **brief}), flush=True)
    floors = [r["floor"] for r in rows if "floor" in r]
    return rows, statistics.median(floors) if floors else math.nan


def eager_table(rows, floor, args) -> str:
    cols = [c for c in EAGER_COLUMNS if any(c in r for r in rows)]
    host = [c for c in EAGER_HOST if any(c + "_host" in r for r in rows)]
    spread = [c for c in EAGER_SPREAD if any(c in r for r in rows)]
    ratios = [("fused", "sglang"), ("rope", "sglang_rope"), ("set_kv", "index")]
    ratios = [(a, b) for a, b in ratios if any(a in r and b in r for r in rows)]
    out = [
        f"device: {torch.cuda.get_device_name()}; kv {args.kv_dtype}; eager µs per call, host and"
        f" device: median over {args.rounds} interleaved rounds (a loop of n calls synchronised"
        f" at the end; every column of every point warmed up first); IQR: first..third quartile"
        f" of the rounds; floor x.add_(1) timed as a column of each point (median {floor:.2f} µs)",
        "",
        "| shape | T | n | "
        + " | ".join(cols)
        + " | floor | "
        + " | ".join(f"{a}/{b}" for a, b in ratios)
        + " | "
        + " | ".join(f"{c} IQR" for c in spread)
        + " | "
        + " | ".join(f"{h} host" for h in host)
        + " | fused/floor |",
    ]
    out.append("|" + "---|" * (4 + len(cols) + len(ratios) + len(spread) + len(host) + 1))
    for r in rows:
        vals = [str(r["n"])]
        vals += [f"{r[c]:.1f}" if c in r else "-" for c in cols]
        vals.append(f"{r['floor']:.1f}" if "floor" in r else "-")
        vals += [f"{r[a] / r[b]:.2f}" if a in r and b in r else "-" for a, b in ratios]
        vals += [f"{r[c + '_q1']:.1f}-{r[c + '_q3']:.1f}" if c in r else "-" for c in spread]
        vals += [f"{r[h + '_host']:.1f}" if h + "_host" in r else "-" for h in host]
        vals.append(f"{r['fused'] / r['floor']:.2f}" if "fused" in r and "floor" in r else "-")
        out.append(f"| {r['shape']} | {r['T']} | " + " | ".join(vals) + " |")
    return "\n".join(out)


def table(rows, bw, empty, args) -> str:
    cols = [c for c in COLUMNS if any(c in r for r in rows)]
    style = "gptj" if args.gptj else "neox"
    head = (
        f"device: {torch.cuda.get_device_name()}; copy bw {bw:.0f} GB/s; empty kernel "
        f"{empty:.2f} µs; kv {args.kv_dtype}; rot_frac {args.rot_frac}; {style}; "
        f"positions {'< ' + str(args.pos_range) if args.pos_range else 'over the whole table'}; "
        "µs per call in CUDA graph (median)"
    )
    out = [head, ""]
    out.append("| shape | T | " + " | ".join(cols) + " | fused GB/s | % copy bw | fused/sglang |")
    out.append("|" + "---|" * (len(cols) + 5))
    for r in rows:
        vals = [f"{r[c]:.2f}" if c in r else "-" for c in cols]
        peer = r.get("sglang", r.get("sglang_ref"))
        ratio = f"{r['fused'] / peer:.2f}" if peer else "-"
        tail = f" | {r['fused_GBps']:.0f} | {r['pct_of_copy_bw']:.0f}% | {ratio} |"
        out.append(f"| {r['shape']} | {r['T']} | " + " | ".join(vals) + tail)
    return "\n".join(out)


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = sorted({r["shape"] for r in rows})
    fig, axes = plt.subplots(1, len(shapes), figsize=(6 * len(shapes), 4.5), squeeze=False)
    for ax, shape in zip(axes[0], shapes, strict=True):
        rs = [r for r in rows if r["shape"] == shape]
        ts = [r["T"] for r in rs]
        for col in COLUMNS:
            if all(col in r for r in rs):  # a curve for the columns every point has
                ax.plot(ts, [r[col] for r in rs], marker="o", label=col)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens")
        ax.set_ylabel("µs per call (CUDA graph)")
        ax.set_title(shape)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=TOKENS)
    p.add_argument("--shapes", nargs="+", default=["llama3-8b", "gpt-oss-20b"], choices=SHAPES)
    p.add_argument("--kv-dtype", default="bf16", choices=KV_DTYPES)
    p.add_argument("--rot-frac", type=float, default=1.0)
    p.add_argument("--gptj", action="store_true")
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--json-out")
    p.add_argument("--plot")
    p.add_argument("--compare", action="store_true", help="also time each backend forced")
    p.add_argument("--only-fused", action="store_true", help="skip unfused/native/compile")
    p.add_argument("--pos-range", type=int, help="draw positions from [0, N) (default: all)")
    p.add_argument("--eager", action="store_true", help="eager cost per call (see above)")
    p.add_argument("--rounds", type=int, default=15, help="--eager: interleaved rounds")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_rope_kv needs a CUDA GPU")
    t0 = time.time()
    if args.eager:
        if args.tokens == TOKENS:
            args.tokens = [1, 8, 64, 512, 2048, 8192, 32768]
        rows, floor = run_eager(args)
        print(eager_table(rows, floor, args))
        print(f"# {time.time() - t0:.0f} s")
        if args.json_out:
            with open(args.json_out, "w") as f:
                json.dump({"rows": rows, "floor_us": floor, "args": vars(args)}, f, indent=1)
        return
    rows, bw, empty = run(args)
    md = table(rows, bw, empty, args)
    print(md)
    print(f"# {time.time() - t0:.0f} s")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(
                {
                    "rows": rows,
                    "copy_bw": bw,
                    "empty_us": empty,
                    "args": vars(args),
                    "device": torch.cuda.get_device_name(),
                },
                f,
                indent=1,
            )
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
