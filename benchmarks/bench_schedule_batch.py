"""Host time of the scheduler's memory paths: ScheduleBatch.prepare_for_decode and free_req.

    python benchmarks/bench_schedule_batch.py                      # cuda if present, else cpu
    python benchmarks/bench_schedule_batch.py --device cpu --batch-size 1 64

The allocator keeps its bookkeeping on the host, so a decode step's slot allocation is host work
plus one host-to-device copy. Each figure is the median wall time of one call (the device is
synchronised before and after the timed loop, never inside it), printed beside two floors: one
`torch.tensor(list, device=...)` of the batch (what a single synchronous upload costs) and one
decode-sized index_put on req_to_token (the one kernel prepare_for_decode must launch).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from srt.managers.schedule_batch import Req, ScheduleBatch  # noqa: E402
from srt.mem_cache.allocator import PagedTokenToKVPoolAllocator  # noqa: E402
from srt.mem_cache.memory_pool import ReqToTokenPool  # noqa: E402
from srt.sampling.sampling_params import SamplingParams  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_us(fn, reps: int, device: torch.device) -> float:
    for _ in range(5):  # warm-up of this shape
        fn()
    _sync(device)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    _sync(device)
    return statistics.median(times) * 1e6


def run(device: torch.device, bs: int, ps: int, prompt: int, steps: int) -> dict[str, float]:
    ctx = prompt + steps + 16
    pages = bs * (-(-ctx // ps) + 1)
    alloc = PagedTokenToKVPoolAllocator(pages * ps, ps, device)
    rows = ReqToTokenPool(bs, ctx, device)
    sb = ScheduleBatch(rows, alloc, None, None, ps, device, True)
    reqs = [Req(i, [1] * prompt, SamplingParams()) for i in range(bs)]
    sb.prepare_for_extend(reqs)
    for r in reqs:
        r.output_ids.append(1)
    decode_us = _median_us(lambda: sb.prepare_for_decode(reqs), steps, device)
    ids = list(range(bs))
    upload_us = _median_us(lambda: torch.tensor(ids, device=device), steps, device)
    r_idx = torch.arange(bs, device=device)
    pos = torch.full((bs,), prompt, device=device)
    val = torch.ones(bs, dtype=torch.int32, device=device)
    scratch = torch.zeros_like(rows.req_to_token)  # the live table keeps the requests' slots

    def put() -> None:
        scratch[r_idx, pos] = val

    put_us = _median_us(put, steps, device)
    times = []
    for r in reqs:
        _sync(device)
        t0 = time.perf_counter()
        sb.free_req(r)
        times.append(time.perf_counter() - t0)
    free_us = statistics.median(times) * 1e6
    assert alloc.available_size() == pages * ps, "leak"
    return dict(decode=decode_us, upload=upload_us, put=put_us, free=free_us)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    default = "cuda" if torch.cuda.is_available() else "cpu"
    p.add_argument("--device", default=default)
    p.add_argument("--batch-size", type=int, nargs="+", default=[1, 8, 64, 256])
    p.add_argument("--page-size", type=int, nargs="+", default=[1, 16])
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=200)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    print(f"device {device}, prompt {args.prompt_len}, median of {args.steps} calls, host us")
    print(
        "| page | batch | prepare_for_decode | floor: 1 upload | floor: 1 index_put |"
        " free_req (median) |"
    )
    print("|---:|---:|---:|---:|---:|---:|")
    for ps in args.page_size:
        for bs in args.batch_size:
            try:
                r = run(device, bs, ps, args.prompt_len, args.steps)
            except Exception as e:  # noqa: BLE001 - report and go on with the next shape
                print(f"| {ps} | {bs} | error: {type(e).__name__}: {e} | | | |")
                continue
            print(
                f"| {ps} | {bs} | {r['decode']:.1f} | {r['upload']:.1f} | {r['put']:.1f} |"
                f" {r['free']:.1f} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
