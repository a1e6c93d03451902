"""End-to-end decode throughput, fused vs unfused RoPE + KV write, with CUDA graphs (GPU).

    python benchmarks/bench_e2e.py              # both presets, bs 1 8 32 64, 512 in / 128 out
    python benchmarks/bench_e2e.py --preset llama3-8b --json-out llama.json

Dummy-weight models of Llama-3-8B and gpt-oss-20b shape (see srt/model_executor/model_builder.py).
"Unfused" is the RoPE op followed by the pool's set_kv_buffer (V on the alternate stream inside the
graphs); "fused" writes K and V from the RoPE kernel. Each preset runs both variants on the same
weights through `srt.bench_one_batch` and prints a markdown table of decode tokens/s.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from srt import bench_one_batch  # noqa: E402
from srt.model_executor.model_builder import PRESETS  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--preset", nargs="+", default=["llama3-8b", "gpt-oss-20b"], choices=sorted(PRESETS)
    )
    p.add_argument("--batch-size", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--page-size", type=int, default=1)
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--disable-cuda-graph", action="store_true")
    p.add_argument("--json-out", default=None)
    return p.parse_args(argv)


def table(results: list[dict]) -> str:
    rows = [
        "| model | batch | unfused tok/s | fused tok/s | fused gain | unfused step ms |"
        " fused step ms | tokens match |",
        "|---|---:|---:|---:|---:|---:|---:|:---:|",
    ]
    keyed = {(r["model"], r["variant"], r["batch_size"]): r for r in results}
    for model, variant, bs in sorted(keyed, key=lambda k: (k[0], k[2])):
        if variant != "fused" or (model, "unfused", bs) not in keyed:
            continue
        f, u = keyed[(model, "fused", bs)], keyed[(model, "unfused", bs)]
        gain = f["decode_tokens_per_s"] / u["decode_tokens_per_s"] - 1
        rows.append(
            f"| {model} | {bs} | {u['decode_tokens_per_s']:.1f} | {f['decode_tokens_per_s']:.1f}"
            f" | {gain * 100:+.1f}% | {u['decode_step_latency_s'] * 1e3:.3f}"
            f" | {f['decode_step_latency_s'] * 1e3:.3f}"
            f" | {'yes' if f['output_ids'] == u['output_ids'] else 'NO'} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    results: list[dict] = []
    for preset in args.preset:
        flags = [
            "--model-preset",
            preset,
            "--batch-size",
            *map(str, args.batch_size),
            "--input-len",
            str(args.input_len),
            "--output-len",
            str(args.output_len),
            "--page-size",
            str(args.page_size),
            "--kv-cache-dtype",
            args.kv_cache_dtype,
            "--device",
            "cuda",
            "--no-eager",
        ]
        if args.disable_cuda_graph:
            flags.append("--disable-cuda-graph")
        print(f"## {preset}", flush=True)
        results += bench_one_batch.main(flags)
    md = table(results)
    print("\n" + md)
    if args.json_out:
        slim = [{k: v for k, v in r.items() if k != "output_ids"} for r in results]
        Path(args.json_out).write_text(
            json.dumps({"args": vars(args), "results": slim, "markdown": md}, indent=1)
        )
    return results


if __name__ == "__main__":
    main()
