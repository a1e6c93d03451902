"""Benchmark of the routed-expert MoE layer on the gpt-oss-20b shape (GPU only).

Shape: hidden 2880, 32 experts, top 4, expert FFN 2880 (w13 [32, 5760, 2880], w2 [32, 2880,
2880], biases), bf16; `--layers` layers with their own weights, called in turn inside one CUDA
graph (so one layer's weights are not in L2 for the next call). Router logits are random, so
routing is close to uniform, as with dummy weights in bench_one_batch.

Columns (µs per layer call, median over graph replays):
  ours      TopKExperts on the Triton kernels (moe_runner_backend "triton")
  torch     today's torch path: dense (every expert, T <= 64) in a CUDA graph; for T > 64 the
            eager grouped path (host syncs, not capturable) timed with events, marked *
  experts   distinct experts routed (what must be read)
  floor     active-weight read floor: bytes of the routed experts (weights + biases) + x + out,
            over the copy bandwidth measured here
  mma       bf16 tensor-core floor: routed FLOPs / --tflops (default 800, H100 SXM dense ~989)
  ratio     ours / max(floor, mma)

--mxfp4: the expert weights in MXFP4 (TopKExperts with quant_method "mxfp4", packed: random
uint8 values and valid scales, as in the gpt-oss checkpoint), dequantised inside the kernels; the
floor counts MXFP4 bytes (4.25 bits a weight); the torch column is not measured (see the bf16
table); `alt` times the other MXFP4 mode ("dot_scaled" vs "split") with the same tiles.

--sweep times alternative launch configurations (gate/up GEMM, then down GEMM; with --mxfp4 for
each of --mxfp4-modes, default dot_scaled only, then the best with the scale prefetch off in
either GEMM, and the default with it off in both: the kernel before the prefetch) per T, with
the floor, and prints the best as rows for sgl_ext/tables/moe.json.

--sweep-gemv times only the per-pair GEMV kernels (MoeConfig.gemv, T <= 16).

Usage: python benchmarks/bench_moe.py [--tokens 1 8 32 64 512 4096] [--layers 4] [--sweep]
           [--mxfp4 [--mxfp4-modes dot_scaled split]] [--json-out F]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dataclasses import replace  # noqa: E402

from bench_util import copy_bandwidth, graph_time_us  # noqa: E402  (benchmarks/)

from sgl_ext.launch_tables import row_line  # noqa: E402
from srt.layers.moe import TopKExperts, select_experts  # noqa: E402
from srt.layers.moe.fused_moe_triton import fused_moe  # noqa: E402
from srt.layers.moe.fused_moe_triton.config import table_row  # noqa: E402
from srt.layers.moe.fused_moe_triton.fused_moe import (  # noqa: E402
    MXFP4_MODES,
    GemmConfig,
    MoeConfig,
    fit_mxfp4,
    fused_experts,
    get_config,
)
from srt.layers.mxfp4 import dummy_mxfp4  # noqa: E402

H, E, K, INTER = 2880, 32, 4, 2880  # gpt-oss-20b
TOKENS = [1, 8, 32, 64, 512, 4096]


def eager_time_us(fn, reps: int, runs: int = 5) -> float:
    for i in range(reps):
        fn(i)
    times = []
    for _ in range(runs):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for i in range(reps):
            fn(i)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000 / reps)
    return statistics.median(times)


def make_layers(n: int, mxfp4: bool) -> list[TopKExperts]:
    """n layers of random experts: bf16, or MXFP4 packed (random E2M1 bytes, valid scales)."""
    layers = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for _ in range(n):
        m = TopKExperts(
            E,
            H,
            INTER,
            tp_rank=0,
            tp_size=1,
            moe_runner_backend="triton",
            quant_method="mxfp4" if mxfp4 else None,
            mxfp4_packed=mxfp4,
        )
        m = m.to(device="cuda", dtype=torch.bfloat16)
        for name, p in m.named_parameters():
            if p.dtype == torch.uint8:
                p.data.copy_(dummy_mxfp4(tuple(p.shape), g, is_scale=name.endswith("_scale")))
            else:
                p.data.normal_(0, p.shape[-1] ** -0.5, generator=g)
        layers.append(m)
    return layers


def is_mxfp4(layers) -> bool:
    return bool(layers[0].mxfp4)


def call_ours(m: TopKExperts, x, w, ids, config=None) -> torch.Tensor:
    """The layer on the Triton kernels (default config), or fused_experts with `config`."""
    if config is None:
        return m(x, w, ids)
    return fused_experts(
        x,
        m.w13_weight,
        m.w2_weight,
        w,
        ids,
        m.w13_bias,
        m.w2_bias,
        config=config,
        w13_scale=m.w13_weight_scale,
        w2_scale=m.w2_weight_scale,
    )


def routing(T: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(T, H, device="cuda", generator=g).bfloat16()
    logits = torch.randn(T, E, device="cuda", generator=g)
    w, ids = select_experts(logits, K)
    return x, w.bfloat16(), ids


def floors(
    T: int, ids: torch.Tensor, bw: float, tflops: float, mxfp4: bool
) -> tuple[int, float, float]:
    """(distinct experts, read floor µs, mma floor µs) for one layer call."""
    n_exp = int(ids.unique().numel())
    weights = 2 * INTER * H + H * INTER
    w_bytes = weights // 2 + weights // 32 if mxfp4 else weights * 2  # MXFP4: + E8M0 scales
    per_expert = w_bytes + (2 * INTER + H) * 2  # + biases (bf16)
    nbytes = n_exp * per_expert + 2 * T * H * 2
    flops = 2 * T * K * (2 * INTER * H + H * INTER)
    return n_exp, nbytes / (bw * 1e9) * 1e6, flops / (tflops * 1e12) * 1e6


def measure(layers, T: int, bw: float, tflops: float) -> dict:
    """One table row: ours, torch, experts and floors for T tokens."""
    n = len(layers)
    x, w, ids = routing(T, seed=T)
    r = {"T": T}
    mx = is_mxfp4(layers)
    r["experts"], r["floor"], r["mma"] = floors(T, ids, bw, tflops, mx)

    def ours(i):
        return call_ours(layers[i % n], x, w, ids)

    def call(i):
        return layers[i % n](x, w, ids)

    r["ours"] = graph_time_us(ours, reps=2 * n, warmup=None)
    if mx:  # the other MXFP4 mode, same tiles; no torch column (dequantises every expert)
        cfg = get_config(T, torch.device("cuda"), torch.bfloat16, mxfp4=True)
        other = "split" if cfg.mxfp4_mode == "dot_scaled" else "dot_scaled"
        alt_cfg = replace(cfg, mxfp4_mode=other)
        try:
            r["alt"] = graph_time_us(
                lambda i: call_ours(layers[i % n], x, w, ids, alt_cfg), 2 * n, warmup=None
            )
            r["alt_mode"] = other
        except Exception as e:
            r["error"] = f"alt {other}: {type(e).__name__}: {str(e)[:200]}"
        return r
    for m in layers:
        m.moe_runner_backend = "torch"
    try:
        if T <= TopKExperts.dense_max_tokens:
            r["torch"] = graph_time_us(call, reps=n, warmup=None)
        else:
            r["torch"] = eager_time_us(call, reps=n)
            r["torch_eager"] = True
    except Exception as e:  # the torch column may fail (memory) without hiding ours
        r["error"] = f"torch: {type(e).__name__}: {e}"
    finally:
        for m in layers:
            m.moe_runner_backend = "triton"
    return r


def table(layers, tokens, bw, tflops) -> list[dict]:
    rows = []
    mx = is_mxfp4(layers)
    print(
        f"\ncopy bandwidth {bw:.0f} GB/s; mma floor at {tflops:.0f} TFLOP/s; bf16 activations, "
        f"{'MXFP4' if mx else 'bf16'} experts; {len(layers)} layers per graph; µs per layer call"
        + ("; torch: see the bf16 table; alt: the other MXFP4 mode" if mx else "")
    )
    print(
        f"{'T':>6} {'ours':>9} {'torch' if not mx else 'alt':>10} {'x faster':>8} {'experts':>7} "
        f"{'floor':>8} {'mma':>8} {'ratio':>6}  config"
    )
    for T in tokens:
        try:
            r = measure(layers, T, bw, tflops)
        except Exception as e:  # one failing point must not hide the others
            traceback.print_exc()
            r = {"T": T, "error": f"{type(e).__name__}: {e}"}
            print(f"{T:>6} error: {r['error'][:150]}", flush=True)
            rows.append(r)
            continue
        rows.append(r)
        cfg = get_config(T, torch.device("cuda"), torch.bfloat16, mxfp4=mx)
        fl = max(r["floor"], r["mma"])
        if "alt" in r:
            torch_s = f"{r['alt']:.1f}"
            speed = f"{r['alt'] / r['ours']:.2f}"
        elif "torch" in r:
            torch_s = f"{r['torch']:.1f}" + ("*" if r.get("torch_eager") else "")
            speed = f"{r['torch'] / r['ours']:.1f}"
        else:
            torch_s = speed = "-"
        print(
            f"{T:>6} {r['ours']:>9.1f} {torch_s:>10} {speed:>8} {r['experts']:>7} "
            f"{r['floor']:>8.1f} {r['mma']:>8.1f} {r['ours'] / fl:>6.2f}  {cfg}",
            flush=True,
        )
        if "error" in r:
            print(f"       {r['error'][:150]}", flush=True)
    for cfg, err in fused_moe._DOT_SCALED_FAILED.items():
        print(f"WARNING: dot_scaled failed (ran split instead) for {cfg}: {err}")
    return rows


def candidates(T: int, mx: bool) -> tuple[list[int], list[GemmConfig], list[GemmConfig]]:
    """(block_m options, gate/up options, down options) worth timing for T tokens."""
    if mx and T <= 128:  # MXFP4 decode: BLOCK_K/2 bytes a row per load
        opts = ((32, 256, 4, 4), (32, 512, 4, 3), (64, 256, 4, 4), (32, 128, 4, 6), (16, 512, 4, 4))
        opts += ((64, 128, 4, 5), (128, 256, 8, 3), (64, 512, 8, 3), (64, 128, 4, 4))
        opts += ((128, 128, 8, 4), (64, 256, 4, 3))
        gu = [GemmConfig(bn, bk, w, st) for bn, bk, w, st in opts]
        return [16], gu, list(gu)
    if mx:
        bms = [32, 64] if T <= 1024 else [64, 128]
        opts = (
            (64, 128, 4, 4),
            (128, 128, 8, 3),
            (64, 256, 4, 3),
            (128, 64, 8, 4),
            (32, 128, 4, 4),
        )
        gu = [GemmConfig(bn, bk, w, st, 8) for bn, bk, w, st in opts]
        return bms, gu, gu + [GemmConfig(256, 128, 8, 3, 8)]
    if T <= 128:
        bms = [16]
        gu = [
            GemmConfig(bn, bk, w, s)
            for bn, bk, w, s in (
                (32, 128, 4, 4),
                (32, 64, 4, 5),
                (64, 128, 4, 3),
                (64, 64, 4, 4),
                (64, 128, 8, 4),
                (32, 256, 4, 3),
                (16, 256, 4, 4),
                (128, 64, 4, 4),
            )
        ]
        dn = [
            GemmConfig(bn, bk, w, s)
            for bn, bk, w, s in (
                (64, 128, 4, 4),
                (32, 128, 4, 4),
                (64, 64, 4, 5),
                (128, 64, 4, 4),
                (32, 256, 4, 3),
                (64, 256, 4, 3),
                (128, 128, 8, 3),
            )
        ]
    else:
        bms = [32, 64] if T <= 1024 else [64, 128]
        gu = [
            GemmConfig(bn, bk, w, s, 8)
            for bn, bk, w, s in (
                (64, 64, 4, 4),
                (64, 64, 8, 4),
                (128, 64, 8, 3),
                (64, 32, 4, 5),
                (32, 64, 4, 4),
            )
        ]
        dn = [
            GemmConfig(bn, bk, w, s, 8)
            for bn, bk, w, s in (
                (128, 64, 4, 4),
                (128, 64, 8, 4),
                (64, 64, 4, 4),
                (256, 64, 8, 3),
                (128, 32, 4, 5),
            )
        ]
    return bms, gu, dn


def gemv_candidates(mx: bool) -> list[GemmConfig]:
    """Per-pair GEMV kernel options (block_n, block_k, num_warps, num_stages) for either GEMM."""
    # num_stages 2: the next K block's loads issued before this block's arithmetic
    if mx:  # BLOCK_K / 2 bytes a row per iteration
        opts = ((16, 256, 4, 1), (8, 512, 2, 1), (8, 256, 1, 2), (8, 512, 2, 2))
        opts += ((16, 256, 2, 2), (16, 256, 4, 2), (16, 512, 4, 2), (32, 256, 4, 2))
        opts += ((4, 256, 1, 2), (4, 512, 1, 2), (16, 512, 2, 2), (32, 256, 8, 2))
        opts += ((64, 256, 8, 2), (4, 1024, 2, 2))
        opts += ((2, 512, 1, 2), (2, 1024, 1, 2), (4, 1024, 1, 2), (8, 512, 1, 2))
        opts += ((8, 1024, 1, 2), (1, 1024, 1, 2), (2, 256, 1, 2))
        # long K blocks (more bytes in flight a program; past the row's end groups re-read)
        opts += ((1, 2048, 1, 2), (2, 2048, 1, 2), (2, 2048, 2, 2), (4, 2048, 2, 2))
        opts += ((2, 4096, 2, 1), (4, 4096, 4, 1), (2, 4096, 1, 1), (8, 2048, 4, 2))
    else:
        opts = ((16, 256, 4, 1), (32, 256, 4, 1), (16, 512, 4, 1), (8, 512, 4, 1))
        opts += ((16, 256, 4, 2), (32, 256, 4, 2), (8, 512, 4, 2), (8, 1024, 8, 2))
        opts += ((32, 512, 8, 2), (8, 256, 2, 2))
    return [GemmConfig(bn, bk, w, st) for bn, bk, w, st in opts]


def config_line(first: int, T: int, t: float, c: MoeConfig, mx: bool, floor: float | None) -> str:
    """A moe.json row for tokens first..T -> c, after a comment with its time."""
    note = f"{t:.1f} µs" + (f", floor {floor:.1f} µs, x{t / floor:.2f}" if floor else "")
    row = table_row(c, "mxfp4" if mx else "bf16", first, T)
    return f"# T={T}: {note}\n    {row_line(row)},"


def with_prefetch(cfg: MoeConfig, gate_up: int, down: int) -> MoeConfig:
    return replace(
        cfg,
        gate_up=replace(cfg.gate_up, scale_prefetch=gate_up),
        down=replace(cfg.down, scale_prefetch=down),
    )


def sweep(
    layers, tokens, bw: float, tflops: float, modes: tuple[str, ...], gemv_only: bool = False
) -> None:
    """Gate/up options with the default down config, then down options with the best gate/up
    (MXFP4: for each of `modes`, then the best with the scale prefetch off in either GEMM);
    for T <= 16 the same two-step search over the per-pair GEMV kernels (only those with
    gemv_only)."""
    n = len(layers)
    mx = is_mxfp4(layers)
    print(f"\nsweep ({'MXFP4' if mx else 'bf16'} experts, µs per layer call, CUDA graph)")
    best = {}
    for T in tokens:
        x, w, ids = routing(T, seed=T)
        n_exp, fl, mma = floors(T, ids, bw, tflops, mx)
        fl = max(fl, mma)
        base = get_config(T, torch.device("cuda"), torch.bfloat16, mxfp4=mx)

        def t_of(cfg, x=x, w=w, ids=ids, T=T):
            def call(i):
                call_ours(layers[i % n], x, w, ids, config=cfg)

            try:
                t = graph_time_us(call, reps=2 * n, warmup=None)
            except Exception as e:
                print(f"  T={T} {cfg}: {type(e).__name__}: {str(e)[:100]}", flush=True)
                return float("inf")
            fit = fit_mxfp4(cfg) if mx else cfg
            if (fit, torch.bfloat16) in fused_moe._DOT_SCALED_FAILED:  # ran split: not this one
                print(f"  T={T} {cfg}: dot_scaled failed", flush=True)
                return float("inf")
            return t

        t_base = t_of(base)
        print(f"T={T} ({n_exp} experts, floor {fl:.1f} µs): default {t_base:.1f}  {base}")
        results = [(t_base, base)]
        if T <= 16:  # the per-pair GEMV kernels
            opts = gemv_candidates(mx)
            dflt = base if base.gemv else MoeConfig(16, opts[0], opts[0], gemv=True)
            mine = [(t_of(MoeConfig(16, gu, dflt.down, gemv=True)), gu) for gu in opts]
            gu = min(mine, key=lambda p: p[0])[1]
            mine = [(t, MoeConfig(16, g, dflt.down, gemv=True)) for t, g in mine]
            downs = (MoeConfig(16, gu, dn, gemv=True) for dn in opts if dn != dflt.down)
            mine += [(t_of(c), c) for c in downs]
            tm, cm = min(mine, key=lambda p: p[0])
            print(f"  best gemv: {tm:.1f} (x{tm / fl:.2f} floor)  {cm}", flush=True)
            results += mine
        if gemv_only:
            modes = ()
        elif mx:  # the default with the scales loaded in the K block that uses them (before)
            old = with_prefetch(base, 0, 0)
            t_old = t_of(old)
            results.append((t_old, old))
            print(f"  default, scale prefetch off: {t_old:.1f} (x{t_old / t_base:.2f})", flush=True)
        bms, gus, dns = candidates(T, mx)
        for mode in modes if mx or gemv_only else ("dot_scaled",):
            mine = []
            for bm in bms:
                for gu in gus:
                    cfg = MoeConfig(bm, gu, base.down, mode)
                    mine.append((t_of(cfg), cfg))
            t1, cfg1 = min(mine, key=lambda p: p[0])
            for dn in dns:
                cfg = MoeConfig(cfg1.block_m, cfg1.gate_up, dn, mode)
                mine.append((t_of(cfg), cfg))
            if mx:  # the scale prefetch off in one or both GEMMs of the best
                tm, cm = min(mine, key=lambda p: p[0])
                for gp, dp in ((0, 1), (1, 0), (0, 0)):
                    cfg = with_prefetch(cm, gp, dp)
                    mine.append((t_of(cfg), cfg))
                tm, cm = min(mine, key=lambda p: p[0])
                print(f"  best {mode}: {tm:.1f} (x{tm / fl:.2f} floor)  {cm}", flush=True)
            results += mine
        t2, cfg2 = min(results, key=lambda p: p[0])
        best[T] = (t2, cfg2, fl)
        for t, cfg in sorted(results, key=lambda p: p[0])[:5]:
            print(f"  {t:9.1f}  {cfg}", flush=True)
        print(
            f"T={T}: best {t2:.1f} µs vs default {t_base:.1f} µs; floor {fl:.1f} µs, "
            f"best x{t2 / fl:.2f} floor",
            flush=True,
        )
    for cfg, err in fused_moe._DOT_SCALED_FAILED.items():
        print(f"WARNING: dot_scaled failed for {cfg}: {err[:200]}")
    print(
        "\nsuggested rows for sgl_ext/tables/moe.json (the best config measured at each T, for"
        " the tokens since the previous T; the table's last row ends at null):"
    )
    first = 1
    for T, (t, c, fl) in sorted(best.items()):
        print(config_line(first, T, t, c, mx, fl))
        first = T + 1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=TOKENS)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--tflops", type=float, default=800.0)
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--sweep-gemv", action="store_true", help="sweep the GEMV kernels only")
    p.add_argument("--mxfp4", action="store_true", help="MXFP4 expert weights")
    p.add_argument(
        "--mxfp4-modes",
        nargs="+",
        default=["dot_scaled"],
        help="MXFP4 modes the sweep times (dot_scaled, split)",
    )
    p.add_argument("--json-out")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("error: bench_moe needs CUDA", file=sys.stderr)
        sys.exit(2)
    if args.layers < 1 or any(t < 1 for t in args.tokens):
        print("error: --layers and --tokens must be >= 1", file=sys.stderr)
        sys.exit(2)
    if any(m not in MXFP4_MODES for m in args.mxfp4_modes):
        print(f"error: --mxfp4-modes must be among {MXFP4_MODES}", file=sys.stderr)
        sys.exit(2)
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    bw = copy_bandwidth()
    layers = make_layers(args.layers, args.mxfp4)
    rows = table(layers, args.tokens, bw, args.tflops)
    if args.sweep or args.sweep_gemv:
        modes = tuple(args.mxfp4_modes)
        sweep(layers, args.tokens, bw, args.tflops, modes, gemv_only=args.sweep_gemv)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"bandwidth_gbs": bw, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
