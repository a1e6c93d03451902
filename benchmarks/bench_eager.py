"""Eager host cost per call of every per-layer op, with the direct launch on and off.

Run through `python benchmarks/bench_layers.py --eager` (or `python benchmarks/bench_eager.py`).
Per preset shape (bf16) and T in (1, 512), for each op: the eager µs per call (a loop of n calls,
then one sync: host + device, and the host-only part before the sync) with the direct launch of
the compiled kernel on (the default) and off (`settings.override(direct_launch=False)`, as
SGL_EXT_DIRECT_LAUNCH=0: the Triton JIT on every call), beside a bare `x.add_(1)` (the floor of
any kernel launch from Python, timed as a column of each point) and the op's device time inside
a CUDA graph. Timed by eager_timing.py: everything warmed up first, then interleaved rounds,
medians over rounds. Goal (issue 14 / 15): "on" host µs near the floor, <= 10 µs.
"""

from __future__ import annotations

import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # eager_timing

from bench_util import SHAPES, graph_time_us  # noqa: E402  (benchmarks/)


def graph_us(fn) -> float:
    """Device µs per call of fn() in a CUDA graph."""
    return graph_time_us(lambda i: fn(), reps=50, replays=10)


def layer_ops(preset: str, t: int) -> dict:
    """{op name: fn()} for one shape and token count; every argument made up front."""
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
    norm_layer = RMSNorm(hidden, 1e-5, weight_in_fp32=False).to(dev, bf16)
    act_layer = SiluAndMul()
    rope, qk_rope = (
        sgl_ext.apply_rope_with_cos_sin_cache_inplace,
        (sgl_ext.apply_qk_norm_rope_with_cos_sin_cache_inplace),
    )
    return {
        "add+rmsnorm": lambda: sgl_ext.fused_add_rmsnorm(x, r, w, 1e-5, inplace=False),
        "RMSNorm layer (add)": lambda: norm_layer(x, r),
        "rmsnorm": lambda: sgl_ext.rmsnorm(x, w, 1e-5),
        "silu_and_mul": lambda: sgl_ext.silu_and_mul(g),
        "SiluAndMul layer": lambda: act_layer(g),
        "rope+kv": lambda: rope(pos, q, k, d, cs, True, arg),
        "rope": lambda: rope(pos, q, k, d, cs, True),
        "qknorm+rope+kv": lambda: qk_rope(pos, q, k, d, cs, qw, kw, 1e-6, True, arg),
        "set_kv_buffer": lambda: sgl_ext.set_kv_buffer(k3, v3, kb, vb, loc),
        "index store (peer)": lambda: (kb.__setitem__(loc, k3), vb.__setitem__(loc, v3)),
    }


def run_eager(
    presets: list[str], tokens: tuple[int, ...] = (1, 512), rounds: int = 9
) -> list[dict]:
    """Print the eager table (one JSON line per row, then markdown); returns the rows."""
    from eager_timing import Column, time_points

    from sgl_ext import settings

    def jit_only():
        return settings.override(direct_launch=False)

    x = torch.zeros(1, device="cuda")
    points, ops_of = {}, {}
    for preset in presets:
        for t in tokens:
            try:
                ops = layer_ops(preset, t)
            except Exception as err:  # noqa: BLE001 - one failing shape must not stop the table
                print(f"# {preset} T={t}: setup failed: {type(err).__name__}: {str(err)[:150]}")
                continue
            cols = {"floor": Column(lambda i: x.add_(1))}
            for name, fn in ops.items():
                cols[name + "|on"] = Column(lambda i, fn=fn: fn())
                cols[name + "|off"] = Column(lambda i, fn=fn: fn(), jit_only)
            points[(preset, t)], ops_of[(preset, t)] = cols, ops
    timings, _ = time_points(points, rounds=rounds)
    floors = [tm["floor"] for tm in timings.values() if "floor" in tm]
    floor = statistics.median(f.median for f in floors) if floors else float("nan")
    floor_host = statistics.median(f.host_median for f in floors) if floors else float("nan")
    print(f"# floor x.add_(1): {floor:.2f} µs per call ({floor_host:.2f} host)", flush=True)
    rows = []
    for (preset, t), ops in ops_of.items():
        tm = timings[(preset, t)]
        for name, fn in ops.items():
            row = {"preset": preset, "T": t, "op": name}
            for mode in ("on", "off"):
                if name + "|" + mode in tm:
                    m = tm[name + "|" + mode]
                    row[mode], row[mode + "_host"] = m.median, m.host_median
                    row[mode + "_q1"], row[mode + "_q3"] = m.quartiles()
            if "floor" in tm:
                row["floor"] = tm["floor"].median
            try:
                row["graph"] = graph_us(fn)
            except Exception as err:  # noqa: BLE001
                row["error"] = f"{type(err).__name__}: {str(err)[:150]}"
            rows.append(row)
            print(
                json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}),
                flush=True,
            )
    print(eager_table(rows, floor, floor_host, rounds))
    return rows


def eager_table(rows: list[dict], floor: float, floor_host: float, rounds: int = 9) -> str:
    def f(r, k):
        return f"{r[k]:.1f}" if k in r else "-"

    out = [
        f"eager µs per call (median over {rounds} interleaved rounds; IQR: first..third"
        f" quartile), direct launch on / off; floor x.add_(1) = {floor:.2f} µs ({floor_host:.2f}"
        " host), timed with each point; graph = device µs in a CUDA graph",
        "",
        "| preset | T | op | on | on IQR | on host | off | off host | on/floor | graph |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = f"{r['on'] / r['floor']:.2f}" if "on" in r and "floor" in r else "-"
        iqr = f"{r['on_q1']:.1f}-{r['on_q3']:.1f}" if "on_q1" in r else "-"
        cells = [f(r, "on"), iqr, f(r, "on_host"), f(r, "off"), f(r, "off_host"), ratio]
        cells.append(r["error"][:60] if "error" in r else f(r, "graph"))
        out.append(f"| {r['preset']} | {r['T']} | {r['op']} | " + " | ".join(cells) + " |")
    return "\n".join(out)


if __name__ == "__main__":
    run_eager(sys.argv[1:] or list(SHAPES))
