"""Packed linear layers: forward and shard-aware weight loaders."""

import pytest
import torch

from srt.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)


def test_qkv_loader_places_shards_and_matches_separate_matmuls():
    g = torch.Generator().manual_seed(0)
    lin = QKVParallelLinear(33, 8, 4, 2, bias=True)
    assert lin.weight.shape == ((4 + 2 + 2) * 8, 33)
    ws = {s: torch.randn(n * 8, 33, generator=g) for s, n in (("q", 4), ("k", 2), ("v", 2))}
    bs = {s: torch.randn(w.shape[0], generator=g) for s, w in ws.items()}
    lin.weight.fill_(float("nan"))  # poison: every row must be written
    lin.bias.fill_(float("nan"))
    for s in "qkv":
        lin.weight.weight_loader(lin.weight, ws[s], s)
        lin.bias.weight_loader(lin.bias, bs[s], s)
    x = torch.randn(7, 33, generator=g)
    out, extra = lin(x)
    assert extra is None
    ref = torch.cat([x.double() @ ws[s].double().T + bs[s].double() for s in "qkv"], dim=-1)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="shard_id"):
        lin.weight.weight_loader(lin.weight, ws["q"], "x")
    with pytest.raises(ValueError, match=r"\[k\]"):
        lin.weight.weight_loader(lin.weight, ws["q"], "k")  # wrong shape for k
    with pytest.raises(ValueError, match="num_kv_heads"):
        QKVParallelLinear(32, 8, 6, 2, tp_size=3)  # 3 neither divides 2 nor is a multiple
    with pytest.raises(ValueError, match="num_heads"):
        QKVParallelLinear(32, 8, 4, 2, tp_size=8)


def test_merged_column_loader_and_packed_checkpoint():
    g = torch.Generator().manual_seed(1)
    lin = MergedColumnParallelLinear(5, [3, 7], bias=False)
    a, b = torch.randn(3, 5, generator=g), torch.randn(7, 5, generator=g)
    lin.weight.fill_(float("nan"))
    lin.weight.weight_loader(lin.weight, b, 1)
    lin.weight.weight_loader(lin.weight, a, 0)
    assert torch.equal(lin.weight, torch.cat([a, b]))
    lin.weight.weight_loader(lin.weight, torch.cat([b[:3], a, b[3:]]))  # already packed
    assert torch.equal(lin.weight[:3], b[:3])
    with pytest.raises(ValueError, match="shard_id"):
        lin.weight.weight_loader(lin.weight, a, 2)
    assert lin.bias is None


def test_row_column_replicated_and_skip_bias_add():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1, 6, generator=g)
    for cls in (ReplicatedLinear, ColumnParallelLinear, RowParallelLinear):
        lin = cls(6, 4, bias=True, skip_bias_add=True)
        w, b = torch.randn(4, 6, generator=g), torch.randn(4, generator=g)
        lin.weight.weight_loader(lin.weight, w)
        lin.bias.weight_loader(lin.bias, b)
        out, bias = lin(x)
        torch.testing.assert_close(out, x @ w.T)
        assert bias is lin.bias
        with pytest.raises(ValueError, match="shape"):
            lin.weight.weight_loader(lin.weight, w.T)


def test_column_tp_shard_narrowing():
    """tp_size > 1 keeps this rank's rows (exercised without a process group)."""
    full = torch.arange(8 * 3, dtype=torch.float32).view(8, 3)
    lin = ColumnParallelLinear(3, 8, bias=False, tp_rank=1, tp_size=2)
    lin.weight.weight_loader(lin.weight, full)
    assert torch.equal(lin.weight, full[4:])
