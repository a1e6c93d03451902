"""Launch-layout sweep of the q/k RMSNorm + RoPE + KV-write kernel (issue 17), Qwen3 shapes.

Per (T, shape): RoPE + KV alone (our op without the norm, its default layout), then the q/k-norm
op under each candidate of the row of `sgl_ext/tables/qk_norm.json` (D = 128) that T falls in,
all in CUDA graphs (bench_qk_norm_rope's inputs, bf16 cache). Every timing is taken in each of
`--rounds` rounds (the first one compiles and warms up every shape); a figure is the lowest
round median, and the ratio is to RoPE + KV alone (goal: <= 1.05). Then, per row, the candidate
with the lowest worst ratio over the row's T and both shapes, printed as qk_norm.json rows (on a
GPU with its own rows, the rows it reads: its own first, then the H100's).

Candidates: "default" (the table as it is), "lc" / "lc+pl" (the RoPE + KV table's bf16 layout,
without / with POS_LAST: a "layout": "rope_kv" row), or a layout as SGL_EXT_TRITON_CONFIG spells
it: "block_h=4,num_warps=4,order=2d,load=pre_wait" (sgl_ext/launch_layout.py's fields and
values).

Usage: python benchmarks/tune_qk_norm.py [--tokens 1 8 32 128 512] [--shapes ...] [--rounds 2]
           [--kv-dtype bf16|fp8_e4m3] [--candidates C ...] [--json-out F]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench_* modules

import bench_qk_norm_rope as bqn  # noqa: E402  (benchmarks/)
from bench_util import graph_time_us  # noqa: E402  (benchmarks/)

from sgl_ext import launch_tables, settings  # noqa: E402
from sgl_ext.launch_layout import parse_tuning  # noqa: E402
from sgl_ext.launch_tables import row_line  # noqa: E402
from sgl_ext.triton import rope_kv_plan  # noqa: E402

BIG = 1 << 62

# Candidates per row bound (the last T) of qk_norm.json's D = 128 rows. From the 64 row on, the
# first after "default" is the row's layout before LOAD_BARRIER (merged programs / POS_LAST).
CANDIDATES: dict[int, tuple[str, ...]] = {
    8: (  # PRE_WAIT (the position and cos/sin before the PDL wait) layouts, then the old one
        # the row before its slot moved before the wait, and before its norm weights did
        "block_h=4,num_warps=4,order=2d,load=pre_wait,early_release=1,norm_w_pre=1",
        "block_h=4,num_warps=4,order=2d,load=pre_wait,early_release=1",
        "block_h=4,num_warps=4,order=2d,load=pre_wait",
        "block_h=1,num_warps=1,order=2d,load=pre_wait",
        "block_h=1,num_warps=1,order=2d,load=pre_wait,early_release=1",
        "block_h=2,num_warps=2,order=2d,load=pre_wait,early_release=1",
        "block_h=1,num_warps=4,order=2d,load=pre_wait,early_release=1",
        "block_h=4,num_warps=2,order=2d,load=pre_wait,early_release=1",
        "block_h=4,num_warps=4,order=2d,load=pos_last,early_release=1",
    ),
    32: (
        "block_h=1,num_warps=1,order=2d",
        "block_h=1,num_warps=1,order=2d,load=pos_last",
        "block_h=2,num_warps=2,order=2d,load=pos_last",
        "block_h=4,num_warps=4,order=2d,load=pos_last",
        # one program per GQA group: 4 query heads and its key/value head
        "block_h=4,num_warps=4,programs=spread,load=pos_last",
        "block_h=4,num_warps=4,order=2d,load=load_barrier",
        "block_h=4,num_warps=4,order=2d,load=pos_last,early_release=1",
        # PRE_WAIT (RoPE + KV alone's layout here), with / without the early
        # release, as the 8 row
        "block_h=4,num_warps=4,order=2d,load=pre_wait",
        "block_h=4,num_warps=4,order=2d,load=pre_wait,early_release=1",
        "block_h=2,num_warps=2,order=2d,load=pre_wait,early_release=1",
        "block_h=4,num_warps=2,order=2d,load=pre_wait,early_release=1",
        "block_h=1,num_warps=1,order=2d,load=pre_wait,early_release=1",
        # PRE_WAIT with the norm weights before the wait too (NORM_W_PRE)
        "block_h=4,num_warps=4,order=2d,load=pre_wait,norm_w_pre=1",
        "block_h=4,num_warps=4,order=2d,load=pre_wait,early_release=1,norm_w_pre=1",
        "block_h=8,num_warps=4,order=2d,load=pre_wait,norm_w_pre=1",
        "block_h=4,num_warps=4,order=2d,load=pre_wait,kv_block_h=2,norm_w_pre=1",
    ),
    64: (
        "block_h=4,num_warps=4,order=2d",
        "block_h=4,num_warps=4,order=2d,load=pos_last",
        "block_h=4,num_warps=4,load=load_barrier",
        "block_h=4,num_warps=4,order=2d,load=load_barrier,kv_block_h=2",
        "block_h=4,num_warps=4,order=2d,load=load_barrier,kv_block_h=1",
        "block_h=4,num_warps=2,order=2d,load=load_barrier",
        "block_h=8,num_warps=4,order=2d,load=load_barrier,kv_block_h=4",
        "block_h=8,num_warps=8,order=2d,load=load_barrier",
        # PRE_WAIT (the position and cos/sin row before the PDL wait), as the 8 row
        "block_h=4,num_warps=4,order=2d,load=pre_wait",
        "block_h=4,num_warps=4,order=2d,load=pre_wait,early_release=1",
        "block_h=4,num_warps=4,order=2d,load=pre_wait,kv_block_h=2",
        "block_h=8,num_warps=4,order=2d,load=pre_wait,kv_block_h=2",
        "block_h=2,num_warps=2,order=2d,load=pre_wait",
    ),
    160: (
        "block_h=4,num_warps=4,programs=merged",
        "block_h=8,num_warps=4,load=load_barrier",
        "block_h=8,num_warps=4,load=load_barrier,kv_block_h=4",
        "block_h=8,num_warps=4,order=2d,load=load_barrier,kv_block_h=4",
        "block_h=8,num_warps=4,order=2d,load=load_barrier,kv_block_h=2",
        "block_h=8,num_warps=8,order=2d,load=load_barrier",
        "block_h=8,num_warps=8,order=2d,load=load_barrier,kv_block_h=4",
        "block_h=16,num_warps=8,order=2d,load=load_barrier",
        "block_h=4,num_warps=4,order=2d,load=load_barrier",
        "block_h=8,num_warps=4,order=2d,load=pre_wait,kv_block_h=2",
        "block_h=8,num_warps=4,order=2d,load=pre_wait",
        "block_h=4,num_warps=4,order=2d,load=pre_wait",
    ),
    BIG: (
        "block_h=16,num_warps=4,programs=merged",
        "lc",
        "block_h=8,num_warps=4,order=2d,load=load_barrier",
        "block_h=16,num_warps=4,load=load_barrier",
        "block_h=16,num_warps=8,load=load_barrier",
        "block_h=16,num_warps=4,programs=merged,load=load_barrier",
        "block_h=8,num_warps=2,load=load_barrier",
        # the table's row (8 query / 4 key-value heads, LOAD_BARRIER) with other warps and
        # key/value blocks (the H200 rows were chosen among these)
        "block_h=8,num_warps=8,load=load_barrier,kv_block_h=4",
        "block_h=8,num_warps=4,load=load_barrier,kv_block_h=8",
        "block_h=8,num_warps=4,load=load_barrier,kv_block_h=2",
        "block_h=16,num_warps=8,load=load_barrier,kv_block_h=4",
        "block_h=4,num_warps=4,load=load_barrier,kv_block_h=4",
        "block_h=8,num_warps=4,order=kv_first,load=load_barrier,kv_block_h=4",
    ),
}
CANDIDATES[256] = CANDIDATES[160]


def parse(cand: str) -> dict[str, object]:
    """A candidate as a qk_norm.json row's layout fields (without head_dim and tokens)."""
    if cand in ("lc", "lc+pl"):
        return {"layout": "rope_kv", **({"load": "pos_last"} if cand == "lc+pl" else {})}
    return parse_tuning(cand).to_row()


