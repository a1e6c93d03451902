"""Where one decode step's time goes: a per-kernel breakdown from the torch profiler.

    python benchmarks/profile_decode.py --model-preset llama3-8b --batch-size 1 --input-len 512

Builds the model the way `srt.bench_one_batch` does (dummy weights of a preset's shape), prefills
`batch-size` random prompts, warms up, then profiles `--steps` decode steps eagerly and as CUDA
graph replays. Prints, per mode, the device time per step grouped by kernel (name, calls per
step, µs per step, share) and the host wall time per step, so a reader can see where each
millisecond goes.
"""

from __future__ import annotations

import argparse
import collections
import time

import torch

from srt.bench_one_batch import build_server_args
from srt.model_executor.model_builder import PRESETS


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-preset", default="llama3-8b", choices=sorted(PRESETS))
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=5, help="decode steps profiled per mode")
    p.add_argument("--top", type=int, default=25, help="kernels listed per mode")
    p.add_argument("--disable-fused-rope-kv", action="store_true")
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument(
        "--host-profile",
        type=int,
        default=0,
        metavar="N",
        help="also run cProfile over the eager steps and list the top N functions by own time "
        "(where the host time of an eager step goes)",
    )
    return p.parse_args(argv)


def _bench_args(a: argparse.Namespace) -> argparse.Namespace:
    """The namespace build_server_args reads (the bench's own defaults otherwise)."""
    return argparse.Namespace(
        model_path=None,
        load_format="dummy",
        model_preset=a.model_preset,
        batch_size=[a.batch_size],
        input_len=a.input_len,
        output_len=6 * a.steps + 16,  # warm-up, timed, profiled (+ host-profiled) steps
        device="cuda",
        dtype="auto",
        kv_cache_dtype=a.kv_cache_dtype,
        page_size=1,
        attention_backend=None,
        disable_cuda_graph=False,
        seed=0,
    )


def _kernel_table(prof: torch.profiler.profile, steps: int, top: int) -> str:
    per = collections.defaultdict(lambda: [0, 0.0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            name = ev.name if len(ev.name) <= 70 else ev.name[:67] + "..."
            per[name][0] += 1
            per[name][1] += ev.device_time_total if hasattr(ev, "device_time_total") else 0.0
    total = sum(v[1] for v in per.values()) / steps
    rows = sorted(per.items(), key=lambda kv: -kv[1][1])
    lines = [f"{'kernel':70s} {'calls/step':>10s} {'us/step':>9s} {'share':>6s}"]
    for name, (n, us) in rows[:top]:
        lines.append(f"{name:70s} {n / steps:10.1f} {us / steps:9.1f} {us / steps / total:6.1%}")
    rest = sum(v[1] for _, v in rows[top:]) / steps
    lines.append(f"{'(other kernels)':70s} {'':10s} {rest:9.1f} {rest / max(total, 1e-9):6.1%}")
    n_launch = sum(v[0] for v in per.values()) / steps
    lines.append(f"{'total device time per step':70s} {n_launch:10.1f} {total:9.1f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    from srt.managers.schedule_batch import Req, ScheduleBatch
    from srt.model_executor.model_runner import ModelRunner
    from srt.sampling.sampling_params import SamplingParams

    runner = ModelRunner(build_server_args(_bench_args(a), not a.disable_fused_rope_kv))
    vocab = int(runner.model_config.vocab_size)
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(max_new_tokens=1 << 20, temperature=0.0, ignore_eos=True)
    prompts = torch.randint(0, vocab, (a.batch_size, a.input_len), generator=g).tolist()
    reqs = [Req(i, p, params) for i, p in enumerate(prompts)]
    sb = ScheduleBatch.from_runner(runner)
    ids = runner.greedy_ids(runner.forward(sb.prepare_for_extend(reqs)))

    def step(use_graph: bool) -> None:
        nonlocal ids
        for r, t in zip(reqs, ids, strict=True):
            r.output_ids.append(t)
        ids = runner.greedy_ids(runner.forward(sb.prepare_for_decode(reqs), use_graph))

    print(
        f"# {a.model_preset} bs={a.batch_size} input={a.input_len} "
        f"fused={not a.disable_fused_rope_kv} kv={runner.kv_dtype} "
        f"device={torch.cuda.get_device_name()}"
    )
    for use_graph in (False, True):
        if use_graph and runner.cuda_graph_runner is None:
            continue
        for _ in range(3):
            step(use_graph)  # warm-up (Triton compiles, graph replays settle)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(a.steps):
            step(use_graph)
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - t0) / a.steps * 1e3
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(a.steps):
                step(use_graph)
            torch.cuda.synchronize()
        mode = "cuda graph" if use_graph else "eager"
        layers = int(runner.model_config.num_hidden_layers)
        print(
            f"\n## {mode}: wall {wall_ms:.3f} ms per step (forward + argmax + host work), "
            f"{wall_ms * 1e3 / layers:.1f} us per decoder layer ({layers} layers)"
        )
        print(_kernel_table(prof, a.steps, a.top))
        if a.host_profile and not use_graph:
            _host_profile(lambda: step(False), a.steps, a.host_profile)


def _host_profile(step, steps: int, top: int) -> None:
    """cProfile of `steps` eager steps: the functions with the most own time, per step."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    prof.disable()
    st = pstats.Stats(prof)
    rows = sorted(st.stats.items(), key=lambda kv: -kv[1][2])  # type: ignore[attr-defined]
    print(f"\n## host profile of the eager step (cProfile; per step; top {top} by own time)")
    print(f"{'function':78s} {'calls':>7s} {'own us':>8s} {'cum us':>8s}")
    for (file, line, name), (_cc, nc, tt, ct, _callers) in rows[:top]:
        where = f"{file.split('/')[-2:][-1] if '/' in file else file}:{line}({name})"
        print(f"{where[:78]:78s} {nc / steps:7.1f} {tt / steps * 1e6:8.1f} {ct / steps * 1e6:8.1f}")


if __name__ == "__main__":
    main()
