"""Benchmark of q/k RMSNorm + RoPE + KV write in one kernel (issue 17) on Qwen3 shapes.

Columns (µs per call inside CUDA graphs, median over replays; every shape warmed up first):
  fused    ours: apply_qk_norm_rope_with_cos_sin_cache_inplace with the KV write (one kernel)
  rope_kv  ours: the RoPE + KV op alone on the same inputs (no norm). Goal: fused <= 1.05x
  sep      Qwen3's previous path: torch q/k RMSNorm (srt RMSNorm on [T*H, D] copies) + our
           RoPE + KV op. Goal: fused <= 0.6x at T <= 512
  sg_2k    SGLang's two kernels: qknorm.cuh (in place) + rope.cuh RoPE + K/V store; checked
           against ours first (skipped with the reason if it differs or cannot be built)
  sg_qkr   SGLang's fused_qknorm_rope alone (norm + RoPE, NO cache write; cos/sin computed
           from the base; contiguous qkv, int32 positions): a lower bound of its one-kernel part
  floor    bytes the fused op must move / device-copy bandwidth measured in this run

Peers are built by benchmarks/peers.py from the SGLang wheel (SGL_BENCH_SGLANG_DIR, tvm_ffi on
PYTHONPATH; prebuilt by prepare_peers.sh into SGL_EXT_CACHE_DIR).

Usage: python benchmarks/bench_qk_norm_rope.py [--tokens 1 8 ...] [--shapes qwen3-8b qwen3-32b]
           [--kv-dtype bf16|fp8_e4m3] [--no-peers] [--json-out F]
           [--fused-configs "block_h=4,num_warps=4,order=2d,load=pre_wait" ...]  (tuning columns)
The launch-layout sweep of the q/k-norm op is benchmarks/tune_qk_norm.py.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench_rope_kv, peers

import bench_rope_kv as brk  # noqa: E402  (benchmarks/)

import sgl_ext  # noqa: E402
from sgl_ext import FusedSetKVBufferArg, settings  # noqa: E402
from srt.layers.layernorm import RMSNorm  # noqa: E402

SHAPES = {"qwen3-8b": (32, 8, 128), "qwen3-32b": (64, 8, 128)}  # (Hq, Hkv, D)
TOKENS = [1, 8, 32, 128, 512, 2048, 8192, 32768]
EPS = 1e-6
ROPE_THETA = 1e6  # Qwen3
COLUMNS = ["fused", "rope_kv", "sep", "sg_2k", "sg_qkr", "floor"]


class NormCase(brk.Case):
    """bench_rope_kv's input sets (rotated across graph calls) plus bf16 norm weights."""

    def __init__(self, shape: str, t: int, kv_dtype: torch.dtype) -> None:
        brk.SHAPES.setdefault(shape, SHAPES[shape])
        super().__init__(shape, t, kv_dtype, 1.0, True)
        self.qw = (torch.randn(self.d, device="cuda") * 0.3 + 1).bfloat16()
        self.kw = (torch.randn(self.d, device="cuda") * 0.3 + 1).bfloat16()
        self.q_norm = RMSNorm(self.d, EPS, weight_in_fp32=False).cuda().bfloat16()
        self.k_norm = RMSNorm(self.d, EPS, weight_in_fp32=False).cuda().bfloat16()
        self.q_norm.weight.data.copy_(self.qw)
        self.k_norm.weight.data.copy_(self.kw)

    def qk_fused(self, i: int) -> None:
        pos, q, k, v, loc = self.split(i)
        arg = FusedSetKVBufferArg(v, self.kb, self.vb, self.k_scale, self.k_scale, loc)
        sgl_ext.apply_qk_norm_rope_with_cos_sin_cache_inplace(
            pos, q, k, self.d, self.cs, self.qw, self.kw, EPS, True, arg
        )

    def separate(self, i: int) -> None:
        """Torch q/k norm as Qwen3's layer did it, then our fused RoPE + KV op."""
        pos, q, k, v, loc = self.split(i)
        t = q.shape[0]
        q = self.q_norm(q.reshape(-1, self.d)).view(t, -1)  # [T * Hq, D] copy -> [T, Hq*D]
        k = self.k_norm(k.reshape(-1, self.d)).view(t, -1)
        arg = FusedSetKVBufferArg(v, self.kb, self.vb, self.k_scale, self.k_scale, loc)
        sgl_ext.apply_rope_with_cos_sin_cache_inplace(pos, q, k, self.d, self.cs, True, arg)


