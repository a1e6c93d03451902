"""Top-k routing (srt/layers/moe/topk.py): the fused Triton kernel (compiled on CUDA, the
interpreter on CPU) against torch's topk + softmax, ties, odd sizes, argument checks."""

import pytest
import torch

from srt.layers.moe.topk import _topk_softmax_triton, select_experts, select_experts_native

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _distinct_logits(T, E, dtype, seed):
    """Logits whose values are distinct in `dtype` per row (no ties: torch's order is defined)."""
    g = torch.Generator().manual_seed(seed)
    base = torch.stack([torch.randperm(E, generator=g) for _ in range(T)]).float()
    x = (base - E / 2) * 0.25 + torch.rand(T, 1, generator=g)  # 0.25 apart: exact in bf16
    return x.to(dtype).to(DEV)


@pytest.mark.parametrize(
    "T, E, k, dtype",
    [
        (1, 32, 4, torch.bfloat16),  # gpt-oss decode
        (7, 32, 4, torch.float32),
        (33, 8, 2, torch.bfloat16),  # Mixtral
        (5, 7, 3, torch.float16),  # non-power-of-two experts
        (3, 257, 1, torch.float32),
    ],
)
@pytest.mark.parametrize("weights_dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_torch(T, E, k, dtype, weights_dtype):
    logits = _distinct_logits(T, E, dtype, seed=T * E + k)
    w, ids = _topk_softmax_triton(logits, k, weights_dtype)
    ref_w, ref_ids = select_experts_native(logits.cpu(), k, True, torch.float64)
    assert w.dtype == weights_dtype and ids.dtype == torch.int64 and w.shape == (T, k)
    assert torch.equal(ids.cpu(), ref_ids)
    tol = 1e-5 if weights_dtype == torch.float32 else 1e-2
    torch.testing.assert_close(w.cpu().double(), ref_w, atol=tol, rtol=tol)


@pytest.mark.filterwarnings("ignore:invalid value")  # -inf - -inf in the all -inf row
def test_kernel_ties_pick_the_lowest_ids_and_stay_distinct():
    logits = torch.tensor(
        [
            [1.0, 3.0, 3.0, 0.5, 3.0, -1.0],
            [float("-inf")] * 6,  # all equal: the first k
            [2.0, float("nan"), 2.0, 1.0, 0.0, 5.0],
        ],
        device=DEV,
    )
    w, ids = _topk_softmax_triton(logits, 3, torch.float32)
    ids = ids.cpu()
    assert ids[0].tolist() == [1, 2, 4]
    torch.testing.assert_close(w[0].cpu(), torch.full((3,), 1 / 3))
    assert ids[1].tolist() == [0, 1, 2]
    assert ids[2].tolist() == [5, 0, 2]  # NaN never ranks above a number here
    for row in ids:
        assert len(set(row.tolist())) == 3 and all(0 <= i < 6 for i in row.tolist())


@pytest.mark.parametrize("E, k", [(32, 4), (7, 3), (64, 8), (128, 4)])
def test_kernel_random_ties_nans_and_infs(E, k):
    """Logits from a handful of values (many ties), with NaN and +-inf sprinkled in: the ids
    follow (NaN last, larger first, lower id first) in both the ranked (E <= 64) and the
    rounds path, and the weights are the softmax of the chosen logits."""
    g = torch.Generator().manual_seed(E * 100 + k)
    T = 33
    vals = torch.tensor([-1.5, 0.0, 0.25, 2.0, float("inf"), float("-inf"), float("nan")])
    pick = torch.randint(0, 4, (T, E), generator=g)  # mostly numbers
    odd = torch.rand(T, E, generator=g) < 0.1
    pick[odd] = torch.randint(4, 7, (int(odd.sum()),), generator=g)
    logits = vals[pick]
    w, ids = _topk_softmax_triton(logits.to(DEV), k, torch.float32)
    w, ids = w.cpu().double(), ids.cpu()
    for t in range(T):
        row = logits[t].tolist()
        order = sorted(
            range(E), key=lambda i: (row[i] != row[i], -row[i] if row[i] == row[i] else 0, i)
        )
        assert ids[t].tolist() == order[:k], (t, row)
        chosen = torch.tensor([row[i] for i in order[:k]], dtype=torch.float64)
        if torch.isfinite(chosen).all():
            ref = torch.softmax(chosen, 0)
            torch.testing.assert_close(w[t], ref, atol=1e-6, rtol=1e-5)


def test_select_experts_checks_and_cpu_path():
    with pytest.raises(ValueError, match="top_k"):
        select_experts(torch.randn(2, 4), 5)
    with pytest.raises(ValueError, match="router_logits"):
        select_experts(torch.randn(8), 2)
    logits = torch.randn(4, 6)
    w, ids = select_experts(logits, 2, weights_dtype=torch.bfloat16)
    ref_w, ref_ids = select_experts_native(logits, 2)
    assert torch.equal(ids, ref_ids) and torch.equal(w, ref_w.bfloat16())


@gpu
def test_cuda_dispatch_and_graph_capture():
    logits = _distinct_logits(16, 32, torch.bfloat16, seed=1)
    w, ids = select_experts(logits, 4, weights_dtype=torch.bfloat16)
    ref_w, ref_ids = select_experts_native(logits, 4, True, torch.bfloat16)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(w.float(), ref_w.float(), atol=1e-2, rtol=1e-2)
    static = logits.clone()
    g = torch.cuda.CUDAGraph()
    select_experts(static, 4)  # warm up (compile) outside the capture
    torch.cuda.synchronize()
    with torch.cuda.graph(g):
        gw, gids = select_experts(static, 4)
    new = _distinct_logits(16, 32, torch.bfloat16, seed=2)
    static.copy_(new)
    g.replay()
    ref_w, ref_ids = select_experts_native(new, 4)
    assert torch.equal(gids, ref_ids)
    torch.testing.assert_close(gw, ref_w, atol=1e-5, rtol=1e-5)
