"""benchmarks/bench_gemm.py: the shapes it times (the decoder layers' linears, or with --lm-head
each preset's LM head once a step) and its CLI errors."""

from __future__ import annotations

import pytest
import torch

from tests.srt.benchmark_scripts import load_benchmark


def _tool():
    return load_benchmark("bench_gemm")


def test_lm_head_shapes_are_each_presets_vocab_by_hidden_once_a_step():
    t = _tool()
    heads = t.shapes_of(["llama3-8b", "qwen3-8b", "gpt-oss-20b"], lm_head=True)
    assert [(s.name, s.n, s.k, s.bias) for s in heads] == [
        ("lm_head", 128256, 4096, False),
        ("lm_head", 151936, 4096, False),
        ("lm_head", 201088, 2880, False),
    ]
    assert [s.users for s in heads] == [
        (("llama3-8b", 1),),
        (("qwen3-8b", 1),),
        (("gpt-oss-20b", 1),),
    ]
    layers = t.shapes_of(["gpt-oss-20b"])
    assert {s.name for s in layers} == {"o_proj", "qkv", "router"}
    assert all(s.users == (("gpt-oss-20b", 24),) for s in layers)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-CUDA error path")
def test_cli_without_cuda_is_one_error_line(capsys):
    assert _tool().main(["--lm-head", "--m", "1"]) == 2
    assert capsys.readouterr().err.startswith("error: bench_gemm needs CUDA")
