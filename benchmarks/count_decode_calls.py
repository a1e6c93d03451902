"""Host work of one eager decode step, counted on the CPU: our Python calls and the torch calls
they make, per decoder layer (the GPU path's code, Triton interpreted).

    SGL_EXT_BACKEND=triton TRITON_INTERPRET=1 python benchmarks/count_decode_calls.py \
        [--arch llama|qwen3] [--steps 3] [--top 25] [--layers 2] [--batch-size 2] [--host-us]

Builds the embedded tiny config (Llama, or Qwen3 with the q/k-norm op; `--layers` decoder
layers) with the Triton attention backend and the fused RoPE + KV write, prefills
`--batch-size` prompts, warms up, then runs `--steps` decode steps under cProfile. Counts, per
step and per decoder layer, the calls of functions defined in
srt/ and sgl_ext/ and the calls those functions make into torch and builtins (the Triton
interpreter's own work is not counted: its frames are Triton's). Fewer calls here is less host
time per layer on the GPU; the time itself is measured there (benchmarks/bench_eager.py,
profile_decode.py).

`--host-us` also times the Python host work of one eager decode step: the decoder model's
forward (embedding, layers, final norm; not the LM head) on one prepared batch, median of 15
rounds, with every Triton launch stubbed out after the warm-up (`CachedLauncher.run` and
`KernelLauncher`'s launches do nothing; the interpreter's work is not host work on the GPU)
and F.linear replaced by an empty result (a bf16 matmul on this CPU costs more than the whole
layer's Python): the srt / sgl_ext code around the launches, not the launches or cuBLAS's
dispatch themselves (those are timed on the GPU).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

OURS = (f"{os.sep}srt{os.sep}", f"{os.sep}sgl_ext{os.sep}")


def _jit_functions() -> set[tuple[str, str]]:
    """(file, name) of every @triton.jit function in our loaded modules: the interpreter runs
    them on the CPU, the GPU does not (not host work there)."""
    out = set()
    for mod in list(sys.modules.values()):
        f = getattr(mod, "__file__", None) or ""
        if not any(p in f for p in OURS):
            continue
        for name, obj in vars(mod).items():
            if type(obj).__name__ in ("JITFunction", "InterpretedFunction"):
                out.add((os.path.realpath(f), name))
    return out


def count(stats: pstats.Stats) -> tuple[int, int, list[tuple[int, str]]]:
    """(our Python calls, torch/builtin calls made from our frames, top entries)."""
    jit = _jit_functions()

    def ours_host(fname: str, func: str) -> bool:
        return any(p in fname for p in OURS) and (os.path.realpath(fname), func) not in jit

    ours = torch_calls = 0
    rows = []
    for (fname, line, func), (_cc, nc, _tt, _ct, callers) in stats.stats.items():  # type: ignore[attr-defined]
        if any(p in fname for p in OURS):
            if ours_host(fname, func):
                ours += nc
                rows.append((nc, f"{os.path.relpath(fname)}:{line} {func}"))
            continue
        if fname.startswith("~") or "torch" in fname:  # a builtin / C function, or torch Python
            from_ours = sum(c[1] for (cf, _, cfn), c in callers.items() if ours_host(cf, cfn))
            if from_ours:
                torch_calls += from_ours
                rows.append((from_ours, f"[from ours] {func}"))
    rows.sort(reverse=True)
    return ours, torch_calls, rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arch", default="llama", choices=["llama", "qwen3"])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--layers", type=int, default=2, help="decoder layers of the tiny model")
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--host-us", action="store_true", help="time the step with launches stubbed")
    a = p.parse_args(argv)

    import torch

    from srt.managers.schedule_batch import Req, ScheduleBatch
    from srt.model_executor.model_builder import tiny_config_dict
    from srt.model_executor.model_runner import ModelRunner
    from srt.sampling.sampling_params import SamplingParams
    from srt.server_args import ServerArgs

    override = {**tiny_config_dict(), "num_hidden_layers": a.layers}
    if a.arch == "qwen3":  # the tiny Llama's sizes as a Qwen3 (q/k RMSNorm per head)
        override.update(architectures=["Qwen3ForCausalLM"], model_type="qwen3")
        override.update(attention_bias=False)
    args = ServerArgs(
        device="cpu",
        dtype="bfloat16",
        load_format="dummy",
        attention_backend="triton",
        enable_fused_rope_kv=True,
        disable_cuda_graph=True,
        max_total_tokens=256 * a.batch_size,
        max_running_requests=a.batch_size,
        context_length=128,
        json_model_override_args=json.dumps(override),
    ).resolved()
    runner = ModelRunner(args)
    layers = int(runner.model_config.num_hidden_layers)
    params = SamplingParams(max_new_tokens=1 << 10, temperature=0.0, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    vocab = int(runner.model_config.vocab_size)
    prompts = torch.randint(0, vocab, (a.batch_size, 9), generator=g).tolist()
    reqs = [Req(i, q, params) for i, q in enumerate(prompts)]
    sb = ScheduleBatch.from_runner(runner)
    ids = runner.forward(sb.prepare_for_extend(reqs)).argmax(-1).tolist()

    def step() -> None:
        nonlocal ids
        for r, t in zip(reqs, ids, strict=True):
            r.output_ids.append(t)
        ids = runner.forward(sb.prepare_for_decode(reqs)).argmax(-1).tolist()

    for _ in range(2):
        step()  # warm-up: plans made, kernels compiled (interpreted)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(a.steps):
        step()
    prof.disable()
    ours, torch_calls, rows = count(pstats.Stats(prof))
    n = a.steps
    print(f"# {a.arch} tiny, {layers} layers, bs {a.batch_size}, eager decode, {n} steps")
    print(f"our Python calls per step {ours / n:.0f}, per layer {ours / n / layers:.1f}")
    print(
        f"torch/builtin calls from our code per step {torch_calls / n:.0f}, per layer "
        f"{torch_calls / n / layers:.1f}"
    )
    for nc, name in rows[: a.top]:
        print(f"{nc / n / layers:8.1f}/layer  {name}")
    if a.host_us:
        us = _host_us(runner, sb.prepare_for_decode(reqs))
        print(f"host us per eager step (launches stubbed) {us:.1f}, per layer {us / layers:.2f}")


def _host_us(runner, fb, rounds: int = 15, n: int = 20) -> float:
    """Median over `rounds` of the mean host µs of the decoder model's forward on `fb`
    (launches stubbed)."""
    import statistics
    import time

    import torch.nn.functional as F

    from sgl_ext.triton import launcher

    def linear(x, weight, bias=None):  # the output only: [..., N], x's dtype
        return x.new_empty(*x.shape[:-1], weight.shape[0])

    F.linear = linear

    def nop(*args: object, **kwargs: object) -> None:
        return None

    for cls, names in (
        (launcher.CachedLauncher, ("run",)),
        (launcher.KernelLauncher, ("launch", "launch_jit", "direct", "run_ptrs")),
    ):
        for name in names:
            setattr(cls, name, nop)
    runner.forward(fb)  # warm-up with the stubs (and the backend's metadata for fb)
    decoder = runner.model.model  # DecoderModel: embedding, layers, final norm
    ids, pos = fb.input_ids, fb.positions
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(n):
            decoder(ids, pos, fb)
        times.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(times)


if __name__ == "__main__":
    main()
