"""What each module or kernel of a decode step costs where it sits: launch it twice, or leave it
out, re-capture the decode graph and time the step.

    python benchmarks/bench_graph_ablation.py --model-preset gpt-oss-20b-mxfp4 --batch-size 1 \
        --variants base dup:module:input_layernorm skip:module:post_attention_layernorm \
        dup:kernel:moe_gemv_f16_gate_up_kernel skip:kernel:_topk_softmax_kernel
    python benchmarks/bench_graph_ablation.py --replays 40 --rounds 8 --variants base ...

The model is built once the way `srt.bench_one_batch` builds it (a preset's shape, dummy
weights). Per round and variant the patches are applied, the CUDA-graph runner re-captures every
batch-size bucket, and `run_batch` (warm-up, then `--output-len` decode steps) gives the median
step; patches come off before the next variant. Rounds alternate the variants; the table keeps
each variant's least step and its difference to `base` (also per decoder layer).

A variant is `base` or actions joined by `+`, each `<dup|skip>:<module|kernel>:<name>`:
  module:<suffix>  every submodule whose qualified name ends with it (`input_layernorm`,
                   `self_attn.qkv_proj`, `mlp.router`, `self_attn.attn`, `mlp.experts`, ...)
  kernel:<name>    every launch of the Triton kernel of that name through sgl_ext's launchers
                   (`rope_kv_kernel`, `_skinny_gemm_kernel`, `moe_gemv_f16_down_kernel`, ...)
  dup   runs it twice: its marginal cost on the step's critical path (a weight-reading kernel
        run twice may find part of its weights in L2 the second time: a lower bound for those)
  skip  a module returns its first call's output for those argument shapes (no kernels after
        the warm-up); a kernel is not launched: what removing it could save at most
Skipped work leaves stale data, so the tokens of a variant mean nothing: timing only. The C fast
path of eager calls is off while it runs (SGL_EXT_FAST_LAUNCH=0): every launch meets the patches.
On the CPU (no graphs) the steps are eager: a check of the patches, not a measurement.

--replays N (CUDA): a finer measure of the device time alone. One decode step of `run_batch`
fills the graph runner's static inputs; then every variant's decode graph is captured once into
that runner (same inputs, same memory pool: no re-capture, no process-to-process placement), and
each round replays every variant N times back to back between two CUDA events. The table gives
each variant's median ms per replay (no host work; 0.05% between rounds on the H100, against
1-3% for the steps of separate captures or processes).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import statistics
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sgl_ext import settings  # noqa: E402
from sgl_ext.triton import launcher as L  # noqa: E402

ACTIONS = ("dup", "skip")
KINDS = ("module", "kernel")


@dataclass(frozen=True)
class Action:
    """One patch of a variant: dup or skip a module (by name suffix) or a kernel (by name)."""

    what: str  # "dup" | "skip"
    kind: str  # "module" | "kernel"
    name: str

    @classmethod
    def parse(cls, text: str) -> Action:
        parts = text.split(":", 2)
        if len(parts) != 3 or parts[0] not in ACTIONS or parts[1] not in KINDS or not parts[2]:
            raise ValueError(f"variant action {text!r}: expected <dup|skip>:<module|kernel>:<name>")
        return cls(*parts)


def parse_variant(text: str) -> tuple[Action, ...]:
    """'base' -> (); otherwise the '+'-joined actions."""
    if text == "base":
        return ()
    return tuple(Action.parse(t) for t in text.split("+"))


def _kernel_name(fn: Any) -> str:
    inner = getattr(fn, "fn", fn)  # a JITFunction wraps the Python function
    return getattr(inner, "__name__", "")


def _times(kernels: dict[str, str], fn: Any) -> int:
    """How many times a launch of fn runs under the kernel actions (1: untouched)."""
    what = kernels.get(_kernel_name(fn))
    return 1 if what is None else (2 if what == "dup" else 0)


@contextlib.contextmanager
def _patched_kernels(kernels: dict[str, str]) -> Iterator[None]:
    """Every launch through KernelLauncher (JIT or direct) and CachedLauncher repeated per the
    actions (kernel name -> 'dup' / 'skip')."""
    if not kernels:
        yield
        return
    saved = (L.KernelLauncher.launch_jit, L.KernelLauncher.run_ptrs, L.CachedLauncher.run)

    def launch_jit(self: Any, *tensors: object) -> Any:
        kernel = None
        for _ in range(_times(kernels, self.fn)):
            kernel = saved[0](self, *tensors)
        return kernel

    def run_ptrs(self: Any, ptrs: tuple[int, ...]) -> None:
        for _ in range(_times(kernels, self.fn)):
            saved[1](self, ptrs)

    def run(self: Any, grid: tuple[int, ...], args: tuple, kwargs: dict[str, Any]) -> None:
        for _ in range(_times(kernels, self.fn)):
            saved[2](self, grid, args, kwargs)

    L.KernelLauncher.launch_jit, L.KernelLauncher.run_ptrs = launch_jit, run_ptrs  # type: ignore[method-assign]
    L.CachedLauncher.run = run  # type: ignore[method-assign]
    try:
        yield
    finally:
        L.KernelLauncher.launch_jit, L.KernelLauncher.run_ptrs, L.CachedLauncher.run = saved  # type: ignore[method-assign]


def _shape_key(args: tuple, kwargs: dict[str, Any]) -> tuple:
    def one(a: Any) -> Any:
        return (tuple(a.shape), a.dtype, a.device) if isinstance(a, torch.Tensor) else type(a)

    return (*map(one, args), *((k, one(v)) for k, v in sorted(kwargs.items())))


def _module_wrapper(mod: torch.nn.Module, what: str) -> Any:
    orig = mod.forward
    cache: dict[tuple, Any] = {}

    def dup(*args: Any, **kwargs: Any) -> Any:
        orig(*args, **kwargs)
        return orig(*args, **kwargs)

    def skip(*args: Any, **kwargs: Any) -> Any:
        key = _shape_key(args, kwargs)
        if key not in cache:  # the first call (the warm-up, before any capture) runs
            cache[key] = orig(*args, **kwargs)
        return cache[key]

    return dup if what == "dup" else skip


@contextlib.contextmanager
def no_fast_launch() -> Iterator[None]:
    """SGL_EXT_FAST_LAUNCH=0 for the duration (eager calls then reach the patched launchers)."""
    old = os.environ.get("SGL_EXT_FAST_LAUNCH")
    os.environ["SGL_EXT_FAST_LAUNCH"] = "0"
    settings.reload()
    try:
        yield
    finally:
        if old is None:
            del os.environ["SGL_EXT_FAST_LAUNCH"]
        else:
            os.environ["SGL_EXT_FAST_LAUNCH"] = old
        settings.reload()


@contextlib.contextmanager
def patched(model: torch.nn.Module, actions: tuple[Action, ...]) -> Iterator[None]:
    """The variant's patches on model (modules by name suffix) and on the launchers."""
    mods: list[torch.nn.Module] = []
    for a in actions:
        if a.kind != "module":
            continue
        hits = [m for n, m in model.named_modules() if n == a.name or n.endswith("." + a.name)]
        if not hits:
            raise ValueError(f"no module of the model ends with {a.name!r}")
        for m in hits:
            m.forward = _module_wrapper(m, a.what)  # type: ignore[method-assign]
            mods.append(m)
    kernels = {a.name: a.what for a in actions if a.kind == "kernel"}
    try:
        with _patched_kernels(kernels):
            yield
    finally:
        for m in mods:
            del m.forward  # the class's forward again


