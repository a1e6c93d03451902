"""Launch-layout sweep of the q/k RMSNorm + RoPE + KV-write kernel (issue 17), Qwen3 shapes.

Per (T, shape): RoPE + KV alone (our op without the norm, its default layout), then the q/k-norm
op under each candidate of the row of `rope_kv_plan.QK_NORM_LAYOUTS` that T falls in, all in
CUDA graphs (bench_qk_norm_rope's inputs, bf16 cache). Every timing is taken in each of
`--rounds` rounds (the first one compiles and warms up every shape); a figure is the lowest
round median, and the ratio is to RoPE + KV alone (goal: <= 1.05). Then, per row, the candidate
with the lowest worst ratio over the row's T and both shapes, printed as the code's table
(QK_NORM_LAYOUTS, QK_NORM_POS_LAST_TOKENS) to paste into rope_kv_plan.py (on a GPU with its
own table, QK_NORM_DEVICE_LAYOUTS, that table's rows are "default").

Candidates: "default" (the table as it is), "lc" / "lc+pl" (launch_config's bf16 layout, without
/ with POS_LAST), or "block_h,num_warps,order,merged,spread,pos_last" (order 0: 2-D grid, 1:
token-major, 2: key/value programs first; see rope_kv_plan.LaunchConfig), optionally followed
by ",hoist[,early_release[,load_barrier[,kv_block_h[,pre_wait[,norm_w_pre[,slot_pre]]]]]]"
(flags 0 / 1; kv_block_h 0: as block_h).

Usage: python benchmarks/tune_qk_norm.py [--tokens 1 8 32 128 512] [--shapes ...] [--rounds 2]
           [--kv-dtype bf16|fp8_e4m3] [--candidates C ...] [--json-out F]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench_* modules

import bench_qk_norm_rope as bqn  # noqa: E402  (benchmarks/)
from bench_util import graph_time_us  # noqa: E402  (benchmarks/)

from sgl_ext import settings  # noqa: E402
from sgl_ext.triton import rope_kv_plan  # noqa: E402
from sgl_ext.triton.rope_kv_plan import LaunchConfig  # noqa: E402

BIG = 1 << 62

# Candidates per row bound of QK_NORM_LAYOUTS (D = 128). From the 64 row on, the first after
# "default" is the row's layout before LOAD_BARRIER (merged programs / POS_LAST).
CANDIDATES: dict[int, tuple[str, ...]] = {
    8: (  # PRE_WAIT (the position and cos/sin before the PDL wait) layouts, then the old one
        "4,4,0,0,0,0,0,1,0,0,1,1,0",  # the row before its slot moved before the wait
        "4,4,0,0,0,0,0,1,0,0,1,0",  # ... and before its norm weights did
        "4,4,0,0,0,0,0,0,0,0,1",
        "1,1,0,0,0,0,0,0,0,0,1",
        "1,1,0,0,0,0,0,1,0,0,1",
        "2,2,0,0,0,0,0,1,0,0,1",
        "1,4,0,0,0,0,0,1,0,0,1",
        "4,2,0,0,0,0,0,1,0,0,1",
        "4,4,0,0,0,1,0,1",
    ),
    32: (
        "1,1,0,0,0,0",
        "1,1,0,0,0,1",
        "2,2,0,0,0,1",
        "4,4,0,0,0,1",
        "4,4,1,1,1,1",  # one program per GQA group: 4 query heads and its key/value head
        "4,4,0,0,0,0,0,0,1",
        "4,4,0,0,0,1,0,1",
        # PRE_WAIT (RoPE + KV alone's layout here), with / without the early
        # release, as the 8 row
        "4,4,0,0,0,0,0,0,0,0,1",
        "4,4,0,0,0,0,0,1,0,0,1",
        "2,2,0,0,0,0,0,1,0,0,1",
        "4,2,0,0,0,0,0,1,0,0,1",
        "1,1,0,0,0,0,0,1,0,0,1",
        # PRE_WAIT with the norm weights before the wait too (NORM_W_PRE)
        "4,4,0,0,0,0,0,0,0,0,1,1",
        "4,4,0,0,0,0,0,1,0,0,1,1",
        "8,4,0,0,0,0,0,0,0,0,1,1",
        "4,4,0,0,0,0,0,0,0,2,1,1",
    ),
    64: (
        "4,4,0,0,0,0",
        "4,4,0,0,0,1",
        "4,4,1,0,0,0,0,0,1",
        "4,4,0,0,0,0,0,0,1,2",
        "4,4,0,0,0,0,0,0,1,1",
        "4,2,0,0,0,0,0,0,1",
        "8,4,0,0,0,0,0,0,1,4",
        "8,8,0,0,0,0,0,0,1",
        # PRE_WAIT (the position and cos/sin row before the PDL wait), as the 8 row
        "4,4,0,0,0,0,0,0,0,0,1",
        "4,4,0,0,0,0,0,1,0,0,1",
        "4,4,0,0,0,0,0,0,0,2,1",
        "8,4,0,0,0,0,0,0,0,2,1",
        "2,2,0,0,0,0,0,0,0,0,1",
    ),
    160: (
        "4,4,1,1,0,0",
        "8,4,1,0,0,0,0,0,1",
        "8,4,1,0,0,0,0,0,1,4",
        "8,4,0,0,0,0,0,0,1,4",
        "8,4,0,0,0,0,0,0,1,2",
        "8,8,0,0,0,0,0,0,1",
        "8,8,0,0,0,0,0,0,1,4",
        "16,8,0,0,0,0,0,0,1",
        "4,4,0,0,0,0,0,0,1",
        "8,4,0,0,0,0,0,0,0,2,1",
        "8,4,0,0,0,0,0,0,0,0,1",
        "4,4,0,0,0,0,0,0,0,0,1",
    ),
    BIG: (
        "16,4,1,1,0,0",
        "lc",
        "8,4,0,0,0,0,0,0,1",
        "16,4,1,0,0,0,0,0,1",
        "16,8,1,0,0,0,0,0,1",
        "16,4,1,1,0,0,0,0,1",
        "8,2,1,0,0,0,0,0,1",
        # the table's row (8 query / 4 key-value heads, LOAD_BARRIER) with other warps and
        # key/value blocks (the H200 rows were chosen among these)
        "8,8,1,0,0,0,0,0,1,4",
        "8,4,1,0,0,0,0,0,1,8",
        "8,4,1,0,0,0,0,0,1,2",
        "16,8,1,0,0,0,0,0,1,4",
        "4,4,1,0,0,0,0,0,1,4",
        "8,4,2,0,0,0,0,0,1,4",
    ),
}
CANDIDATES[256] = CANDIDATES[160]
ORDER_NAMES = {0: "ORDER_2D", 1: "ORDER_TOKEN", 2: "ORDER_KV_FIRST"}


def parse(cand: str) -> tuple[LaunchConfig | None, bool]:
    """A candidate as (layout, None for launch_config's; POS_LAST for launch_config's)."""
    if cand in ("lc", "lc+pl"):
        return None, cand == "lc+pl"
    vals = [int(x) for x in cand.split(",")]
    bh, warps, order, merged, spread, pos_last = vals[:6]
    flags = [bool(x) for x in vals[6:9]]  # hoist, early_release, load_barrier
    cfg = LaunchConfig(
        bh, warps, order, bool(merged), bool(spread), 0, bool(pos_last), *flags, *vals[9:10]
    )
    if len(vals) > 10:
        cfg = cfg._replace(pre_wait=bool(vals[10]))
    if len(vals) > 11:
        cfg = cfg._replace(norm_w_pre=bool(vals[11]))
    if len(vals) > 12:
        cfg = cfg._replace(slot_pre=bool(vals[12]))
    return cfg, False


def code(cfg: LaunchConfig | None) -> str:
    """A table entry as rope_kv_plan.py writes it."""
    if cfg is None:
        return "None"
    args = [str(cfg.block_h), str(cfg.num_warps), ORDER_NAMES[cfg.order]]
    flags = ("merged", "spread", "pos_last", "hoist", "early_release", "load_barrier")
    flags += ("pre_wait", "norm_w_pre", "slot_pre")
    args += [f"{k}=True" for k in flags if getattr(cfg, k)]
    args += [f"kv_block_h={cfg.kv_block_h}"] if cfg.kv_block_h else []
    return f"LaunchConfig({', '.join(args)})"


class Tables:
    """Sets rope_kv_plan's q/k-norm tables for a candidate; restore() puts the code's back.
    Each change reloads the settings, which drops the ops' cached launch plans. `rows` is the
    table this GPU uses (its own from QK_NORM_DEVICE_LAYOUTS, else QK_NORM_LAYOUTS): "default"."""

    def __init__(self) -> None:
        self.base = rope_kv_plan.QK_NORM_LAYOUTS
        self.device_rows = rope_kv_plan.QK_NORM_DEVICE_LAYOUTS
        self.rows = rope_kv_plan.qk_norm_layouts(torch.device("cuda", torch.cuda.current_device()))
        self.pos_last_tokens = rope_kv_plan.QK_NORM_POS_LAST_TOKENS

    def set(self, cand: str) -> None:
        if cand == "default":
            self.restore()
            return
        cfg, pos_last = parse(cand)
        rope_kv_plan.QK_NORM_LAYOUTS = ((BIG, cfg),)
        rope_kv_plan.QK_NORM_DEVICE_LAYOUTS = {}
        rope_kv_plan.QK_NORM_POS_LAST_TOKENS = BIG if pos_last else 0
        settings.reload()

    def restore(self) -> None:
        rope_kv_plan.QK_NORM_LAYOUTS = self.base
        rope_kv_plan.QK_NORM_DEVICE_LAYOUTS = self.device_rows
        rope_kv_plan.QK_NORM_POS_LAST_TOKENS = self.pos_last_tokens
        settings.reload()

    def row(self, t: int) -> int:
        return next(hi for hi, _ in self.rows if t <= hi)


def sweep(args, tables: Tables) -> list[dict]:
    """Per (T, shape): {"rope_kv": µs, "us": {candidate: µs}, "ratio": {candidate: x}}."""
    os.environ.pop("SGL_EXT_TRITON_CONFIG", None)  # the override would bypass the tables
    rows = []
    for t in args.tokens:  # T outer: a run cut short still has the small T of both shapes
        row_cands = args.candidates or CANDIDATES.get(tables.row(t), ("lc", "lc+pl"))
        cands = ("default", *row_cands)
        for shape in args.shapes:
            c = bqn.NormCase(shape, t, bqn.brk.KV_DTYPES[args.kv_dtype])
            reps = max(4, min(200, int(2e5 / max(1.0, c.bytes / 3e3))))
            base, us = [], {k: [] for k in cands}
            for _ in range(args.rounds):
                tables.restore()
                base.append(graph_time_us(c.fused, reps))
                for cand in cands:
                    try:
                        tables.set(cand)
                        us[cand].append(graph_time_us(c.qk_fused, reps))
                    except Exception as err:  # noqa: BLE001  (one candidate must not stop it)
                        print(f"# {shape} T={t} {cand} failed: {str(err)[-200:]}", flush=True)
            tables.restore()
            r = {"shape": shape, "T": t, "row": tables.row(t), "rope_kv": min(base)}
            r["us"] = {k: min(v) for k, v in us.items() if v}
            r["ratio"] = {k: v / r["rope_kv"] for k, v in r["us"].items()}
            rows.append(r)
            best = min(r["ratio"], key=r["ratio"].get)
            print(
                f"QKNORM_SWEEP {shape} T={t} rope_kv {r['rope_kv']:.2f} us (rounds "
                + "/".join(f"{b:.2f}" for b in base)
                + "); "
                + "; ".join(f"{k} {r['us'][k]:.2f} ({q:.3f})" for k, q in r["ratio"].items())
                + f"; best {best} {r['ratio'][best]:.3f}",
                flush=True,
            )
            del c
            torch.cuda.empty_cache()
    return rows


def winners(rows: list[dict], tables: Tables) -> str:
    """Per table row: each candidate's worst ratio over the row's points, the winner, and the
    table rope_kv_plan.py would take (rows without a sweep point keep their entry)."""
    out, table, pl_bound = [], [], 0
    lower = 0
    for hi, entry in tables.rows:
        pts = [r for r in rows if r["row"] == hi]
        cands = set.intersection(*(set(r["ratio"]) for r in pts)) if pts else set()
        if not cands:
            table.append(f"    ({hi if hi < BIG else '1 << 62'}, {code(entry)}),  # not swept")
            if entry is None and tables.pos_last_tokens > lower:
                pl_bound = max(pl_bound, min(hi, tables.pos_last_tokens))
            lower = hi
            continue
        worst = {k: max(r["ratio"][k] for r in pts) for k in cands}
        win = min(worst, key=worst.get)
        ranked = sorted(worst, key=worst.get)[:7]
        label = f"T<={hi}" if hi < BIG else f"T>{lower}"
        out.append(
            f"QKNORM_ROW {label}: winner {win} worst {worst[win]:.3f} "
            f"{'ok' if worst[win] <= 1.05 else 'MISS'}; default {worst.get('default', 0):.3f}; "
            + ", ".join(f"{k} {worst[k]:.3f}" for k in ranked if k not in (win, "default"))
            + " | points: "
            + ", ".join(f"{r['shape']} T={r['T']} {r['ratio'][win]:.3f}" for r in pts)
        )
        if win == "default":
            cfg = entry
            pos_last = entry is None and tables.pos_last_tokens >= hi
        else:
            cfg, pos_last = parse(win)
        if cfg is None and pos_last:
            pl_bound = max(pl_bound, hi)
        note = f"{win}, worst {worst[win]:.3f}"
        table.append(f"    ({hi if hi < BIG else '1 << 62'}, {code(cfg)}),  # {note}")
        lower = hi
    out.append("QK_NORM_LAYOUTS: tuple[tuple[int, LaunchConfig | None], ...] = (")
    out += table
    out.append(")")
    out.append(f"QK_NORM_POS_LAST_TOKENS = {pl_bound}  # None rows: POS_LAST up to this T")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 128, 512])
    p.add_argument("--shapes", nargs="+", default=list(bqn.SHAPES), choices=bqn.SHAPES)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--kv-dtype", default="bf16", choices=bqn.brk.KV_DTYPES)
    p.add_argument(
        "--candidates",
        nargs="+",
        help="these candidates (and default) at every T instead of the row's CANDIDATES",
    )
    p.add_argument("--json-out")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("error: tune_qk_norm needs a CUDA GPU", file=sys.stderr)
        sys.exit(2)
    if args.rounds < 1:
        print("error: --rounds must be >= 1", file=sys.stderr)
        sys.exit(2)
    for cand in args.candidates or ():
        try:
            parse(cand)
        except (ValueError, TypeError) as err:
            print(f"error: --candidates {cand!r}: {err}", file=sys.stderr)
            sys.exit(2)
    t0 = time.time()
    print(f"# device {torch.cuda.get_device_name()}; µs per call in CUDA graphs", flush=True)
    tables = Tables()
    try:
        rows = sweep(args, tables)
    finally:
        tables.restore()
    print(winners(rows, tables))
    print(f"# {time.time() - t0:.0f} s")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"rows": rows, "args": vars(args)}, f)


if __name__ == "__main__":
    main()
