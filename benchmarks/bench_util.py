"""Timing helpers shared by the benchmarks (CUDA only): CUDA-graph device time, eager time per
call (host + device and host only), and the device-copy bandwidth behind every floor.

`python benchmarks/bench_util.py` prints the copy bandwidth (the `info` target of gpu_run.sh).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

SHAPES = {  # per-layer shapes of bench_layers / bench_eager: hidden, intermediate, q/kv heads, d
    "llama3-8b": (4096, 14336, 32, 8, 128),
    "qwen3-8b": (4096, 12288, 32, 8, 128),
}


def graph_time_us(
    fn: Callable[[int], object], reps: int, replays: int = 20, warmup: int | None = 3
) -> float:
    """Median device µs per fn(i) call: fn(0..reps-1) captured in one CUDA graph, replayed
    `replays` times after 3 untimed replays.

    warmup: eager calls fn(0..warmup-1) on a side stream before capture (compiles, plans);
    None: every one of the `reps` calls (where each i is a different problem to compile).
    """
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(reps if warmup is None else warmup):
            fn(i)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(reps):
            fn(i)
    for _ in range(3):
        g.replay()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000 / reps)
    del g
    return statistics.median(times)


def copy_bandwidth() -> float:
    """Device-to-device copy GB/s (read + write bytes) over 1 GiB: the best of memcpy and a
    copy kernel, each timed in a CUDA graph."""
    n = 1 << 28  # 1 GiB of float32
    a = torch.randn(n, device="cuda")
    b = torch.empty_like(a)
    t_memcpy = graph_time_us(lambda i: b.copy_(a), reps=4, replays=10)
    t_kernel = graph_time_us(lambda i: torch.mul(a, 1.0, out=b), reps=4, replays=10)
    return 2 * 4 * n / (min(t_memcpy, t_kernel) * 1e-6) / 1e9


def eager_us(
    fn: Callable[[int], object], n: int, repeats: int = 7, warmup: int = 50
) -> tuple[float, float]:
    """(host + device, host only) µs per eager call: n calls fn(0..n-1) in a host loop, then a
    sync; medians of `repeats` loops after min(n, warmup) warm-up calls."""
    for i in range(min(n, warmup)):
        fn(i)
    loops = [loop_us(fn, n) for _ in range(repeats)]
    return statistics.median(t for t, _ in loops), statistics.median(h for _, h in loops)


def loop_us(fn: Callable[[int], object], n: int) -> tuple[float, float]:
    """(host + device, host only) µs per call of one loop of n calls fn(0..n-1): synchronised
    before, timed to the end of the loop (host) and to the sync after it (total)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(n):
        fn(i)
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return (t2 - t0) / n * 1e6, (t1 - t0) / n * 1e6


if __name__ == "__main__":
    print(f"device copy 1 GiB: {copy_bandwidth():.0f} GB/s (read + write, best of memcpy/kernel)")
