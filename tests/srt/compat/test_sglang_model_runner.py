"""SGLang 0.5.23's model files through srt's ModelRunner, Engine and command lines
(`model_impl="sglang"`, `--model-impl sglang --model-file PATH`): the same logits and greedy
tokens as srt's own files (and HF's greedy tokens), gpt-oss's sliding-window layers in the
hybrid pool and fp8 caches on the fused RoPE + KV path. On a GPU: bf16 with CUDA graphs.

SGLang's files are fetched from the package index at test time; these tests skip without it.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from srt.compat.sglang_model import count_rope_calls
from srt.managers.schedule_batch import Req, ScheduleBatch
from srt.model_executor.model_runner import ModelRunner
from srt.sampling.sampling_params import SamplingParams
from srt.server_args import ServerArgs
from tests.conftest import gpu
from tests.srt.models.hf_compare import make_prompts

PROMPT_LENS = (1, 7, 13)
GPU_LENS = (1, 7, 13, 5)  # 4 requests: a graph bucket exactly, no padded rows


def _args(sglang_dir, name: str, impl: str, path, **kw) -> ServerArgs:
    if impl == "sglang":
        kw.update(model_impl="sglang", model_file=str(sglang_dir / f"{name}.py"))
    kw.setdefault("device", "cpu")
    return ServerArgs(model_path=str(path), max_total_tokens=512, **kw)


def greedy(runner: ModelRunner, steps: int, use_graph: bool = True, lens=PROMPT_LENS):
    """Prefill prompts of lengths `lens`, then `steps` greedy decode steps: (logits per forward
    [B, V], each request's tokens)."""
    prompts, _ = make_prompts(runner.model_config.vocab_size, lens=lens, steps=0)
    sb = ScheduleBatch.from_runner(runner)
    reqs = [Req(i, p, SamplingParams(max_new_tokens=steps + 2)) for i, p in enumerate(prompts)]
    logits = [runner.forward(sb.prepare_for_extend(reqs)).clone()]
    for _ in range(steps):
        for req, t in zip(reqs, runner.greedy_ids(logits[-1]), strict=True):
            req.output_ids.append(t)
        logits.append(runner.forward(sb.prepare_for_decode(reqs), use_graph).clone())
    return logits, [r.output_ids for r in reqs]


def hf_greedy(hf, steps: int, lens=PROMPT_LENS, margins: list | None = None) -> list[list[int]]:
    """HF's greedy tokens (float32, no cache) for the prompts of `greedy`; `margins`, if given,
    receives each request's top-1 minus top-2 logit per step."""
    prompts, _ = make_prompts(hf.config.vocab_size, lens=lens, steps=0)
    out = []
    with torch.no_grad():
        for p in prompts:
            ids, gaps = list(p), []
            for _ in range(steps):
                top2 = hf(input_ids=torch.tensor([ids])).logits[0, -1].float().topk(2)
                ids.append(int(top2.indices[0]))
                gaps.append(float(top2.values[0] - top2.values[1]))
            out.append(ids[len(p) :])
            if margins is not None:
                margins.append(gaps)
    return out


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("kv", ["auto", "fp8_e4m3"])
def test_runner_gpt_oss_hybrid_pool_and_fp8_cache(sglang_dir, gpt_oss_ckpt, kv, page_size):
    """gpt-oss's window layers in the hybrid sliding-window pool, fp8 caches: SGLang's file
    writes K and V through srt's fused RoPE on every layer and step, the same bytes."""
    path, hf = gpt_oss_ckpt
    runs = {}
    for impl in ("sglang", "srt"):
        args = _args(sglang_dir, "gpt_oss", impl, path, kv_cache_dtype=kv, page_size=page_size)
        runner = ModelRunner(args)
        assert type(runner.token_to_kv_pool).__name__ == "SWAKVPool"
        with count_rope_calls(runner.model) as rope:
            runs[impl] = greedy(runner, steps=6)
        assert rope.fused == rope.total == 3 * 7  # 3 layers x (prefill + 6 steps)
    (a, ta), (b, tb) = runs["sglang"], runs["srt"]
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True)) and ta == tb
    if kv == "auto":
        assert ta == hf_greedy(hf, 6)


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_runner_llama_qwen3_tokens(request, sglang_dir, name):
    path, hf = request.getfixturevalue(f"{name}_ckpt")
    a, ta = greedy(ModelRunner(_args(sglang_dir, name, "sglang", path, page_size=4)), 6)
    b, tb = greedy(ModelRunner(_args(sglang_dir, name, "srt", path, page_size=4)), 6)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert ta == tb == hf_greedy(hf, 6)


def test_engine_runs_sglang_file(sglang_dir, qwen3_ckpt):
    from srt.entrypoints.engine import Engine

    path, hf = qwen3_ckpt
    prompts, _ = make_prompts(hf.config.vocab_size, lens=PROMPT_LENS, steps=0)
    sp = {"max_new_tokens": 5, "temperature": 0.0, "ignore_eos": True}
    out = {}
    for impl in ("sglang", "srt"):
        kw = {"model_impl": "sglang", "model_file": str(sglang_dir / "qwen3.py")}
        engine = Engine(model_path=str(path), device="cpu", **(kw if impl == "sglang" else {}))
        try:
            out[impl] = [
                o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=sp)
            ]
        finally:
            engine.shutdown()
    assert out["sglang"] == out["srt"] == hf_greedy(hf, 5)