def _reference(qkv, pos, cs, qw, kw, hq, hkv, d, rows):
    """Float64 q/k RMSNorm + neox RoPE of the first `rows` tokens of qkv [T, (Hq+2Hkv)*D]:
    (q [rows, Hq, D], k [rows, Hkv, D]) f64, cos/sin rows cs[pos] (first half cos)."""
    x = qkv[:rows].double()
    q = x[:, : hq * d].reshape(rows, hq, d)  # [rows, Hq, D]
    k = x[:, hq * d : (hq + hkv) * d].reshape(rows, hkv, d)  # [rows, Hkv, D]
    cos, sin = cs[pos[:rows].long()].double().chunk(2, dim=-1)  # [rows, D/2] each
    cos, sin = cos[:, None], sin[:, None]  # [rows, 1, D/2]

    def norm_rope(h, w):
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS) * w.double()
        a, b = h.chunk(2, dim=-1)  # neox halves [rows, H, D/2]
        return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)

    return norm_rope(q, qw), norm_rope(k, kw)


def _err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """max |x - ref| / rms(ref): rounding shows as a few 2^-8 of the largest values; a wrong
    calling convention (head layout, pairing, positions, weights) as O(1). NaN (unwritten) ->
    inf."""
    e = ((x.double() - ref).abs().max() / ref.pow(2).mean().sqrt()).item()
    return float("inf") if e != e else e


def _check_peer(name: str, theirs: dict, ours: dict, refs: dict) -> None:
    """Each tensor of the peer within max(3x our error, 0.03) of the float64 reference (V
    copies: bit-equal); prints both errors; raises PeerUnavailable on a mismatch."""
    import peers

    errs = {}
    for key, ref in refs.items():
        if ref is None:  # an exact copy
            ok = torch.equal(theirs[key].view(torch.int16), ours[key].view(torch.int16))
            errs[key] = (0.0 if ok else float("inf"), 0.0)
        else:
            errs[key] = (_err(theirs[key], ref), _err(ours[key], ref))
    text = ", ".join(f"{k} {t:.4f} (ours {o:.4f})" for k, (t, o) in errs.items())
    print(f"#   {name} check vs float64, max err / rms: {text}", flush=True)
    bad = [k for k, (t, o) in errs.items() if not t <= max(3 * o, 0.03)]
    if bad:
        raise peers.PeerUnavailable(f"differs from the float64 reference in {bad}: {text}")


CHECK_ROWS = 256  # tokens compared against the float64 reference (the convention is per token)


def sglang_two_kernels(c: NormCase):
    """SGLang's qknorm.cuh + rope.cuh (RoPE + K/V store) as a timed fn(i), checked first on
    set 0 (poisoned caches): q, k and the K cache against the float64 reference, as close as
    ours; V copied exactly. Raises PeerUnavailable with the reason."""
    import peers

    if c.kb.dtype != torch.bfloat16:
        raise peers.PeerUnavailable("SGLang's rope.cuh store is benchmarked with a bf16 cache")
    qknorm = peers.sglang_qknorm(c.d, torch.bfloat16)
    rope_kv = peers.sglang_fused(True, c.d, torch.bfloat16)
    kc, vc = c.kb.view(c.kb.shape[0], -1), c.vb.view(c.vb.shape[0], -1)  # [slots, Hkv * D]

    def call(i: int) -> None:
        pos, q, k, v, loc = c.split(i)
        t = q.shape[0]
        # [T, H, D] views of the strided q/k/v slices of qkv (token stride (Hq + 2 Hkv) * D)
        q3, k3, v3 = q.view(t, -1, c.d), k.view(t, -1, c.d), v.view(t, -1, c.d)
        qknorm(q3, k3, c.qw, c.kw, EPS)
        rope_kv(pos, q3, k3, v3, c.cs, kc, vc, loc)

    qkv0 = c.sets[0][0].clone()
    rows = min(c.t, CHECK_ROWS)
    outs = []
    for fn in (c.qk_fused, call):
        c.sets[0][0].copy_(qkv0)
        c.kb.fill_(float("nan"))
        c.vb.fill_(float("nan"))
        fn(0)
        pos, q, k, v, loc = c.split(0)
        r = loc[:rows]
        outs.append(
            dict(
                q=q[:rows].reshape(rows, c.hq, c.d).clone(),
                k=k[:rows].reshape(rows, c.hkv, c.d).clone(),
                k_cache=c.kb[r].clone(),
                v_cache=c.vb[r].clone(),
            )
        )
    c.sets[0][0].copy_(qkv0)
    pos = c.sets[0][1]
    rq, rk = _reference(qkv0, pos, c.cs, c.qw, c.kw, c.hq, c.hkv, c.d, rows)
    v0 = qkv0[:rows, (c.hq + c.hkv) * c.d :].reshape(rows, c.hkv, c.d)
    refs = dict(q=rq, k=rk, k_cache=rk, v_cache=None)
    ours = {**outs[0], "v_cache": v0}  # V: the peer's copy must equal the input exactly
    _check_peer("sg_2k", outs[1], ours, refs)
    if not torch.equal(outs[0]["v_cache"].view(torch.int16), v0.view(torch.int16)):
        print("#   sg_2k check: OUR V cache differs from the input", flush=True)
    return call


