"""Decode GEMMs (M = 1..64 tokens) near the read floor: cuBLAS variants vs the skinny Triton GEMM.

For the decode linears of llama3-8b, qwen3-8b and gpt-oss-20b (attention qkv / o_proj; bf16,
biases where the model has them) and each M, device µs per call of every candidate, timed in a
CUDA graph that cycles through enough distinct weight copies (>= --min-copies and >= --min-mb per
pass) that no weight is in L2 when it is read; median over --replays graph replays, after an
eager warm-up of every call (Triton compiles, cuBLAS heuristics) and 3 untimed replays.

Candidates (each checked first against a float64 reference with bf16 tolerance; a failing one
is skipped with a loud "SKIP" line):
  F.linear  today's path (cuBLAS / cuBLASLt through torch)
  mv        torch.mv / torch.addmv, M = 1 only
  x@w_t     torch.matmul / addmm on a transposed copy w_t = w.t().contiguous() (another cuBLAS
            heuristic; a different weight layout, so a model would have to store it)
  triton    sgl_ext.gemm.linear_small_m, the best of a sweep of launch configurations:
            phase 1 tiles, phase 2 around the best tile: stages, warps and split-K. Past
            --budget-s the sweep stops (rows then time the cuBLAS candidates and --configs only);
            past --budget-s + --hard-extra-s no more rows are measured.

table = today's gemm.json row for the (N, K, M bucket), timed like the other Triton configs
(empty where the table has none). floor = weight (+ bias) bytes / the device-copy bandwidth
measured here (1 GiB copy, read + write); ratio = time / floor. The winner per (shape, M) is
printed beside each row; at the end, rows for sgl_ext/tables/gemm.json (Triton configurations
that beat F.linear by more than --min-gain) and the per-layer sums: F.linear, today's table,
those rows.

Usage: python benchmarks/bench_gemm.py [--presets llama3-8b qwen3-8b gpt-oss-20b]
           [--m 1 2 4 8 16 32 64] [--lm-head] [--sweep full|quick|none]
           [--configs "fma n16 k512 w4 s3 x1"] [--budget-s 360] [--json-out F]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench_util

from bench_util import eager_us, graph_time_us  # noqa: E402  (benchmarks/)

from sgl_ext.gemm import GemmConfig, linear_small_m  # noqa: E402
from sgl_ext.launch_tables import row_line  # noqa: E402
from srt.layers.gemm_choice import GEMM_CHOICES, m_bucket, table_row  # noqa: E402
from srt.utils.decode_floor import measure_copy_bandwidth  # noqa: E402


@dataclass(frozen=True)
class Shape:
    """One decode linear: weight [n, k], optional bias, which models use it (layers per model)."""

    name: str
    n: int
    k: int
    bias: bool
    users: tuple[tuple[str, int], ...]  # (preset, layers)


LAYERS = {"llama3-8b": 32, "qwen3-8b": 36, "gpt-oss-20b": 24}
LINEARS = {  # preset -> (name, N, K, bias); qkv = (Hq + 2 Hkv) D
    "llama3-8b": [
        ("o_proj", 4096, 4096, False),
        ("qkv", 6144, 4096, False),
        ("down", 4096, 14336, False),
        ("gate_up", 28672, 4096, False),
    ],
    "qwen3-8b": [
        ("o_proj", 4096, 4096, False),
        ("qkv", 6144, 4096, False),
        ("down", 4096, 12288, False),
        ("gate_up", 24576, 4096, False),
    ],
    "gpt-oss-20b": [
        ("o_proj", 2880, 4096, True),
        ("qkv", 5120, 2880, True),
        ("router", 32, 2880, True),
    ],
}
# --lm-head: each preset's LM head (once a step, not per layer), weight [vocab, hidden]
LM_HEADS = {"llama3-8b": 128256, "qwen3-8b": 151936, "gpt-oss-20b": 201088}
HIDDEN = {"llama3-8b": 4096, "qwen3-8b": 4096, "gpt-oss-20b": 2880}
MS = [1, 2, 4, 8, 16, 32, 64]
DT = torch.bfloat16


def shapes_of(presets: list[str], lm_head: bool = False) -> list[Shape]:
    """Distinct (n, k, bias) in order of first use, each with the presets that use it (with
    lm_head: their LM heads instead of the decoder layers' linears)."""
    out: dict[tuple[int, int, bool], Shape] = {}
    for p in presets:
        linears = [("lm_head", LM_HEADS[p], HIDDEN[p], False)] if lm_head else LINEARS[p]
        for name, n, k, b in linears:
            s = out.get((n, k, b))
            users = ((p, 1 if lm_head else LAYERS[p]),)
            out[(n, k, b)] = Shape(name, n, k, b, users if s is None else s.users + users)
    return list(out.values())


def parse_tag(tag: str) -> GemmConfig:
    """'fma n16 k512 w4 s3 x1' (GemmConfig.tag) -> GemmConfig."""
    kind, *parts = tag.split()
    vals = {p[0]: int(p[1:]) for p in parts}
    return GemmConfig(
        block_n=vals["n"],
        block_k=vals["k"],
        num_warps=vals.get("w", 4),
        num_stages=vals.get("s", 3),
        split_k=vals.get("x", 1),
        dot=kind == "dot",
    )


def phase1(m: int, sweep: str) -> list[GemmConfig]:
    """Tile configurations of the first sweep phase for m rows."""
    bm = 1 << (m - 1).bit_length()
    out = []
    if m <= 8:  # broadcast multiply + sum: the [BM, BN, BK] product within ~128 regs/thread
        # (its loads are not pipelined: one or two long K blocks a program, few rows, avoid a
        # round trip per block; measured best at M <= 2 on the H100 and H200)
        for bn in (1, 2, 4, 8, 16, 32):
            for bk in (128, 256, 512, 1024, 2048, 4096, 8192):
                quick = bk in (256, 512) or (bn <= 4 and bk in (2048, 4096))
                if 1024 <= bm * bn * bk <= 16384 and (sweep == "full" or quick):
                    stages = 3 if bk <= 1024 else 1
                    out.append(GemmConfig(block_n=bn, block_k=bk, num_warps=4, num_stages=stages))
    for bn in (16, 32, 64, 128):  # tensor-core dots (swap AB), BLOCK_M >= 16 (padded at small M)
        for bk in (64, 128, 256):
            if bn * bk <= 16384 and (sweep == "full" or (bn >= 32 and bk >= 128)):
                out.append(GemmConfig(block_n=bn, block_k=bk, num_warps=4, num_stages=3, dot=True))
    return out


def phase2(best: GemmConfig, k: int) -> list[GemmConfig]:
    """Variations of the best tile: stages (dots only: the broadcast path's loads are not
    pipelined), warps, split-K (K ranges of >= 1024)."""
    out = []
    if best.dot:
        out += [replace(best, num_stages=s) for s in (2, 4, 5) if s != best.num_stages]
    out += [replace(best, num_warps=w) for w in (2, 8) if w != best.num_warps]
    out += [replace(best, split_k=x) for x in (2, 4, 8) if k // x >= 1024]
    return out


class Problem:
    """Weights (copies), transposed copies, biases and x for one shape; freed by `close`."""

    def __init__(self, shape: Shape, bw: float, min_copies: int, min_mb: float) -> None:
        self.shape = shape
        wbytes = shape.n * shape.k * 2 + (shape.n * 2 if shape.bias else 0)
        self.copies = max(min_copies, math.ceil(min_mb * 1e6 / wbytes))
        self.floor_us = wbytes / bw * 1e6
        g = torch.Generator(device="cuda").manual_seed(shape.n * 7 + shape.k)
        self.w = [
            (torch.randn(shape.n, shape.k, device="cuda", generator=g) * 0.02).to(DT)
            for _ in range(self.copies)
        ]
        self.b = [
            torch.randn(shape.n, device="cuda", generator=g).to(DT) if shape.bias else None
            for _ in range(self.copies)
        ]
        self.wt: list[torch.Tensor] | None = None  # made on first use
        # passes over the copies per replay: >= ~500 µs of floor time per replay
        self.rounds = max(1, math.ceil(500.0 / (self.copies * self.floor_us)))

    def transposed(self) -> list[torch.Tensor]:
        if self.wt is None:
            self.wt = [w.t().contiguous() for w in self.w]  # [K, N]
        return self.wt

    def close(self) -> None:
        self.w, self.b, self.wt = [], [], None
        torch.cuda.empty_cache()


def check(name: str, out: torch.Tensor, ref: torch.Tensor) -> str | None:
    """None if out matches the float64 reference within bf16 tolerance, else why not."""
    if tuple(out.shape) != tuple(ref.shape):
        return f"shape {tuple(out.shape)} != {tuple(ref.shape)}"
    err = (out.double() - ref).abs()
    tol = 1e-2 * ref.abs() + 5e-3 * ref.abs().max()  # bf16 rounding + reduced-precision split-K
    bad = ~(err <= tol)  # NaN counts as bad
    if bool(bad.any()):
        return f"{int(bad.sum())} of {bad.numel()} elements off (max err {err.max().item():.3g})"
    return None


class Runner:
    """Times the candidates of one (problem, m); remembers results for the summary."""

    def __init__(self, args: argparse.Namespace, deadline: float) -> None:
        self.args, self.deadline = args, deadline
        self.rows: list[dict] = []

    def time_candidate(self, prob: Problem, m: int, x: torch.Tensor, ref, name: str, call):
        """call(i) -> output of copy i; checked on copy 0 (after a NaN-filled block of the
        output's size is freed, so an unwritten output cannot look right), then timed."""
        try:
            torch.empty_like(ref, dtype=DT).fill_(float("nan"))  # poison the block, free it
            why = check(name, call(0).reshape(ref.shape), ref)
            if why is not None:
                print(f"  SKIP {name} (n={prob.shape.n} k={prob.shape.k} m={m}): wrong: {why}")
                return None
            calls = prob.copies * prob.rounds
            # every call warmed up before capture (compiles, heuristics, plans)
            fn = lambda i: call(i % prob.copies)
            return graph_time_us(fn, calls, self.args.replays, warmup=None)
        except Exception as e:  # noqa: BLE001 - one failure must not end the table
            msg = traceback.format_exception_only(type(e), e)[-1].strip()[:300]
            print(f"  SKIP {name} (n={prob.shape.n} k={prob.shape.k} m={m}): {msg}")
            torch.cuda.synchronize()
            return None

    def run(self, prob: Problem, m: int) -> None:
        sh = prob.shape
        g = torch.Generator(device="cuda").manual_seed(m)
        x = torch.randn(m, sh.k, device="cuda", generator=g).to(DT)
        w0, b0 = prob.w[0], prob.b[0]
        ref = x.double() @ w0.double().t()
        if b0 is not None:
            ref += b0.double()
        res: dict[str, float] = {}
        W, B = prob.w, prob.b

        def add(name: str, call) -> float | None:
            t = self.time_candidate(prob, m, x, ref, name, call)
            if t is not None:
                res[name] = t
            return t

        add("F.linear", lambda i: F.linear(x, W[i], B[i]))
        if m == 1:
            if sh.bias:
                add("mv", lambda i: torch.addmv(B[i], W[i], x[0]))
            else:
                add("mv", lambda i: torch.mv(W[i], x[0]))
        wt = prob.transposed()
        if sh.bias:
            add("x@w_t", lambda i: torch.addmm(B[i], x, wt[i]))
        else:
            add("x@w_t", lambda i: torch.matmul(x, wt[i]))
        prob.wt = None  # free the transposed copies before the sweep
        torch.cuda.empty_cache()

        tri: dict[GemmConfig, float] = {}

        def sweep(cfgs: list[GemmConfig]) -> None:
            for cfg in cfgs:
                if cfg in tri or time.monotonic() > self.deadline:
                    continue
                t = self.time_candidate(
                    prob,
                    m,
                    x,
                    ref,
                    f"triton[{cfg.tag}]",
                    lambda i, c=cfg: linear_small_m(x, W[i], B[i], c),
                )
                if t is not None:
                    tri[cfg] = t

        a = self.args
        table_cfg = GEMM_CHOICES.get((sh.n, sh.k, m_bucket(m)))  # today's choice for this row
        fixed = [parse_tag(t) for t in a.configs]
        sweep(([table_cfg] if table_cfg is not None else []) + fixed)
        if table_cfg in tri:
            res["table"] = tri[table_cfg]
        if a.sweep != "none":
            sweep(phase1(m, a.sweep))
            if tri and time.monotonic() < self.deadline - a.phase2_reserve_s:
                sweep(phase2(min(tri, key=tri.__getitem__), sh.k))
        best_cfg = min(tri, key=tri.__getitem__) if tri else None
        if best_cfg is not None:
            res["triton"] = tri[best_cfg]
        self.report(prob, m, res, best_cfg, tri)

    def report(self, prob: Problem, m: int, res: dict, cfg: GemmConfig | None, tri: dict):
        sh, fl = prob.shape, prob.floor_us

        def col(name: str) -> str:
            return f"{res[name]:8.2f}" if name in res else f"{'-':>8}"

        cand = {k: v for k, v in res.items() if k != "table"}  # the table's config is a triton one
        win = min(cand, key=cand.__getitem__) if cand else "-"
        ratio = f"{cand[win] / fl:5.2f}" if cand else "  -  "
        tag = cfg.tag if cfg else "-"
        label = f"{sh.name} {sh.n}x{sh.k}{'+b' if sh.bias else ''}"
        print(
            f"| {label:<22} | {m:3d} | {fl:7.2f} | {col('F.linear')} | {col('mv')} | "
            f"{col('x@w_t')} | {col('table')} | {col('triton')} | {tag:<24} | {ratio} | {win} |",
            flush=True,
        )
        self.rows.append(
            dict(
                name=sh.name,
                n=sh.n,
                k=sh.k,
                bias=sh.bias,
                m=m,
                floor_us=fl,
                users=[list(u) for u in sh.users],
                times_us=res,
                winner=win,
                triton_config=cfg.tag if cfg else None,
                triton_configs_timed=len(tri),
                triton_times_us={c.tag: t for c, t in tri.items()},
                triton_repr=repr(cfg) if cfg else None,
            )
        )


HEADER = (
    "| linear N x K | M | floor | F.linear | mv | x@w_t | table | triton | triton config | "
    "best/floor | winner |\n|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---|"
)


def summary(rows: list[dict], min_gain: float) -> None:
    """gemm.json rows and per-layer sums per preset and M."""
    print(
        "\n# rows for sgl_ext/tables/gemm.json (Triton beats F.linear by "
        f"> {min_gain:.0%}; each after its measurement, which goes to RESULTS.md 6.2):"
    )
    chosen: dict[tuple[int, int, int], float] = {}
    for r in rows:
        t, f = r["times_us"], r["times_us"].get("F.linear")
        if "triton" in t and f is not None and t["triton"] < f * (1 - min_gain):
            key = (r["n"], r["k"], r["m"])
            chosen[key] = t["triton"]
            users = "/".join(u[0] for u in r["users"])
            row = {**table_row(key, parse_tag(r["triton_config"])), "note": f"{users} {r['name']}"}
            print(
                f"# {t['triton']:.1f} us vs F.linear {f:.1f} (floor {r['floor_us']:.1f})\n"
                f"    {row_line(row)},"
            )
    if not chosen:
        print("    (none)")
    print(
        "\n# per decoder layer (sum of its linears), µs: F.linear, today's gemm.json, the "
        "rows above; per step"
    )
    presets = sorted({u[0] for r in rows for u in r["users"]})
    for p in presets:
        for m in sorted({r["m"] for r in rows}):
            mine = [r for r in rows if r["m"] == m and any(u[0] == p for u in r["users"])]
            if len(mine) != len(LINEARS[p]) or any("F.linear" not in r["times_us"] for r in mine):
                continue
            base = sum(r["times_us"]["F.linear"] for r in mine)
            today = sum(r["times_us"].get("table", r["times_us"]["F.linear"]) for r in mine)
            new = sum(chosen.get((r["n"], r["k"], r["m"]), r["times_us"]["F.linear"]) for r in mine)
            floor = sum(r["floor_us"] for r in mine)
            nl = LAYERS[p]
            print(
                f"{p:12s} M={m:3d}: F.linear {base:7.1f} / today {today:7.1f} -> {new:7.1f} "
                f"(floor {floor:6.1f}) per layer; x{nl} layers: {base * nl / 1e3:.3f} / "
                f"{today * nl / 1e3:.3f} -> {new * nl / 1e3:.3f} ms/step (floor "
                f"{floor * nl / 1e3:.3f})"
            )


def host_us(shape: Shape = Shape("o_proj", 4096, 4096, False, ()), calls: int = 200) -> None:
    """Eager host µs per call (enqueue time of `calls` back-to-back calls, no sync inside; median
    of 7 loops): what an eager decode step pays per linear, F.linear vs the Triton op (M = 1, 8,
    64)."""
    w = torch.randn(shape.n, shape.k, device="cuda").to(DT)
    for m in (1, 8, 64):
        x = torch.randn(m, shape.k, device="cuda").to(DT)
        row = []
        for name, fn in (
            ("F.linear", lambda x=x: F.linear(x, w)),
            ("triton", lambda x=x: linear_small_m(x, w)),
        ):
            _, host = eager_us(lambda i, fn=fn: fn(), calls, warmup=20)
            row.append(f"{name} {host:6.1f}")
        print(f"# eager host us per call, {shape.n}x{shape.k} M={m:2d}: " + ", ".join(row))


def _on_sigterm(signum, frame) -> None:
    raise KeyboardInterrupt("SIGTERM")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--presets", nargs="+", default=list(LINEARS), choices=list(LINEARS))
    ap.add_argument("--m", nargs="+", type=int, default=MS)
    ap.add_argument("--lm-head", action="store_true", help="the presets' LM heads instead")
    ap.add_argument("--sweep", choices=("full", "quick", "none"), default="full")
    ap.add_argument("--configs", nargs="*", default=[], help="extra Triton configs (tags)")
    ap.add_argument("--min-copies", type=int, default=4)
    ap.add_argument("--min-mb", type=float, default=200.0)
    ap.add_argument("--replays", type=int, default=15)
    ap.add_argument("--budget-s", type=float, default=360.0, help="stop sweeping after this")
    ap.add_argument("--hard-extra-s", type=float, default=40.0, help="past budget: no rows")
    ap.add_argument("--phase2-reserve-s", type=float, default=30.0)
    ap.add_argument("--min-gain", type=float, default=0.03)
    ap.add_argument("--json-out", default="")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: bench_gemm needs CUDA", file=sys.stderr)
        return 2
    if any(m < 1 or m > 64 for m in a.m):
        print("error: --m values must be in [1, 64]", file=sys.stderr)
        return 2
    try:
        for t in a.configs:
            parse_tag(t)
    except (ValueError, KeyError, IndexError) as e:
        print(f"error: bad --configs tag: {e}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _on_sigterm)  # a `timeout` kill still prints the summary
    start = time.monotonic()
    bw = measure_copy_bandwidth(torch.device("cuda"))
    assert bw is not None
    print(
        f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; copy bandwidth "
        f"{bw / 1e9:.0f} GB/s; bf16; µs per call in CUDA graphs, median of {a.replays} "
        f"replays; sweep {a.sweep}, budget {a.budget_s:.0f} s"
    )
    runner = Runner(a, start + a.budget_s)
    shapes = shapes_of(a.presets, a.lm_head)
    probs = {}
    try:
        for sh in shapes:
            probs[sh] = Problem(sh, bw, a.min_copies, a.min_mb)
            p = probs[sh]
            print(
                f"# {sh.name} {sh.n}x{sh.k}: {p.copies} weight copies x {p.rounds} passes per "
                f"replay; users {', '.join(u[0] for u in sh.users)}"
            )
        print(HEADER)
        for m in a.m:  # M outer: every shape's M = 1 first
            for sh in shapes:
                if time.monotonic() > start + a.budget_s + a.hard_extra_s:
                    print(f"| {sh.name} {sh.n}x{sh.k} | {m} | budget spent: not measured |")
                    continue
                runner.run(probs[sh], m)
    finally:
        for p in probs.values():
            p.close()
        summary(runner.rows, a.min_gain)
        try:
            host_us()
        except Exception as e:  # noqa: BLE001 - the tables above matter more
            print(f"# eager host timing failed: {e}")
        if a.json_out:
            with open(a.json_out, "w") as f:
                json.dump(dict(bw=bw, rows=runner.rows), f, indent=1)
        print(f"# {time.monotonic() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
