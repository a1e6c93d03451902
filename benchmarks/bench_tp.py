"""Decode throughput at TP 1 and TP 2 (GPU, NCCL, CUDA graphs), dummy-weight preset models.

    python benchmarks/bench_tp.py                        # llama3-8b, TP 1 and 2, bs 1 8 32
    python benchmarks/bench_tp.py --preset gpt-oss-20b --tp 1 2 --json-out tp.json

Each TP size runs through `srt.Engine(..., tp_size=N)` (one spawned process per rank; NVLink
multicast off). Per batch size: a warm-up, then `generate` with 1 new token (prefill) and with
1 + output_len new tokens (ignore_eos), same prompts, best of 2 each; decode tokens/s =
bs * output_len / the time difference. Engine-level numbers: they include the scheduler's
host work per step.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import srt  # noqa: E402
from srt.model_executor.model_builder import PRESETS, preset_overrides  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="llama3-8b", choices=sorted(PRESETS))
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    p.add_argument("--batch-size", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--disable-cuda-graph", action="store_true")
    p.add_argument("--json-out", default=None)
    return p.parse_args(argv)


def _timed(engine: srt.Engine, ids: list[list[int]], new_tokens: int) -> float:
    params = {"max_new_tokens": new_tokens, "temperature": 0.0, "ignore_eos": True}
    t = time.perf_counter()
    engine.generate(input_ids=ids, sampling_params=params)
    return time.perf_counter() - t


def bench_tp(args: argparse.Namespace, tp: int) -> list[dict]:
    max_bs = max(args.batch_size)
    ctx = args.input_len + args.output_len + 16
    engine = srt.Engine(
        device="cuda",
        load_format="dummy",
        tp_size=tp,
        skip_tokenizer_init=True,
        json_model_override_args=preset_overrides(args.preset),
        cuda_graph=not args.disable_cuda_graph,
        cuda_graph_max_bs=max_bs,
        max_running_requests=max_bs,
        context_length=ctx,
        max_total_tokens=max_bs * ctx,
    )
    g = torch.Generator().manual_seed(0)
    rows = []
    try:
        for bs in args.batch_size:
            ids = torch.randint(10, 30000, (bs, args.input_len), generator=g).tolist()
            _timed(engine, ids, 8)  # warm-up (allocator, Triton compiles at this shape)
            t_prefill = min(_timed(engine, ids, 1) for _ in range(2))
            t_full = min(_timed(engine, ids, 1 + args.output_len) for _ in range(2))
            decode_s = max(t_full - t_prefill, 1e-9)
            rows.append(
                {
                    "preset": args.preset,
                    "tp": tp,
                    "batch_size": bs,
                    "decode_tokens_per_s": bs * args.output_len / decode_s,
                    "decode_step_ms": decode_s / args.output_len * 1e3,
                    "prefill_s": t_prefill,
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    finally:
        engine.shutdown()
    return rows


def table(rows: list[dict]) -> str:
    tps = sorted({r["tp"] for r in rows})
    by = {(r["tp"], r["batch_size"]): r for r in rows}
    head = "| batch | " + " | ".join(f"TP {t} tok/s | TP {t} step ms" for t in tps)
    out = [head + " | speed-up |", "|" + "---:|" * (2 * len(tps) + 2)]
    for bs in sorted({r["batch_size"] for r in rows}):
        cells = [
            f"{by[t, bs]['decode_tokens_per_s']:.1f} | {by[t, bs]['decode_step_ms']:.2f}"
            if (t, bs) in by
            else "- | -"
            for t in tps
        ]
        base, last = by.get((tps[0], bs)), by.get((tps[-1], bs))
        gain = (
            f"{last['decode_tokens_per_s'] / base['decode_tokens_per_s']:.2f}x"
            if base and last
            else "-"
        )
        out.append(f"| {bs} | " + " | ".join(cells) + f" | {gain} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.device_count() < max(args.tp):
        sys.exit(f"needs {max(args.tp)} CUDA devices")
    rows = [r for tp in args.tp for r in bench_tp(args, tp)]
    print(
        f"\n{args.preset}, input {args.input_len}, output {args.output_len}, "
        f"{torch.cuda.get_device_name()}, decode tokens/s\n"
    )
    print(table(rows))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