def sglang_qknorm_rope(c: NormCase):
    """SGLang's fused_qknorm_rope (no cache write) as a timed fn(i), checked first against the
    float64 reference (as close as our op without the KV write), with a true cos/sin table of
    the same base (the kernel computes its own angles: int32 positions below 4096)."""
    import peers

    fn = peers.sglang_qknorm_rope(c.d, True, ROPE_THETA, c.hq, c.hkv)
    pos32 = [p.clamp(max=4095).int() for _, p, _ in c.sets]  # [T] int32 per set
    inv = 1.0 / ROPE_THETA ** (torch.arange(0, c.d, 2, dtype=torch.float64, device="cuda") / c.d)
    ang = torch.arange(4096, dtype=torch.float64, device="cuda")[:, None] * inv  # [4096, D/2]
    cs = torch.cat((ang.cos(), ang.sin()), dim=-1).float()  # [4096, D]
    qkv0 = c.sets[0][0].clone()
    rows = min(c.t, CHECK_ROWS)
    ours = qkv0.clone()
    q, k, _ = ours.split([c.hq * c.d, c.hkv * c.d, c.hkv * c.d], dim=-1)
    sgl_ext.apply_qk_norm_rope_with_cos_sin_cache_inplace(
        pos32[0], q, k, c.d, cs, c.qw, c.kw, EPS, True
    )
    theirs = qkv0.clone()
    fn(theirs, c.qw, c.kw, pos32[0], EPS)

    def parts(x):
        x = x[:rows]
        return dict(
            q=x[:, : c.hq * c.d].reshape(rows, c.hq, c.d),
            k=x[:, c.hq * c.d : (c.hq + c.hkv) * c.d].reshape(rows, c.hkv, c.d),
            v=x[:, (c.hq + c.hkv) * c.d :],
        )

    rq, rk = _reference(qkv0, pos32[0], cs, c.qw, c.kw, c.hq, c.hkv, c.d, rows)
    ours_p = {**parts(ours), "v": parts(qkv0)["v"]}
    _check_peer("sg_qkr", parts(theirs), ours_p, dict(q=rq, k=rk, v=None))
    return lambda i: fn(c.sets[i % c.nsets][0], c.qw, c.kw, pos32[i % c.nsets], EPS)


