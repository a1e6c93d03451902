"""srt/layers/gemm_choice: the (N, K, M bucket) table that sends decode linears to the skinny
Triton GEMM. CPU: keys, validation, nothing changes off CUDA. GPU: the layers pick the kernel,
match F.linear, and a model with every linear on the Triton GEMM keeps graph == eager bits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sgl_ext import device_tables
from sgl_ext.gemm import GemmConfig, default_config
from srt.layers import gemm_choice as gc
from srt.layers.linear import QKVParallelLinear, RowParallelLinear

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
CFG = GemmConfig(block_n=16, block_k=64)


def test_m_bucket():
    ms = (1, 2, 3, 5, 8, 9, 24, 33, 64)
    assert [gc.m_bucket(m) for m in ms] == [1, 2, 4, 8, 8, 16, 32, 64, 64]


def test_table_empty_by_default_and_keys():
    assert gc.GEMM_CHOICES == {} or all(
        gc.m_bucket(key[2]) == key[2] and isinstance(v, GemmConfig)
        for key, v in gc.GEMM_CHOICES.items()
    )
    cuda = torch.device("cuda")
    with gc.use_gemm_choices({(32, 16, 4): CFG}):
        assert gc.choose_config(32, 16, 3, torch.bfloat16, cuda) is CFG  # bucket 4
        assert gc.choose_config(32, 16, 4, torch.float16, cuda) is CFG
        assert gc.choose_config(32, 16, 5, torch.bfloat16, cuda) is None  # bucket 8
        assert gc.choose_config(32, 16, 4, torch.float32, cuda) is None
        assert gc.choose_config(32, 16, 4, torch.bfloat16, torch.device("cpu")) is None
        assert gc.choose_config(16, 32, 4, torch.bfloat16, cuda) is None
        assert gc.choose_config(32, 16, 65, torch.bfloat16, cuda) is None
    assert gc.choose_config(32, 16, 4, torch.bfloat16, cuda) is gc.GEMM_CHOICES.get((32, 16, 4))


@pytest.mark.parametrize("name", ["NVIDIA H200", "NVIDIA H100 80GB HBM3"])
def test_device_overrides_apply_by_gpu_name(monkeypatch, name):
    """DEVICE_OVERRIDES rows replace the shipped table's on a GPU whose name holds their key,
    nowhere else, and never over a table a caller installed."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: name)
    monkeypatch.setattr(device_tables, "_names", {})
    cuda = torch.device("cuda", 0)
    sub = next(iter(gc.DEVICE_OVERRIDES))
    key, row = next(iter(gc.DEVICE_OVERRIDES[sub].items()))
    want = row if sub in name else gc.GEMM_CHOICES.get(key)
    assert gc.choose_config(key[0], key[1], key[2], torch.bfloat16, cuda) == want
    assert gc.DEVICE_OVERRIDES[sub][key] != gc.GEMM_CHOICES.get(key)  # an exception, not a copy
    with gc.use_gemm_choices({key: CFG}):
        assert gc.choose_config(key[0], key[1], key[2], torch.bfloat16, cuda) is CFG


@pytest.mark.parametrize("table", [{(32, 16, 3): CFG}, {(32, 16): CFG}, {(32, 16, 4): "fma"}])
def test_bad_table_raises(table):
    with pytest.raises(ValueError, match="table entry"):
        with gc.use_gemm_choices(table):
            pass


def test_cpu_layers_unchanged_with_a_table():
    """Off CUDA the table is never consulted: the layers' outputs are F.linear's bits."""
    torch.manual_seed(0)
    row = RowParallelLinear(16, 32, bias=True)
    row.weight.data.normal_()
    row.bias.data.normal_()
    x = torch.randn(3, 16)
    with gc.use_gemm_choices({(32, 16, 4): CFG}):
        out, _ = row(x)
    assert torch.equal(out, F.linear(x, row.weight, row.bias))  # tp 1: the bias in the GEMM


class _Everything(dict):
    """A table entry for every (N, K, bucket): fma tiles up to 4 rows, dot tiles at 8, split-K
    dots above (every kernel path)."""

    def __init__(self) -> None:
        super().__init__({(1, 1, 1): CFG})  # non-empty

    def get(self, key, default=None):  # type: ignore[override]
        m = key[2]
        if m <= 4:
            return GemmConfig(block_n=16, block_k=64)
        if m <= 8:
            return default_config(16)
        return GemmConfig(block_n=32, block_k=64, split_k=2, dot=True)


@gpu
@pytest.mark.parametrize("m", [1, 3, 8, 13, 64, 65])
def test_cuda_layers_pick_triton_and_match(monkeypatch, m):
    calls = []
    real = gc.linear_small_m
    monkeypatch.setattr(
        gc, "linear_small_m", lambda *a, **kw: calls.append(a[1].shape) or real(*a, **kw)
    )
    torch.manual_seed(m)
    dt = torch.bfloat16
    qkv = QKVParallelLinear(256, 32, 8, 2, bias=True, params_dtype=dt).cuda()
    o = RowParallelLinear(256, 256, bias=True, params_dtype=dt).cuda()
    for layer in (qkv, o):
        layer.weight.data.normal_(std=256**-0.5)
        layer.bias.data.normal_()
    x = torch.randn(m, 256, device="cuda", dtype=dt)
    with gc.use_gemm_choices(_Everything()):
        got = [qkv(x)[0], o(x)[0]]
    want = [F.linear(x, qkv.weight, qkv.bias), F.linear(x, o.weight, o.bias)]
    assert len(calls) == (2 if m <= 64 else 0)
    for a, b in zip(got, want, strict=True):
        scale = b.abs().max().item()
        torch.testing.assert_close(a, b, atol=2e-2 * scale, rtol=1.6e-2)


@gpu
def test_cuda_graph_equals_eager_with_triton_linears(monkeypatch):
    """The runner's padded replay == eager test with every decode linear on the Triton GEMM."""
    from tests.srt.model_executor.test_cuda_graph_runner import (
        test_graph_replay_equals_eager_padded,
    )

    calls = []
    real = gc.linear_small_m
    monkeypatch.setattr(gc, "linear_small_m", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    with gc.use_gemm_choices(_Everything()):
        test_graph_replay_equals_eager_padded(monkeypatch, True, 1)
    assert calls, "no linear went through the Triton GEMM"