def own_fields(row) -> dict[str, object]:
    """A table row's layout fields, as parse() gives a candidate's."""
    if row.config is not None:
        return row.config.to_row()
    return {"layout": "rope_kv", **({"load": row.load.value} if row.load else {})}


class Tables:
    """Puts a candidate in place of the q/k-norm table (every T, head size and GPU), through
    launch_tables.override, which drops the ops' cached launch plans; restore() puts the file's
    rows back. `rows` are the D = 128 rows this GPU reads ("default"): its own, then the H100's."""

    def __init__(self) -> None:
        self.stack = contextlib.ExitStack()
        device = torch.device("cuda", torch.cuda.current_device())
        rows = rope_kv_plan.qk_norm_layouts(device)
        self.rows = [r for r in rows if r.head_dim == 128]
        self.own = len(rope_kv_plan.qk_norm_table().device_rows(device))

    def set(self, cand: str) -> None:
        self.restore()
        if cand != "default":
            row = {"head_dim": "other", "tokens": [1, None], **parse(cand)}
            self.stack.enter_context(launch_tables.override("qk_norm", {"rows": [row]}))

    def restore(self) -> None:
        self.stack.close()
        settings.reload()

    def row(self, t: int) -> int:
        """The index in `rows` of the row that serves T."""
        return next(i for i, r in enumerate(self.rows) if r.covers(t))