def run(args) -> tuple[list[dict], float, float]:
    kv_dtype = brk.KV_DTYPES[args.kv_dtype]
    bw = brk.copy_bandwidth()
    empty = brk.empty_kernel_us()
    print(
        f"# device {torch.cuda.get_device_name()}, copy bandwidth {bw:.0f} GB/s (read+write), "
        f"empty kernel in graph {empty:.2f} µs, kv {args.kv_dtype}",
        flush=True,
    )
    rows = []
    for shape in args.shapes:
        for t in args.tokens:
            c = NormCase(shape, t, kv_dtype)
            reps = max(4, min(200, int(2e5 / max(1.0, c.bytes / 3e3))))
            r = {"shape": shape, "T": t, "bytes": c.bytes}
            # Rounds alternate the two ops, each a fresh graph; the least of each is kept. At
            # small T a graph's time is bimodal (one capture runs ~0.13-0.2 µs slower than the
            # next, whichever op, on the H100), so one capture per op can put the ratio
            # either side of the goal.
            fused, rope = [], []
            for _ in range(args.rounds):
                fused.append(brk.graph_time_us(c.qk_fused, reps))  # warms up (compiles) first
                rope.append(brk.graph_time_us(c.fused, reps))
            r["fused"], r["rope_kv"] = min(fused), min(rope)
            r["fused_rounds"], r["rope_kv_rounds"] = fused, rope
            r["sep"] = brk.graph_time_us(c.separate, reps)
            r["floor"] = c.bytes / (bw * 1e9) * 1e6
            for cfg in args.fused_configs:  # a settings change drops the cached launch plans
                os.environ["SGL_EXT_TRITON_CONFIG"] = cfg
                settings.reload()
                try:
                    r[f"fused@{cfg}"] = brk.graph_time_us(c.qk_fused, reps)
                    r[f"rope_kv@{cfg}"] = brk.graph_time_us(c.fused, reps)
                finally:
                    os.environ.pop("SGL_EXT_TRITON_CONFIG")
                    settings.reload()
            if not args.no_peers:
                for name, make in (("sg_2k", sglang_two_kernels), ("sg_qkr", sglang_qknorm_rope)):
                    try:
                        r[name] = brk.graph_time_us(make(c), reps)
                    except Exception as err:  # noqa: BLE001  (a peer must not stop the table)
                        msg = str(err).splitlines()[-1][:200] if str(err) else type(err).__name__
                        print(f"# {shape} T={t}: {name} skipped: {msg}", flush=True)
            r["fused/rope_kv"] = r["fused"] / r["rope_kv"]
            r["fused/sep"] = r["fused"] / r["sep"]
            rows.append(r)
            print(
                json.dumps({k: _rounded(v) for k, v in r.items()}),
                flush=True,
            )
            del c
            torch.cuda.empty_cache()
    return rows, bw, empty


def _rounded(v):
    """Floats (and lists of them) to 3 decimals for the JSON lines."""
    if isinstance(v, list):
        return [_rounded(x) for x in v]
    return round(v, 3) if isinstance(v, float) else v


def table(rows: list[dict], bw: float, empty: float, args) -> str:
    cols = [c for c in COLUMNS if any(c in r for r in rows)]
    cols += [k for k in rows[0] if "@" in k] if rows else []
    head = (
        f"device: {torch.cuda.get_device_name()}; copy bw {bw:.0f} GB/s; empty kernel "
        f"{empty:.2f} µs; kv {args.kv_dtype}; neox, full rotary; µs per call in CUDA graph "
        f"(median; fused and rope_kv: the least of {args.rounds} alternating rounds). Goals: "
        "fused/rope_kv <= 1.05 at every T; fused/sep <= 0.6 at T <= 512"
    )
    out = [head, ""]
    out.append("| shape | T | " + " | ".join(cols) + " | fused/rope_kv | fused/sep | fused/sg_2k |")
    out.append("|" + "---|" * (len(cols) + 5))
    for r in rows:
        vals = [f"{r[c]:.2f}" if c in r else "-" for c in cols]
        g1 = "ok" if r["fused/rope_kv"] <= 1.05 else "MISS"
        g2 = "ok" if r["fused/sep"] <= 0.6 else ("MISS" if r["T"] <= 512 else "")
        sg = f"{r['fused'] / r['sg_2k']:.2f}" if "sg_2k" in r else "-"
        out.append(
            f"| {r['shape']} | {r['T']} | "
            + " | ".join(vals)
            + f" | {r['fused/rope_kv']:.3f} {g1} | {r['fused/sep']:.2f} {g2} | {sg} |"
        )
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=TOKENS)
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=SHAPES)
    p.add_argument("--kv-dtype", default="bf16", choices=brk.KV_DTYPES)
    p.add_argument("--no-peers", action="store_true", help="skip the SGLang columns")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds of fused / rope_kv")
    p.add_argument(
        "--fused-configs",
        nargs="*",
        default=[],
        help="also time fused and rope_kv with SGL_EXT_TRITON_CONFIG set to each (tuning)",
    )
    p.add_argument("--json-out")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("error: bench_qk_norm_rope needs a CUDA GPU", file=sys.stderr)
        sys.exit(2)
    t0 = time.time()
    rows, bw, empty = run(args)
    print(table(rows, bw, empty, args))
    print(f"# {time.time() - t0:.0f} s")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"rows": rows, "copy_bw": bw, "empty_us": empty, "args": vars(args)}, f)


if __name__ == "__main__":
    main()
