"""GPU check of the alternate-stream K/V write under CUDA-graph capture (script and test helper).

One captured graph: produce K and V on the current stream, `pool.set_kv_buffer` (K on the
current stream, V on `alt_stream`), then read the written slots back on the current stream.
Replayed with new slots, inputs and fp8 scales each time; any stale read is a mismatch.

Run under the sanitizers (exits 1 on any mismatch):

    compute-sanitizer --tool racecheck python -m tests.srt.mem_cache.gpu_stream_check
    compute-sanitizer --tool memcheck python -m tests.srt.mem_cache.gpu_stream_check --replays 50
"""

from __future__ import annotations

import argparse
import sys
from types import SimpleNamespace

import torch

from srt.mem_cache.memory_pool import MHATokenToKVPool

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _rows(buf: torch.Tensor, loc: torch.Tensor, page_size: int) -> torch.Tensor:
    return buf[loc] if buf.ndim == 3 else buf[loc // page_size, loc % page_size]  # [T, H, D]


def _stored(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None) -> torch.Tensor:
    if dtype not in FP8:
        return x
    m = torch.finfo(dtype).max
    inv = 1.0 / scale.reshape(()).float()  # stored = saturate(x * (1 / scale))
    return (x.float() * inv).clamp(-m, m).to(dtype)


def run_check(
    page_size: int = 1,
    replays: int = 1000,
    dtype: torch.dtype = torch.bfloat16,
    num_tokens: int = 7,
    heads: int = 4,
    head_dim: int = 64,
    size: int = 512,
    cross_layer_layout: bool = False,
) -> int:
    """Return the number of replays whose read-back differed from what was written."""
    dev = torch.device("cuda")
    fp8 = dtype in FP8
    in_dtype = torch.bfloat16 if fp8 else dtype
    alt = torch.cuda.Stream()
    pool = MHATokenToKVPool(
        size,
        page_size,
        dtype,
        heads,
        head_dim,
        2,
        dev,
        alt_stream=alt,
        cross_layer_layout=cross_layer_layout,
    )
    pool.set_stream_overlap(True)
    layer = SimpleNamespace(layer_id=1)
    T = num_tokens
    loc = torch.zeros(T, dtype=torch.int64, device=dev)
    k_src = torch.zeros(T, heads, head_dim, dtype=in_dtype, device=dev)
    v_src = torch.zeros_like(k_src)
    k_scale = torch.ones(1, device=dev) if fp8 else None
    v_scale = torch.ones(1, device=dev) if fp8 else None
    out_k = torch.zeros(T, heads, head_dim, dtype=dtype, device=dev)
    out_v = torch.zeros_like(out_k)

    def step() -> None:
        k = k_src * 1.5  # produced inside the graph on the current stream
        v = v_src * -2.0
        pool.set_kv_buffer(layer, loc, k, v, k_scale, v_scale)
        kb, vb = pool.get_kv_buffer(1)
        out_k.copy_(_rows(kb, loc, page_size))  # readers on the current stream
        out_v.copy_(_rows(vb, loc, page_size))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    bad = torch.zeros((), dtype=torch.int64, device=dev)
    for _ in range(replays):
        loc.copy_(torch.randperm(size, device=dev)[:T] + page_size)  # never the padding page
        k_src.normal_()
        v_src.normal_()
        if fp8:
            k_scale.uniform_(0.05, 2.0)
            v_scale.uniform_(0.05, 2.0)
        graph.replay()
        want_k = _stored(k_src * 1.5, dtype, k_scale)
        want_v = _stored(v_src * -2.0, dtype, v_scale)
        bad += (out_k.view(torch.uint8) != want_k.view(torch.uint8)).any()
        bad += (out_v.view(torch.uint8) != want_v.view(torch.uint8)).any()
    torch.cuda.synchronize()
    return int(bad)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replays", type=int, default=1000)
    args = ap.parse_args()
    failures = 0
    for ps, dt, cross in [
        (1, torch.bfloat16, False),
        (16, torch.bfloat16, False),
        (16, torch.float8_e4m3fn, True),
        (1, torch.float16, True),
    ]:
        bad = run_check(page_size=ps, replays=args.replays, dtype=dt, cross_layer_layout=cross)
        print(f"page_size={ps} dtype={dt} cross_layer={cross}: {bad} bad replays")
        failures += bad
    print("OK" if failures == 0 else "MISMATCH")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