def sweep(args, tables: Tables) -> list[dict]:
    """Per (T, shape): {"rope_kv": µs, "us": {candidate: µs}, "ratio": {candidate: x}}."""
    os.environ.pop("SGL_EXT_TRITON_CONFIG", None)  # the override would bypass the tables
    rows = []
    for t in args.tokens:  # T outer: a run cut short still has the small T of both shapes
        bound = tables.rows[tables.row(t)].last or BIG
        row_cands = args.candidates or CANDIDATES.get(bound, ("lc", "lc+pl"))
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
    row qk_norm.json would take (rows without a sweep point keep theirs)."""
    out, table = [], []
    for i, entry in enumerate(tables.rows):
        section = "devices" if i < tables.own else "rows"
        label = f"T {entry.first}..{entry.last or ''}"
        head = {"head_dim": 128, "tokens": [entry.first, entry.last]}
        pts = [r for r in rows if r["row"] == i]
        cands = set.intersection(*(set(r["ratio"]) for r in pts)) if pts else set()
        if not cands:
            table.append(
                f"# {section}, {label}: not swept\n    {row_line({**head, **own_fields(entry)})},"
            )
            continue
        worst = {k: max(r["ratio"][k] for r in pts) for k in cands}
        win = min(worst, key=worst.get)
        ranked = sorted(worst, key=worst.get)[:7]
        out.append(
            f"QKNORM_ROW {label}: winner {win} worst {worst[win]:.3f} "
            f"{'ok' if worst[win] <= 1.05 else 'MISS'}; default {worst.get('default', 0):.3f}; "
            + ", ".join(f"{k} {worst[k]:.3f}" for k in ranked if k not in (win, "default"))
            + " | points: "
            + ", ".join(f"{r['shape']} T={r['T']} {r['ratio'][win]:.3f}" for r in pts)
        )
        fields = own_fields(entry) if win == "default" else parse(win)
        note = f"{win}, worst {worst[win]:.3f}"
        table.append(f"# {section}, {label}: {note}\n    {row_line({**head, **fields})},")
    out.append(
        "# rows for sgl_ext/tables/qk_norm.json (D = 128; the measurements go to RESULTS.md 8)"
    )
    out += table
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
