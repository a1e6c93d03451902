"""qkv_proj_with_rope_kv at decode sizes: the qkv GEMM with RoPE and the KV write in one kernel
against the two launches it replaces, in CUDA graphs, beside the GEMM alone and the read floor.

    python benchmarks/bench_qkv_rope.py [--models gpt-oss-20b llama3-8b] [--m 1 2 4 8]

Per model shape (Hq, Hkv, D, K, bias) and token count M, with srt's GEMM configuration for the
qkv weight (`gemm_choice`; shapes it gives a tensor-core or no configuration are listed as
such): device µs per call in a graph of calls over 4 weight copies (none in L2 from the call
before), of the fused op, of the skinny GEMM + the RoPE op with the KV write, and of the GEMM
alone; floor = weight bytes / the device-copy bandwidth. The fused result is checked bit for bit
against the two launches first.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import sgl_ext  # noqa: E402
from benchmarks.bench_util import copy_bandwidth, graph_time_us  # noqa: E402
from sgl_ext import FusedSetKVBufferArg  # noqa: E402
from sgl_ext.gemm import linear_small_m  # noqa: E402
from srt.layers.gemm_choice import choose_config  # noqa: E402

MODELS = {  # Hq, Hkv, D, K (hidden), qkv bias
    "gpt-oss-20b": (64, 8, 64, 2880, True),
    "llama3-8b": (32, 8, 128, 4096, False),
}
COPIES = 4
DT = torch.bfloat16


def _setup(model: str, m: int):
    hq, hkv, d, k, bias = MODELS[model]
    n = (hq + 2 * hkv) * d
    g = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, k, device="cuda", generator=g).to(DT)
    ws = [(torch.randn(n, k, device="cuda", generator=g) * k**-0.5).to(DT) for _ in range(COPIES)]
    bs = [torch.randn(n, device="cuda", generator=g).to(DT) if bias else None for _ in ws]
    pos = torch.randint(0, 4000, (m,), device="cuda", generator=g)
    inv = 1.0 / 10000 ** (torch.arange(0, d, 2, device="cuda", dtype=torch.float64) / d)
    ang = torch.arange(4096, device="cuda", dtype=torch.float64)[:, None] * inv[None, :]
    cs = torch.cat((ang.cos(), ang.sin()), -1).float()
    slots = 4096
    kb = torch.zeros(slots, hkv, d, device="cuda", dtype=DT)
    vb = torch.zeros_like(kb)
    loc = torch.randperm(slots, device="cuda", generator=g)[:m]
    return (hq, hkv, d, k, n), x, ws, bs, pos, cs, (kb, vb, loc)


def run(model: str, m: int, bw: float, replays: int) -> str:
    (hq, hkv, d, k, n), x, ws, bs, pos, cs, (kb, vb, loc) = _setup(model, m)
    cfg = choose_config(n, k, m, DT, x.device)
    floor = n * k * 2 / (bw * 1e9) * 1e6
    if cfg is None or cfg.dot or cfg.split_k != 1:
        kind = "F.linear" if cfg is None else cfg.tag
        return f"| {model} | {m} | {kind} (not fused) | | | | {floor:.2f} | |"
    qs, ks = hq * d, hkv * d
    outs = [torch.empty(m, n, device="cuda", dtype=DT) for _ in ws]
    args = [FusedSetKVBufferArg(o[:, qs + ks :], kb, vb, None, None, loc) for o in outs]

    def fused(i: int) -> None:
        j = i % COPIES
        o = outs[j]
        sgl_ext.qkv_proj_with_rope_kv(x, ws[j], bs[j], pos, cs, d, hkv, o, True, args[j], cfg)

    def two(i: int) -> torch.Tensor:
        j = i % COPIES
        o = linear_small_m(x, ws[j], bs[j], cfg)
        a = FusedSetKVBufferArg(o[:, qs + ks :], kb, vb, None, None, loc)
        sgl_ext.apply_rope_with_cos_sin_cache_inplace(
            pos, o[:, :qs], o[:, qs : qs + ks], d, cs, True, a
        )
        return o

    def gemm(i: int) -> None:
        j = i % COPIES
        linear_small_m(x, ws[j], bs[j], cfg)

    fused(0)
    want = two(0)
    same = "yes" if torch.equal(outs[0].view(torch.int16), want.view(torch.int16)) else "NO"
    reps = COPIES * 8
    t_f = graph_time_us(fused, reps, replays, warmup=COPIES)
    t_2 = graph_time_us(two, reps, replays, warmup=COPIES)
    t_g = graph_time_us(gemm, reps, replays, warmup=COPIES)
    return (
        f"| {model} | {m} | {cfg.tag} | {t_f:.2f} | {t_2:.2f} | {t_g:.2f} | {floor:.2f} | "
        f"{t_f / t_2:.3f} | {same} |"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=sorted(MODELS), choices=sorted(MODELS))
    p.add_argument("--m", nargs="+", type=int, default=[1, 2, 4, 8])
    p.add_argument("--replays", type=int, default=20)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: needs CUDA", file=sys.stderr)
        return 2
    bw = copy_bandwidth()
    print(f"# {torch.cuda.get_device_name()}, copy bandwidth {bw:.0f} GB/s")
    print("| model | M | qkv config | fused µs | GEMM + RoPE op µs | GEMM alone µs | floor µs "
          "| fused / two | same bits |")  # fmt: skip
    print("|---|---:|---|---:|---:|---:|---:|---:|---|")
    for model in a.models:
        for m in a.m:
            print(run(model, m, bw, a.replays), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