def test_bench_one_batch_reports_fused_rope_calls(sglang_dir, gpt_oss_ckpt, capsys):
    from srt import bench_one_batch

    argv = ["--model-path", str(gpt_oss_ckpt[0]), "--model-impl", "sglang", "--model-file"]
    argv += [str(sglang_dir / "gpt_oss.py"), "--device", "cpu", "--batch-size", "2"]
    argv += ["--input-len", "6", "--output-len", "3", "--result-filename", ""]
    results = bench_one_batch.main(argv)
    assert results and all(r["passed"] for r in results)
    out = capsys.readouterr().out
    counts = re.findall(r"SGLang model file .*gpt_oss\.py: (\d+) of (\d+) RoPE calls fused", out)
    fused_variant, unfused_variant = counts  # the fused variant, then the unfused one
    assert fused_variant[0] == fused_variant[1] != "0" and unfused_variant[0] == "0"


def test_gpqa_cli_runs_sglang_llama_on_the_tiny_model(sglang_dir, tmp_path, capsys):
    """The embedded tiny Llama (dummy weights, drawn in the same parameter order by both files:
    the same model) through SGLang's llama.py gives srt's answers."""
    pytest.importorskip("tokenizers")
    from srt.eval import gpqa
    from tests.srt.eval.gpqa_fakes import synthetic_rows, write_csv

    data = write_csv(tmp_path / "q.csv", synthetic_rows(3))
    base = ["--data", str(data), "--load-format", "dummy", "--device", "cpu"]
    base += ["--max-new-tokens", "4", "--num-examples", "3"]
    summaries = []
    for impl in (["--model-impl", "sglang", "--model-file", str(sglang_dir / "llama.py")], []):
        out = tmp_path / f"out{len(impl)}.jsonl"
        assert gpqa.main(base + impl + ["--output", str(out)]) == 0
        summaries.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
        summaries[-1]["responses"] = [
            json.loads(x)["response"] for x in out.read_text().splitlines()
        ]
    assert summaries[0]["responses"] == summaries[1]["responses"]


# ------------------------------------------------------------------ GPU: bf16, CUDA graphs


def _agree(got: list[list[int]], ref_logits: list[torch.Tensor], ref: list[list[int]]) -> None:
    """Greedy tokens agree with the reference's, step by step, until the reference's top two
    logits come closer than bf16 can separate (1e-2): from there the two may take either."""
    for i, (g, r) in enumerate(zip(got, ref, strict=True)):
        for s, (x, y) in enumerate(zip(g, r, strict=True)):
            top2 = ref_logits[s][i].float().topk(2).values
            if float(top2[0] - top2[1]) < 1e-2:
                break
            assert x == y, (i, s, g, r)


@gpu
@pytest.mark.parametrize("name", ["llama", "qwen3", "gpt_oss"])
def test_gpu_bf16_cuda_graphs_same_tokens(request, sglang_dir, name):
    """bf16 with CUDA-graph decode: SGLang's file replays its graphs with the bits of its
    eager decode, its greedy tokens are srt's file's (up to bf16 near-ties: the files differ in
    rounding only, e.g. SGLang's RMSNorm multiplies the weight in float32) and HF's float32
    ones up to HF's own near-ties."""
    path, hf = request.getfixturevalue(f"{name}_ckpt")
    kw = dict(device="cuda", dtype="bfloat16", page_size=4, cuda_graph_max_bs=4)
    sgl = ModelRunner(_args(sglang_dir, name, "sglang", path, **kw))
    assert sgl.cuda_graph_runner is not None
    with count_rope_calls(sgl.model) as rope:
        eager = greedy(sgl, 6, use_graph=False, lens=GPU_LENS)
    if name == "gpt_oss":
        assert rope.fused == rope.total == 3 * 7
    graphs = greedy(sgl, 6, use_graph=True, lens=GPU_LENS)
    assert all(torch.equal(x, y) for x, y in zip(eager[0], graphs[0], strict=True))
    assert eager[1] == graphs[1]
    ours = greedy(ModelRunner(_args(sglang_dir, name, "srt", path, **kw)), 6, lens=GPU_LENS)
    _agree(graphs[1], ours[0], ours[1])
    # HF runs float32: a bf16 trajectory may part from it where HF's own top two logits are
    # closer than bf16's rounding of the logits (5e-2 on these random checkpoints).
    margins: list[list[float]] = []
    hf_tokens = hf_greedy(hf, 6, GPU_LENS, margins)
    for i, (g, r) in enumerate(zip(graphs[1], hf_tokens, strict=True)):
        for s, (x, y) in enumerate(zip(g, r, strict=True)):
            if margins[i][s] < 5e-2:
                break
            assert x == y, (i, s, g, r, margins[i])


@gpu
def test_gpu_gpt_oss_fp8_hybrid_pool_graphs(sglang_dir, gpt_oss_ckpt):
    """fp8 e4m3 cache and the hybrid sliding-window pool on the GPU, CUDA graphs: every RoPE
    call fused, graph replays equal to eager decode."""
    kw = dict(device="cuda", dtype="bfloat16", kv_cache_dtype="fp8_e4m3", cuda_graph_max_bs=4)
    runner = ModelRunner(_args(sglang_dir, "gpt_oss", "sglang", gpt_oss_ckpt[0], **kw))
    assert type(runner.token_to_kv_pool).__name__ == "SWAKVPool"
    with count_rope_calls(runner.model) as rope:
        eager = greedy(runner, 5, use_graph=False, lens=GPU_LENS)
    assert rope.fused == rope.total == 3 * 6
    graphs = greedy(runner, 5, use_graph=True, lens=GPU_LENS)
    assert all(torch.equal(x, y) for x, y in zip(eager[0], graphs[0], strict=True))
