"""Parallel linears, vocab-parallel embedding / LM head and the sharded MoE against their TP-1
references: each rank's shard built with an explicit (tp_rank, tp_size) in one process, and the
real collectives on 2 gloo ranks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from srt.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from srt.layers.moe import TopKExperts, select_experts
from srt.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from tests.srt.distributed.tp_harness import run_ranks


def _rand(*shape, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _close(got: torch.Tensor, ref: torch.Tensor) -> None:
    torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=1e-5)  # fp32 vs float64


def _ref(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    out = x.double() @ w.double().T
    return out + b.double() if b is not None else out


@pytest.mark.parametrize("tp", [2, 4])
def test_column_and_row_shards_rebuild_the_full_linear(tp):
    """Column outputs concatenate, row partial sums add up (+ bias once) to the TP-1 result."""
    x, w, b = _rand(7, 12, seed=0), _rand(8, 12, seed=1), _rand(8, seed=2)
    cols, parts = [], []
    for r in range(tp):
        col = ColumnParallelLinear(12, 8, bias=True, tp_rank=r, tp_size=tp)
        row = RowParallelLinear(12, 8, bias=True, tp_rank=r, tp_size=tp, reduce_results=False)
        for lin in (col, row):
            lin.weight.fill_(float("nan"))
            lin.weight.weight_loader(lin.weight, w)
            lin.bias.weight_loader(lin.bias, b)
        cols.append(col(x)[0])
        k = 12 // tp
        parts.append(row(x[:, r * k : (r + 1) * k])[0])  # this rank's input columns
    _close(torch.cat(cols, -1), _ref(x, w, b))
    _close(sum(p.double() for p in parts), _ref(x, w, b))
    with pytest.raises(ValueError, match="tp_size"):
        ColumnParallelLinear(12, 7, tp_rank=0, tp_size=2)
    with pytest.raises(ValueError, match="tp_rank"):
        RowParallelLinear(12, 8, tp_rank=2, tp_size=2)


@pytest.mark.parametrize("tp, kv_heads", [(2, 2), (2, 1), (4, 2)])
def test_qkv_shards_split_or_replicate_kv_heads(tp, kv_heads):
    """Per-shard and packed (TP-1 tensor) loading give each rank its q heads and its KV head
    (replicated when tp > kv heads)."""
    H, D, hq = 10, 4, 4
    wq = _rand(hq * D, H, seed=3)
    wk, wv = _rand(kv_heads * D, H, seed=4), _rand(kv_heads * D, H, seed=5)
    packed = torch.cat([wq, wk, wv])
    x = _rand(3, H, seed=6)
    for r in range(tp):
        a = QKVParallelLinear(H, D, hq, kv_heads, bias=False, tp_rank=r, tp_size=tp)
        b = QKVParallelLinear(H, D, hq, kv_heads, bias=False, tp_rank=r, tp_size=tp)
        assert a.num_heads == hq // tp and a.num_kv_heads == max(1, kv_heads // tp)
        a.weight.fill_(float("nan"))
        b.weight.fill_(float("nan"))
        for s, w in zip("qkv", (wq, wk, wv), strict=True):
            a.weight.weight_loader(a.weight, w, s)
        b.weight.weight_loader(b.weight, packed)
        assert torch.equal(a.weight, b.weight)
        q, k, v = a(x)[0].split([a.q_size, a.kv_size, a.kv_size], dim=-1)
        nq, nkv = a.num_heads * D, a.num_kv_heads * D
        kv_rank = r // max(1, tp // kv_heads)
        _close(q, _ref(x, wq[r * nq : (r + 1) * nq]))
        _close(k, _ref(x, wk[kv_rank * nkv : (kv_rank + 1) * nkv]))
        _close(v, _ref(x, wv[kv_rank * nkv : (kv_rank + 1) * nkv]))
    with pytest.raises(ValueError, match="rows"):
        b.weight.weight_loader(b.weight, packed[:-1])


def test_merged_column_packed_and_per_shard_loading_agree():
    g_w, u_w = _rand(6, 5, seed=7), _rand(6, 5, seed=8)
    x = _rand(4, 5, seed=9)
    outs = []
    for r in range(3):
        a = MergedColumnParallelLinear(5, [6, 6], bias=False, tp_rank=r, tp_size=3)
        b = MergedColumnParallelLinear(5, [6, 6], bias=False, tp_rank=r, tp_size=3)
        a.weight.weight_loader(a.weight, g_w, 0)
        a.weight.weight_loader(a.weight, u_w, 1)
        b.weight.weight_loader(b.weight, torch.cat([g_w, u_w]))
        assert torch.equal(a.weight, b.weight)
        outs.append(a(x)[0].view(4, 2, 2))  # [T, (gate, up), 6 / 3]
    full = torch.cat(outs, dim=-1).reshape(4, 12)  # gate | up over all ranks
    _close(full, _ref(x, torch.cat([g_w, u_w])))
    with pytest.raises(ValueError, match="packed"):
        b.weight.weight_loader(b.weight, g_w)


def test_vocab_padding_and_lm_head_bias_shards():
    """Vocab 10 over 4 ranks: 3 rows each, the last rank holds 1 real row + 2 zero rows."""
    w, bias = _rand(10, 6, seed=10), _rand(10, seed=11)
    rows = []
    for r in range(4):
        head = ParallelLMHead(10, 6, bias=True, tp_rank=r, tp_size=4)
        head.weight.fill_(float("nan"))
        head.bias.fill_(float("nan"))
        head.weight.weight_loader(head.weight, w)
        head.bias.weight_loader(head.bias, bias)
        assert head.weight.shape == (3, 6)
        rows.append((head.weight, head.bias))
    assert torch.equal(torch.cat([a for a, _ in rows])[:10], w)
    assert torch.equal(torch.cat([b for _, b in rows])[:10], bias)
    assert torch.equal(rows[3][0][1:], torch.zeros(2, 6))
    with pytest.raises(ValueError, match="checkpoint shape"):
        VocabParallelEmbedding(10, 6, tp_rank=0, tp_size=2).weight_loader(head.weight, w[:9])


def test_moe_intermediate_shards_sum_to_full_and_bias_counts_once():
    E, H, Im, k = 5, 8, 12, 2
    full = TopKExperts(E, H, Im, bias=True, tp_rank=0, tp_size=1)
    w13, w2 = _rand(E, 2 * Im, H, seed=12) * 0.3, _rand(E, H, Im, seed=13) * 0.3
    b13, b2 = _rand(E, 2 * Im, seed=14), _rand(E, H, seed=15)
    for p, t in (
        (full.w13_weight, w13),
        (full.w2_weight, w2),
        (full.w13_bias, b13),
        (full.w2_bias, b2),
    ):
        p.weight_loader(p, t)
    x = _rand(7, H, seed=16)
    weights, ids = select_experts(_rand(7, E, seed=17), k)
    for T in (7, 2):  # dense path (T * k >= E) and gathered path (T * k < E)
        ref = full(x[:T], weights[:T], ids[:T]).double()
        total = 0
        for r in range(3):
            part = TopKExperts(E, H, Im, bias=True, tp_rank=r, tp_size=3, reduce_results=False)
            for name, t in (
                ("w13_weight", w13),
                ("w2_weight", w2),
                ("w13_bias", b13),
                ("w2_bias", b2),
            ):
                p = getattr(part, name)
                p.fill_(float("nan"))
                p.weight_loader(p, t)
            assert part.w13_weight.shape == (E, 8, H) and part.w2_weight.shape == (E, H, 4)
            total = total + part(x[:T], weights[:T], ids[:T]).double()
        torch.testing.assert_close(total, ref, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="intermediate_size"):
        TopKExperts(E, H, 10, tp_rank=0, tp_size=3)


# ---- real collectives on 2 gloo ranks ----
def _rank_collectives() -> dict[str, np.ndarray]:
    from srt.distributed import (
        get_tp_rank,
        get_tp_size,
        tensor_model_parallel_all_gather,
        tensor_model_parallel_all_reduce,
        tensor_model_parallel_broadcast,
    )
    from srt.layers.logits_processor import LogitsProcessor
    from srt.model_executor.forward_batch_info import ForwardMode

    r, tp = get_tp_rank(), get_tp_size()
    out = {}
    out["reduce"] = tensor_model_parallel_all_reduce(torch.full((3,), float(r + 1))).numpy()
    out["gather"] = tensor_model_parallel_all_gather(torch.full((2, 1), float(r)), dim=-1).numpy()
    out["bcast"] = tensor_model_parallel_broadcast(torch.tensor([r * 10 + 7])).numpy()
    w, x = _rand(8, 12, seed=1), _rand(5, 12, seed=0)
    row = RowParallelLinear(12, 8, bias=True, tp_rank=r, tp_size=tp)
    row.weight.weight_loader(row.weight, w)
    row.bias.weight_loader(row.bias, _rand(8, seed=2))
    out["row"] = row(x[:, r * 6 : (r + 1) * 6])[0].numpy()
    emb = VocabParallelEmbedding(11, 4, tp_rank=r, tp_size=tp)  # padded to 12 rows over 2 ranks
    emb.weight.weight_loader(emb.weight, _rand(11, 4, seed=3))
    out["emb"] = emb(torch.tensor([0, 5, 6, 10, 3])).numpy()
    head = ParallelLMHead(11, 4, tp_rank=r, tp_size=tp)
    head.weight.weight_loader(head.weight, _rand(11, 4, seed=3))

    class _FB:
        forward_mode = ForwardMode.DECODE

    out["logits"] = LogitsProcessor(11)(None, _rand(2, 4, seed=4), head, _FB()).next_token_logits
    out["logits"] = out["logits"].numpy()
    return out


def test_collectives_and_layers_on_two_gloo_ranks():
    res = run_ranks(_rank_collectives, 2)
    for o in res:
        np.testing.assert_array_equal(o["reduce"], [3.0, 3.0, 3.0])
        np.testing.assert_array_equal(o["gather"], [[0.0, 1.0], [0.0, 1.0]])
        np.testing.assert_array_equal(o["bcast"], [7])
        w, x, b = _rand(8, 12, seed=1), _rand(5, 12, seed=0), _rand(8, seed=2)
        np.testing.assert_allclose(o["row"], _ref(x, w, b).numpy(), atol=1e-5, rtol=1e-5)
        table = _rand(11, 4, seed=3)
        np.testing.assert_array_equal(o["emb"], table[[0, 5, 6, 10, 3]].numpy())
        ref = _ref(_rand(2, 4, seed=4), table).numpy()
        assert o["logits"].shape == (2, 11)
        np.testing.assert_allclose(o["logits"], ref, atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(res[0]["row"], res[1]["row"])  # every rank the same sum
