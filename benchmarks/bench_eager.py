"""Eager host cost per call of every per-layer op, with the direct launch on and off.

Run through `python benchmarks/bench_layers.py --eager` (or `python benchmarks/bench_eager.py`).
Per preset shape (bf16) and T in (1, 512), for each op: the eager µs per call (n calls in a host
loop, then one sync, median of 7 loops after a warm-up: host + device, and the host-only part
before the sync) with the direct launch of the compiled kernel on (the default) and off
(`settings.override(direct_launch=False)`, as SGL_EXT_DIRECT_LAUNCH=0: the Triton JIT on every
call), beside a bare `x.add_(1)` (the floor of any kernel launch from Python) and the op's device
time inside a CUDA graph. Goal (issue 14 / 15): "on" host µs near the floor, <= 10 µs.
"""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_util import SHAPES, eager_us, graph_time_us  # noqa: E402  (benchmarks/)


def layer_ops(preset: str, t: int) -> dict:
    """{op name: fn(i)} (i unused) for one shape and token count; every argument made up front."""
    import sgl_ext
    from sgl_ext import FusedSetKVBufferArg
    from srt.layers.activation import SiluAndMul
    from srt.layers.layernorm import RMSNorm

    hidden, inter, hq, hkv, d = SHAPES[preset]
    dev, bf16 = "cuda", torch.bfloat16
    x = torch.randn(t, hidden, device=dev, dtype=bf16)
    r = torch.randn_like(x)
    w = torch.rand(hidden, device=dev, dtype=bf16) + 0.5
    g = torch.randn(t, 2 * inter, device=dev, dtype=bf16)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, device=dev, dtype=bf16)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)  # strided views, as in the models
    pos = torch.randint(0, 4096, (t,), device=dev)
    ang = torch.rand(4096, d // 2, device=dev)
    cs = torch.cat((ang.cos(), ang.sin()), dim=-1)  # [max_pos, d] fp32
    slots = t + 16
    kb = torch.zeros(slots, hkv, d, device=dev, dtype=bf16)
    vb = torch.zeros_like(kb)
    loc = torch.arange(t, device=dev) + 1
    arg = FusedSetKVBufferArg(v, kb, vb, None, None, loc)
    qw = torch.rand(d, device=dev, dtype=bf16) + 0.5
    kw = torch.rand(d, device=dev, dtype=bf16) + 0.5
    k3, v3 = k.view(t, hkv, d), v.view(t, hkv, d)
    norm_layer = RMSNorm(hidden, 1e-5).to(dev, bf16)
    act_layer = SiluAndMul()
    rope, qk_rope = (
        sgl_ext.apply_rope_with_cos_sin_cache_inplace,
        (sgl_ext.apply_qk_norm_rope_with_cos_sin_cache_inplace),
    )
    return {
        "add+rmsnorm": lambda _: sgl_ext.fused_add_rmsnorm(x, r, w, 1e-5, inplace=False),
        "RMSNorm layer (add)": lambda _: norm_layer(x, r),
        "rmsnorm": lambda _: sgl_ext.rmsnorm(x, w, 1e-5),
        "silu_and_mul": lambda _: sgl_ext.silu_and_mul(g),
        "SiluAndMul layer": lambda _: act_layer(g),
        "rope+kv": lambda _: rope(pos, q, k, d, cs, True, arg),
        "rope": lambda _: rope(pos, q, k, d, cs, True),
        "qknorm+rope+kv": lambda _: qk_rope(pos, q, k, d, cs, qw, kw, 1e-6, True, arg),
        "set_kv_buffer": lambda _: sgl_ext.set_kv_buffer(k3, v3, kb, vb, loc),
        "index store (peer)": lambda _: (kb.__setitem__(loc, k3), vb.__setitem__(loc, v3)),
    }


def run_eager(presets: list[str], tokens: tuple[int, ...] = (1, 512)) -> list[dict]:
    """Print the eager table (one JSON line per row, then markdown); returns the rows."""
    from sgl_ext import settings

    x = torch.zeros(1, device="cuda")
    floor, floor_host = eager_us(lambda i: x.add_(1), 2000, warmup=20)
    print(f"# floor x.add_(1): {floor:.2f} µs per call ({floor_host:.2f} host)", flush=True)
    rows = []
    for preset in presets:
        for t in tokens:
            try:
                ops = layer_ops(preset, t)
            except Exception as err:  # noqa: BLE001 - one failing shape must not stop the table
                print(f"# {preset} T={t}: setup failed: {type(err).__name__}: {str(err)[:150]}")
                continue
            for name, fn in ops.items():
                row = {"preset": preset, "T": t, "op": name}
                try:
                    row["on"], row["on_host"] = eager_us(fn, 500, warmup=20)
                    with settings.override(direct_launch=False):
                        row["off"], row["off_host"] = eager_us(fn, 300, warmup=20)
                    row["graph"] = graph_time_us(fn, reps=50, replays=10)
                except Exception as err:  # noqa: BLE001
                    row["error"] = f"{type(err).__name__}: {str(err)[:150]}"
                rows.append(row)
                print(
                    json.dumps(
                        {k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}
                    ),
                    flush=True,
                )
    print(eager_table(rows, floor, floor_host))
    return rows


def eager_table(rows: list[dict], floor: float, floor_host: float) -> str:
    def f(r, k):
        return f"{r[k]:.1f}" if k in r else "-"

    out = [
        f"eager µs per call (median of 7 loops), direct launch on / off; floor x.add_(1) ="
        f" {floor:.2f} µs ({floor_host:.2f} host); graph = device µs in a CUDA graph",
        "",
        "| preset | T | op | on | on host | off | off host | on/floor | graph |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = f"{r['on'] / floor:.2f}" if "on" in r else "-"
        cells = [f(r, "on"), f(r, "on_host"), f(r, "off"), f(r, "off_host"), ratio, f(r, "graph")]
        if "error" in r:
            cells[-1] = r["error"][:60]
        out.append(f"| {r['preset']} | {r['T']} | {r['op']} | " + " | ".join(cells) + " |")
    return "\n".join(out)


if __name__ == "__main__":
    run_eager(sys.argv[1:] or list(SHAPES))