def _bench_args(a: argparse.Namespace) -> argparse.Namespace:
    """The namespace srt.bench_one_batch's build_server_args reads."""
    preset = None if a.model_preset == "tiny" else a.model_preset
    return argparse.Namespace(
        model_path=None,
        load_format="dummy" if preset else "auto",
        model_preset=preset,
        batch_size=[a.batch_size],
        input_len=a.input_len,
        output_len=a.output_len,
        device=a.device,
        dtype="auto",
        kv_cache_dtype="auto",
        page_size=1,
        attention_backend=None,
        disable_cuda_graph=a.device != "cuda",
        seed=0,
    )


def _model_runner(a: argparse.Namespace) -> Any:
    """The model, built once the way srt.bench_one_batch builds it."""
    from srt.bench_one_batch import build_server_args
    from srt.model_executor.model_builder import build_model_config
    from srt.model_executor.model_runner import ModelRunner

    sargs = build_server_args(_bench_args(a), True)
    return ModelRunner(sargs, build_model_config(sargs), None)


def run(a: argparse.Namespace) -> tuple[dict[str, list[float]], int]:
    """Per variant, the median decode step (ms) of each round; the model's decoder layers."""
    from srt.bench_one_batch import run_batch

    variants = {v: parse_variant(v) for v in a.variants}
    runner = _model_runner(a)
    graphs = runner.cuda_graph_runner is not None
    steps: dict[str, list[float]] = {v: [] for v in variants}
    for rnd in range(a.rounds):
        for name, actions in variants.items():
            with patched(runner.model, actions):
                run_batch(runner, a.batch_size, a.input_len, 4, False, 0)  # skip caches, compiles
                if graphs:
                    runner.cuda_graph_runner = None
                    gc.collect()
                    torch.cuda.empty_cache()
                    from srt.model_executor.cuda_graph_runner import CudaGraphRunner

                    runner.cuda_graph_runner = CudaGraphRunner(runner)
                    run_batch(runner, a.batch_size, a.input_len, 4, True, 0)
                r = run_batch(runner, a.batch_size, a.input_len, a.output_len, graphs, 0)
            steps[name].append(r["decode_step_latency_s"] * 1e3)
            print(f"# round {rnd} {name}: {steps[name][-1]:.3f} ms", flush=True)
    return steps, int(runner.model_config.num_hidden_layers)


