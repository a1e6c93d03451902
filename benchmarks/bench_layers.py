"""Kernel times of the decoder-layer ops against their torch-native paths, with floors; and
their eager cost per call with the direct launch on and off.

    python benchmarks/bench_layers.py [--presets llama3-8b qwen3-8b] [--eager] [--no-graph]

Per preset shape (bf16): fused add+RMSNorm, RMSNorm, SiLU-and-mul at T = 1, 64, 512, 4096 tokens
(sgl_ext kernel vs the torch-native math the layers used before), and decode attention at batch
1 / 64 with 512 / 4096 cached tokens per request (the backend's split-KV choice vs one split).
Each row prints the device µs per call inside a CUDA graph (50 calls captured, median of 10
replays: no launch cost), the floor = bytes moved / measured device-copy bandwidth, and their
ratio. A failing row prints its error and the rest go on.

--eager (bench_eager.py): per op at T = 1 and 512, the eager µs per call (n calls in a host loop,
then a sync; host + device, and the host-only part; medians over interleaved rounds after a
warm-up of everything, eager_timing.py) with the direct launch on (default) and off
(SGL_EXT_DIRECT_LAUNCH=0: the Triton JIT on every call), beside a bare `x.add_(1)` (the floor of
any launch from Python) and the op's device time in a graph.

`--decode-sweep` / `--extend-sweep` time tile shapes and split counts around the attention
backends' choices instead (tuning); attention rows are CUDA-graph replays of one call per layer
over distinct per-layer caches (as in a decode step). `--cascade`: decode attention of B 256 in
8 groups of 32 requests sharing a 2048-token prefix (+ 256 own tokens each), with and without
the shared-prefix (cascade) kernel, beside the read floors of each (every request's keys read
once / every distinct key read once). `--extend-split`: one request's chunk of 128 / 512 new
tokens after 8K / 32K cached ones, the extend kernel at KV split counts 1..16.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import torch
import triton.testing as tt

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_util import SHAPES, copy_bandwidth, graph_time_us  # noqa: E402  (benchmarks/)


def _row(name: str, fn, nbytes: int, bw: float) -> None:
    try:
        us = graph_time_us(lambda i: fn(), reps=50, replays=10)
        floor = nbytes / bw / 1e3
        print(f"{name:48s} {us:9.2f} {floor:9.2f} {us / max(floor, 1e-9):6.1f}x")
    except Exception as e:  # noqa: BLE001 - one failing row must not stop the table
        print(f"{name:48s} FAILED {type(e).__name__}: {str(e)[:80]}")


def bench_elementwise(preset: str, bw: float) -> None:
    for T in (1, 64, 512, 4096):
        _elementwise_rows(preset, T, bw)


def _elementwise_rows(preset: str, T: int, bw: float) -> None:
    from sgl_ext import fused_add_rmsnorm, rmsnorm, silu_and_mul
    from sgl_ext.activation import silu_and_mul_native
    from sgl_ext.norm import fused_add_rmsnorm_native, rmsnorm_native

    hidden, inter = SHAPES[preset][:2]
    x = torch.randn(T, hidden, device="cuda", dtype=torch.bfloat16)
    r = torch.randn_like(x)
    w = torch.rand(hidden, device="cuda", dtype=torch.bfloat16) + 0.5
    g = torch.randn(T, 2 * inter, device="cuda", dtype=torch.bfloat16)
    nb = x.numel() * 2
    gb = g.numel() * 2 * 3 // 2  # read gate and up, write half
    rows = [
        ("add+rmsnorm", "sgl_ext", lambda: fused_add_rmsnorm(x, r, w, 1e-5, inplace=False), 4 * nb),
        ("add+rmsnorm", "torch-native", lambda: fused_add_rmsnorm_native(x, r, w, 1e-5), 4 * nb),
        ("rmsnorm", "sgl_ext", lambda: rmsnorm(x, w, 1e-5), 2 * nb),
        ("rmsnorm", "torch-native", lambda: rmsnorm_native(x, w, 1e-5), 2 * nb),
        ("silu_and_mul", "sgl_ext", lambda: silu_and_mul(g), gb),
        ("silu_and_mul", "torch-native", lambda: silu_and_mul_native(g), gb),
    ]
    for op, impl, fn, nbytes in rows:
        _row(f"{preset} {op} T={T} {impl}", fn, nbytes, bw)


def bench_decode(preset: str, bw: float) -> None:
    for B in (1, 64):
        for L in (512, 4096):
            _decode_rows(preset, B, L, bw)


def _graph_us(fns: list, reps: int = 3) -> float:
    """Median µs per call of fns (one call per layer) replayed as one CUDA graph, warmed up."""
    for fn in fns:
        fn()  # compile, allocate
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for fn in fns:
            fn()
    g.replay()
    torch.cuda.synchronize()
    ms = tt.do_bench(g.replay, warmup=10, rep=50 * reps, return_mode="median")
    return ms * 1e3 / len(fns)


def _decode_problem(preset: str, B: int, L: int, layers: int):
    """q, o, req_to_token, rows, lens and one KVArgs per layer (distinct caches, so a graph of
    `layers` calls reads from HBM, not L2)."""
    from srt.layers.attention.triton_backend import KVArgs
    from srt.layers.attention.triton_ops.kv_load import KV_FP8_NONE, SCALE_NONE

    _, _, hq, hkv, d = SHAPES[preset]
    r2t = (torch.randperm(B * L, device="cuda").to(torch.int32) + 1).view(B, L)  # shuffled slots
    rows = torch.arange(B, device="cuda")
    lens = torch.full((B,), L, device="cuda", dtype=torch.int64)
    q = torch.randn(B, hq, d, device="cuda", dtype=torch.bfloat16)
    kvs = []
    for _ in range(layers):
        kb = torch.randn(B * L + 1, hkv, d, device="cuda", dtype=torch.bfloat16)  # 0: padding
        vb = torch.randn_like(kb)
        st = (kb.stride(0), 0, kb.stride(1))
        kvs.append(KVArgs(kb, vb, 1, st, st, KV_FP8_NONE, SCALE_NONE, SCALE_NONE, kb, vb, 1, 1))
    return q, r2t, rows, lens, kvs


def _decode_calls(q, o, r2t, rows, lens, kvs, slots: int, **kw) -> list:
    """One `decode_attention_fwd` call per layer's caches, with float32 scratch for `slots`
    partial results (the splits, plus a cascade's prefix chunks); kw: num_splits and the rest."""
    from srt.layers.attention.triton_ops.decode_attention import (
        decode_attention_fwd,
        decode_scratch_shape,
    )

    shape = decode_scratch_shape(q.shape[0], q.shape[1], o.shape[-1], slots)
    mid = dict(
        mid_o=torch.empty(shape, device="cuda", dtype=torch.float32),
        mid_lse=torch.empty(shape[:3], device="cuda", dtype=torch.float32),
    )
    d = q.shape[-1]
    call = (q, o, r2t, rows, lens, d**-0.5)
    return [functools.partial(decode_attention_fwd, *call, kv, **mid, **kw) for kv in kvs]


def _decode_rows(preset: str, B: int, L: int, bw: float, configs=None, splits=None) -> None:
    """Decode attention per layer, timed as CUDA-graph replays over distinct per-layer caches
    (what a decode step does), for the backend's split count (and 1) or the given lists."""
    from srt.layers.attention.triton_ops.decode_attention import (
        DecodeConfig,
        decode_config,
        num_kv_splits,
    )

    _, _, hq, hkv, d = SHAPES[preset]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    per_layer = 2 * B * L * hkv * d * 2  # K and V read once
    layers = max(1, min(8, (2 << 30) // per_layer))
    try:
        q, r2t, rows, lens, kvs = _decode_problem(preset, B, L, layers)
    except Exception as e:  # noqa: BLE001
        print(f"{preset} decode B={B} L={L}: setup FAILED {type(e).__name__}: {str(e)[:80]}")
        return
    o = torch.empty_like(q)
    auto = num_kv_splits(B, hkv, sms)
    for s in splits or sorted({1, auto}):
        for cfg in configs or [decode_config(B, s, d)]:
            cfg = cfg if isinstance(cfg, DecodeConfig) else DecodeConfig(*cfg)
            fns = _decode_calls(q, o, r2t, rows, lens, kvs, s, num_splits=s, config=cfg)
            tag = " auto" if s == auto else "     "
            name = (
                f"{preset} decode B={B} L={L} s={s:2d}{tag} n={cfg.block_n} "
                f"w={cfg.num_warps} st={cfg.num_stages}"
            )
            _graph_row(name, fns, per_layer, bw)
    del kvs
    torch.cuda.empty_cache()


def _graph_row(name: str, fns: list, nbytes: int, bw: float) -> None:
    try:
        us = _graph_us(fns)
        floor = nbytes / bw / 1e3
        print(f"{name:60s} {us:9.2f} {floor:9.2f} {us / max(floor, 1e-9):6.2f}x", flush=True)
    except Exception as e:  # noqa: BLE001 - one failing row must not stop the table
        print(f"{name:60s} FAILED {type(e).__name__}: {str(e)[:80]}", flush=True)


DECODE_SWEEP = [(32, 4, 1), (32, 4, 2), (64, 4, 1), (64, 4, 2), (64, 4, 3), (64, 8, 2)]
DECODE_SWEEP += [(128, 4, 2), (128, 8, 2), (128, 8, 3)]


def decode_sweep(preset: str, bw: float) -> None:
    """Tile shapes x split counts around the backend's choice, graph-timed."""
    from srt.layers.attention.triton_ops.decode_attention import num_kv_splits

    _, _, _, hkv, _ = SHAPES[preset]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for B, L in ((1, 512), (1, 4096), (8, 512), (64, 512), (64, 2048)):
        auto = num_kv_splits(B, hkv, sms)
        splits = sorted({max(1, auto // 2), auto, min(16, auto * 2)})
        _decode_rows(preset, B, L, bw, DECODE_SWEEP, splits)


def _cascade_problem(shape, B: int, groups: int, prefix: int, own: int, layers: int, dev="cuda"):
    """B requests in `groups` groups sharing `prefix` keys, `own` more keys each (page size 1,
    shuffled slots): q, req_to_token, rows, lens, the CascadeArgs (items of
    CASCADE_ROWS_PER_ITEM rows), one KVArgs per layer and the distinct keys."""
    from srt.layers.attention.triton_backend import KVArgs
    from srt.layers.attention.triton_ops.kv_load import KV_FP8_NONE, SCALE_NONE
    from srt.layers.attention.triton_ops.prefix_decode import CASCADE_ROWS_PER_ITEM, CascadeArgs

    _, _, hq, hkv, d = shape
    per_group = B // groups
    slots = groups * prefix + B * own
    perm = torch.randperm(slots, device=dev).to(torch.int32) + 1  # 0: padding
    shared = perm[: groups * prefix].view(groups, prefix).repeat_interleave(per_group, 0)
    r2t = torch.cat([shared, perm[groups * prefix :].view(B, own)], dim=1)
    rows = torch.arange(B, device=dev)
    lens = torch.full((B,), prefix + own, device=dev, dtype=torch.int64)
    items = [
        (r, min(r + CASCADE_ROWS_PER_ITEM, (g + 1) * per_group), prefix, g * per_group)
        for g in range(groups)
        for r in range(g * per_group, (g + 1) * per_group, CASCADE_ROWS_PER_ITEM)
    ]
    cascade = CascadeArgs(
        torch.full((B,), prefix, device=dev, dtype=torch.int32),
        rows.to(torch.int32),
        torch.tensor(items, device=dev, dtype=torch.int32),
    )
    q = torch.randn(B, hq, d, device=dev, dtype=torch.bfloat16)
    kvs = []
    for _ in range(layers):
        kb = torch.randn(slots + 1, hkv, d, device=dev, dtype=torch.bfloat16)
        vb = torch.randn_like(kb)
        st = (kb.stride(0), 0, kb.stride(1))
        kvs.append(KVArgs(kb, vb, 1, st, st, KV_FP8_NONE, SCALE_NONE, SCALE_NONE, kb, vb, 1, 1))
    return q, r2t, rows, lens, cascade, kvs, slots


def bench_cascade(preset: str, bw: float, B: int = 256, groups: int = 8) -> None:
    """Decode attention over shared prefixes (issue 48's generated-shared-prefix shape): B
    requests in `groups` groups of a 2048-key shared prefix and 256 keys of their own, distinct
    caches per layer; the plain kernel and the cascade, graph-timed per layer."""
    from srt.layers.attention.triton_ops.decode_attention import num_kv_splits
    from srt.layers.attention.triton_ops.kv_load import sm_count
    from srt.layers.attention.triton_ops.prefix_decode import cascade_splits

    _, _, hq, hkv, d = SHAPES[preset]
    prefix, own = 2048, 256
    # 2 layers x 0.34 GB: the second layer's keys are not in L2
    q, r2t, rows, lens, cascade, kvs, keys = _cascade_problem(
        SHAPES[preset], B, groups, prefix, own, 2
    )
    o = torch.empty_like(q)
    sms = sm_count(q.device)
    s, P = num_kv_splits(B, hkv, sms), cascade_splits(B, hkv, sms)
    per_key = 2 * hkv * d * 2  # K and V, bf16
    for name, cas, slots_n, nbytes in (
        ("plain", None, s, B * (prefix + own) * per_key),
        (f"cascade P={P}", cascade, s + P, keys * per_key),
    ):
        prefix_splits = P if cas is not None else None
        fns = _decode_calls(
            q,
            o,
            r2t,
            rows,
            lens,
            kvs,
            slots_n,
            num_splits=s,
            cascade=cas,
            cascade_splits=prefix_splits,
        )
        label = f"{preset} decode B={B} {groups}x{B // groups} L={prefix}+{own} s={s} {name}"
        _graph_row(label, fns, nbytes, bw)
    del kvs
    torch.cuda.empty_cache()


EXTEND_SWEEP = [(16, 64, 4, 2), (32, 64, 4, 2), (64, 32, 4, 2), (64, 64, 4, 2), (64, 64, 4, 3)]
EXTEND_SWEEP += [(64, 64, 8, 2), (128, 64, 8, 2), (128, 32, 8, 2), (64, 128, 8, 2)]


def extend_sweep(preset: str, bw: float, shapes=((1, 512), (1, 2048), (8, 512), (64, 512))) -> None:
    """Prefill attention of B prompts of L new tokens (no prefix) per layer, graph-timed; the
    floor column is the causal FLOPs at 500 TFLOP/s (dense bf16), not bytes."""
    from srt.layers.attention.triton_ops.extend_attention import (
        ExtendConfig,
        extend_attention_fwd,
        extend_config,
    )
    from srt.layers.attention.triton_ops.kv_load import pow2

    _, _, hq, hkv, d = SHAPES[preset]
    for B, L in shapes:
        q, r2t, rows, lens, kvs = _decode_problem(preset, B, L, 2)
        T = B * L
        qt = torch.randn(T, hq, d, device="cuda", dtype=torch.bfloat16)
        o = torch.empty_like(qt)
        ext = torch.full((B,), L, device="cuda", dtype=torch.int32)
        pre = torch.zeros(B, device="cuda", dtype=torch.int32)
        start = torch.arange(B, device="cuda", dtype=torch.int32) * L
        flops = 2 * 2 * B * hq * d * L * (L + 1) / 2
        auto = extend_config(B, pow2(hq // hkv), L)
        for c in [auto, *EXTEND_SWEEP]:
            cfg = c if isinstance(c, ExtendConfig) else ExtendConfig(*c)
            fns = [
                functools.partial(
                    extend_attention_fwd,
                    qt,
                    o,
                    r2t,
                    rows,
                    ext,
                    pre,
                    start,
                    L,
                    d**-0.5,
                    kv,
                    config=cfg,
                )
                for kv in kvs
            ]
            tag = "auto" if c is auto else "    "
            name = (
                f"{preset} extend B={B} L={L} {tag} rows={cfg.rows} n={cfg.block_n} "
                f"w={cfg.num_warps} st={cfg.num_stages}"
            )
            # "bytes" = flops scaled so that bytes / bw is the time at 500 TFLOP/s
            _graph_row(name, fns, int(flops / 500e12 * bw * 1e9), bw)
        del kvs
        torch.cuda.empty_cache()


def extend_split(
    preset: str, bw: float, cases=((128, 8192), (128, 32768), (512, 8192), (512, 32768))
) -> None:
    """Split-KV extend: one request's chunk of C new tokens after P cached ones (a chunked long
    prompt, or a short turn after a long cached prefix), KV split counts 1..16, graph-timed per
    layer; the floor column is the FLOPs at 500 TFLOP/s (dense bf16)."""
    from srt.layers.attention.triton_ops.decode_merge import decode_scratch_shape
    from srt.layers.attention.triton_ops.extend_attention import extend_attention_fwd

    _, _, hq, hkv, d = SHAPES[preset]
    for C, P in cases:
        q, r2t, rows, lens, kvs = _decode_problem(preset, 1, P + C, 2)
        qt = torch.randn(C, hq, d, device="cuda", dtype=torch.bfloat16)
        o = torch.empty_like(qt)
        ext = torch.full((1,), C, device="cuda", dtype=torch.int32)
        pre = torch.full((1,), P, device="cuda", dtype=torch.int32)
        start = torch.zeros(1, device="cuda", dtype=torch.int32)
        flops = 2 * 2 * hq * d * C * (P + (C + 1) / 2)
        for splits in (1, 2, 4, 8, 16):
            mid = {}
            if splits > 1:
                shape = decode_scratch_shape(C, hq, d, splits)
                mid = dict(
                    mid_o=torch.empty(shape, device="cuda"),
                    mid_lse=torch.empty(shape[:3], device="cuda"),
                )
            call = (qt, o, r2t, rows, ext, pre, start, C, d**-0.5)
            fns = [
                functools.partial(extend_attention_fwd, *call, kv, num_splits=splits, **mid)
                for kv in kvs
            ]
            name = f"{preset} extend C={C} after P={P} splits={splits}"
            _graph_row(name, fns, int(flops / 500e12 * bw * 1e9), bw)
        del kvs
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--presets", nargs="+", default=list(SHAPES), choices=sorted(SHAPES))
    p.add_argument("--eager", action="store_true", help="eager µs per call, direct launch on/off")
    p.add_argument("--no-graph", action="store_true", help="skip the graph (device time) table")
    p.add_argument("--decode-sweep", action="store_true", help="decode tile/split sweep only")
    p.add_argument("--extend-sweep", action="store_true", help="extend tile sweep only")
    p.add_argument("--cascade", action="store_true", help="shared-prefix decode attention only")
    p.add_argument("--extend-split", action="store_true", help="split-KV extend after a prefix")
    a = p.parse_args(argv)
    bw = copy_bandwidth()
    print(f"# {torch.cuda.get_device_name()}: device copy {bw:.0f} GB/s (read + write)")
    if a.decode_sweep or a.extend_sweep or a.cascade or a.extend_split:
        print(f"{'op':48s} {'us':>9s} {'floor us':>9s} {'ratio':>7s}")
        for preset in a.presets:
            if a.decode_sweep:
                decode_sweep(preset, bw)
            if a.extend_sweep:
                extend_sweep(preset, bw)
            if a.cascade:
                bench_cascade(preset, bw)
            if a.extend_split:
                extend_split(preset, bw)
        return
    if not a.no_graph:
        print(f"{'op (device µs in a CUDA graph)':48s} {'us':>9s} {'floor us':>9s} {'ratio':>7s}")
        for preset in a.presets:
            bench_elementwise(preset, bw)
            bench_decode(preset, bw)
    if a.eager:
        from bench_eager import run_eager

        run_eager(a.presets)


if __name__ == "__main__":
    main()
