"""Engine decode step with the overlap schedule on and off (GPU, CUDA graphs), beside the read
floor and the decode graph alone.

    python benchmarks/bench_engine.py                                  # gpt-oss-20b-mxfp4, bs 1 8
    python benchmarks/bench_engine.py --preset llama3-8b --batch-size 1 --json-out e.json
    python benchmarks/bench_engine.py --batch-size 1 --temperature 1.0   # sampled requests

One `srt.Engine` (dummy weights of a preset's shape, TP 1); the overlap schedule is switched on
the same engine between runs, in alternating rounds. Per batch size: a warm-up, then
`generate` of 1 and of 1 + output_len new tokens (ignore_eos; greedy, or sampled with one
seed), best of 2 each; the
decode step = the time difference / output_len: the scheduler's host work (slots, uploads,
window eviction, finish checks) included, as a user of the Engine sees it. Printed beside it:
the step's read floor (weights + KV at mid-decode / measured copy bandwidth) and the decode
graph's replay alone (CUDA events over back-to-back replays: no host work at all). The output
tokens of both schedules are compared.
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
from srt.utils.decode_floor import decode_reads, measure_copy_bandwidth  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="gpt-oss-20b-mxfp4", choices=sorted(PRESETS))
    p.add_argument("--batch-size", type=int, nargs="+", default=[1, 8])
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds of off / on")
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="0: greedy; > 0: sampled on the device (seeded: both schedules draw the same)",
    )
    p.add_argument("--json-out", default=None)
    return p.parse_args(argv)


def _generate(
    engine: srt.Engine, ids: list[list[int]], n: int, temperature: float = 0.0
) -> tuple[float, list]:
    params = {"max_new_tokens": n, "temperature": temperature, "ignore_eos": True}
    if temperature > 0:
        params["sampling_seed"] = 1234
    t = time.perf_counter()
    out = engine.generate(input_ids=ids, sampling_params=params)
    return time.perf_counter() - t, [o["output_ids"] for o in out]


def _replay_ms(engine: srt.Engine, bs: int) -> float:
    """The bucket's decode graph replayed back to back (its last inputs), ms per replay."""
    graph = engine.model_runner.cuda_graph_runner.graphs[bs]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(20):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 20


def bench(args: argparse.Namespace) -> list[dict]:
    max_bs = max(args.batch_size)
    ctx = args.input_len + args.output_len + 16
    engine = srt.Engine(
        device="cuda",
        load_format="dummy",
        skip_tokenizer_init=True,
        json_model_override_args=preset_overrides(args.preset),
        cuda_graph_max_bs=max_bs,
        max_running_requests=max_bs,
        context_length=ctx,
        max_total_tokens=max_bs * ctx,
    )
    sched, runner = engine.scheduler, engine.model_runner
    bandwidth = measure_copy_bandwidth(runner.device)
    g = torch.Generator().manual_seed(0)
    rows = []
    try:
        for bs in args.batch_size:
            ids = torch.randint(10, 30000, (bs, args.input_len), generator=g).tolist()
            temp = args.temperature
            _generate(engine, ids, 8, temp)  # warm-up (allocator, Triton compiles at this shape)
            steps: dict[bool, list[float]] = {False: [], True: []}
            tokens = {}
            for _ in range(args.rounds):
                for overlap in (False, True):
                    sched.overlap = overlap
                    t1 = min(_generate(engine, ids, 1, temp)[0] for _ in range(2))
                    t2, tokens[overlap] = min(
                        (_generate(engine, ids, 1 + args.output_len, temp) for _ in range(2)),
                        key=lambda x: x[0],
                    )
                    steps[overlap].append((t2 - t1) / args.output_len * 1e3)
            sched.overlap = True
            reads = decode_reads(runner, bs, args.input_len + args.output_len // 2)
            floor = reads.total / bandwidth * 1e3 if bandwidth else float("nan")
            row = {
                "preset": args.preset,
                "batch_size": bs,
                "temperature": temp,
                "step_ms_overlap_off": min(steps[False]),
                "step_ms_overlap_on": min(steps[True]),
                "rounds_off": steps[False],
                "rounds_on": steps[True],
                "graph_replay_ms": _replay_ms(engine, runner.cuda_graph_runner.bucket(bs)),
                "floor_ms": floor,
                "tokens_same": tokens[False] == tokens[True],
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        engine.shutdown()
    return rows


def table(rows: list[dict]) -> str:
    out = [
        "| preset | bs | overlap off ms | overlap on ms | on/off | graph alone ms | floor ms"
        " | on/floor | tokens |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        off, on, fl = r["step_ms_overlap_off"], r["step_ms_overlap_on"], r["floor_ms"]
        out.append(
            f"| {r['preset']} | {r['batch_size']} | {off:.3f} | {on:.3f} | {on / off:.2f} | "
            f"{r['graph_replay_ms']:.3f} | {fl:.3f} | {on / fl:.2f}x | "
            f"{'same' if r['tokens_same'] else 'DIFFER'} |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("needs CUDA")
    rows = bench(args)
    print(
        f"\n{args.preset}, input {args.input_len}, output {args.output_len}, "
        f"{'greedy' if args.temperature == 0 else f'sampled at temperature {args.temperature}'}, "
        f"{torch.cuda.get_device_name()}; Engine decode step (best of {args.rounds} rounds)\n"
    )
    print(table(rows))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