def _capture(runner: Any, bs: int, stream: torch.cuda.Stream) -> torch.cuda.CUDAGraph:
    """One more decode graph of bucket bs in the runner's CudaGraphRunner (its static inputs and
    memory pool), with the flags its own capture sets."""
    cgr, pool = runner.cuda_graph_runner, runner.token_to_kv_pool
    cgr.is_capturing = True
    pool.set_stream_overlap(True)
    try:
        graph, _ = cgr._capture_one(bs, stream)
    finally:
        cgr.is_capturing = False
        pool.set_stream_overlap(False)
    torch.cuda.synchronize()
    return graph


def run_replays(a: argparse.Namespace) -> tuple[dict[str, list[float]], int]:
    """Per variant, the decode graph's ms per replay in each round (--replays; see the module)."""
    from srt.bench_one_batch import run_batch

    variants = {v: parse_variant(v) for v in a.variants}
    runner = _model_runner(a)
    run_batch(runner, a.batch_size, a.input_len, a.output_len, True, 0)  # real static inputs
    bs = runner.cuda_graph_runner.bucket(a.batch_size)
    stream = torch.cuda.Stream()
    graphs = {}
    for name, actions in variants.items():
        with patched(runner.model, actions):
            graphs[name] = _capture(runner, bs, stream)
    ms: dict[str, list[float]] = {v: [] for v in variants}
    for rnd in range(a.rounds):
        for name, graph in graphs.items():
            for _ in range(3):
                graph.replay()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(a.replays):
                graph.replay()
            end.record()
            end.synchronize()
            ms[name].append(start.elapsed_time(end) / a.replays)
            print(f"# round {rnd} {name}: {ms[name][-1]:.4f} ms", flush=True)
    return ms, int(runner.model_config.num_hidden_layers)


def table(
    steps: dict[str, list[float]], num_layers: int, base: str = "base", median: bool = False
) -> str:
    """Markdown rows: variant, every round's step, the least (median: the median), its
    difference to base."""
    pick = statistics.median if median else min
    ref = pick(steps[base]) if base in steps else None
    what = "median" if median else "least"
    out = [f"| variant | steps (ms) | {what} | vs base | per layer |", "|---|---|---:|---:|---:|"]
    for name, xs in steps.items():
        best = pick(xs)
        d = "" if ref is None else f"{(best - ref) * 1e3:+.0f} µs"
        per = "" if ref is None else f"{(best - ref) * 1e3 / num_layers:+.2f} µs"
        nd = 4 if median else 3
        rounds = " / ".join(f"{x:.{nd}f}" for x in xs)
        out.append(f"| {name} | {rounds} | {best:.{nd}f} | {d} | {per} |")
    return "\n".join(out)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from srt.model_executor.model_builder import PRESETS

    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--model-preset",
        default="gpt-oss-20b-mxfp4",
        choices=[*sorted(PRESETS), "tiny"],
        help="a preset's shape with dummy weights, or the embedded tiny model",
    )
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=32, help="decode steps timed per variant")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--variants", nargs="+", default=["base"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--replays",
        type=int,
        default=0,
        help="time N back-to-back replays of each variant's graph per round (CUDA; see above)",
    )
    a = p.parse_args(argv)
    for v in a.variants:
        try:
            parse_variant(v)
        except ValueError as e:
            p.error(str(e))
    if a.rounds < 1 or a.output_len < 2:
        p.error("--rounds must be >= 1 and --output-len >= 2")
    if a.replays < 0 or (a.replays and a.device != "cuda"):
        p.error("--replays needs N >= 1 and CUDA graphs (--device cuda)")
    return a


def main(argv: list[str] | None = None) -> str:
    a = parse_args(argv)
    with no_fast_launch():
        steps, layers = run_replays(a) if a.replays else run(a)
    out = table(steps, layers, median=bool(a.replays))
    print(out)
    return out


if __name__ == "__main__":
    main()
