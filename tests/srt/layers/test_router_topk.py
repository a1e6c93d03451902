"""The fused router (srt/layers/moe/router_topk.py): logits, top-k routing and x's fp16 words in
one launch, against torch (float64 logits) and the unfused kernels' bits; the interpreter on
CPU, compiled on CUDA."""

import pytest
import torch

from sgl_ext.norm import fused_add_rmsnorm, fused_add_rmsnorm_native
from srt.layers.moe.fused_moe_triton.moe_x_f16 import x_to_f16
from srt.layers.moe.router_topk import (
    TicketCounts,
    add_rmsnorm_router_select_experts_x_f16,
    fused_route_fits,
    router_select_experts_x_f16,
)
from srt.layers.moe.topk import select_experts_native

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _exact_problem(T, E, H, seed):
    """x, W, bias of small integers and halves: every logit is exact in float32 and in bf16,
    and a token's logits are distinct (torch's top-k order is defined)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-3, 4, (T, H), generator=g).float() * 0.5
    w = torch.zeros(E, H)
    for e in range(E):  # expert e sees a few distinct columns
        cols = torch.randperm(H, generator=g)[:4]
        w[e, cols] = torch.randint(-2, 3, (4,), generator=g).float()
    bias = torch.randperm(E, generator=g).float() * 16  # spreads logits: distinct per token
    return (t.to(DEV, torch.bfloat16) for t in (x, w, bias))


@pytest.mark.parametrize(
    "T, E, k, H", [(1, 32, 4, 64), (7, 32, 4, 96), (3, 8, 2, 32), (2, 5, 3, 64)]
)
def test_matches_torch_routing_and_words(T, E, k, H):
    x, w, bias = _exact_problem(T, E, H, seed=T * 100 + E)
    counts = TicketCounts().get(T, x.device)
    weights, ids, xf = router_select_experts_x_f16(
        x, w, bias, k, counts, weights_dtype=torch.bfloat16
    )
    logits = x.double().cpu() @ w.double().cpu().T + bias.double().cpu()  # exact
    ref_w, ref_ids = select_experts_native(logits, k, True, torch.float64)
    assert ids.dtype == torch.int64 and torch.equal(ids.cpu(), ref_ids)
    torch.testing.assert_close(weights.cpu().double(), ref_w, atol=1e-2, rtol=1e-2)
    ref_xf = x_to_f16(x)  # the unfused conversion kernel: the same words bit for bit
    assert torch.equal(xf.words, ref_xf.words) and torch.equal(xf.inv, ref_xf.inv)
    assert not counts.any()  # left zero for the next launch


@pytest.mark.parametrize("T, bias", [(1, True), (7, False)])
def test_random_weights_route_the_float64_top_k(T, bias):
    """Random bf16 x and W: the chosen experts are the float64 top k (up to a logit's bf16
    rounding), the weights their softmax; a second launch on the same counters agrees."""
    E, k, H = 32, 4, 2880
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, H, generator=g).to(DEV, torch.bfloat16)
    w = (torch.randn(E, H, generator=g) * 0.05).to(DEV, torch.bfloat16)
    b = torch.randn(E, generator=g).to(DEV, torch.bfloat16) if bias else None
    counts = TicketCounts().get(T, x.device)
    weights, ids, _ = router_select_experts_x_f16(x, w, b, k, counts, weights_dtype=torch.float32)
    ref = x.double().cpu() @ w.double().cpu().T
    if b is not None:
        ref += b.double().cpu()
    chosen = ref.gather(1, ids.cpu())
    kth = ref.topk(k, dim=1).values[:, -1:]
    tol = 2e-2 * ref.abs().amax()  # the logits are rounded to bf16 before the routing
    assert (chosen >= kth - tol).all()
    torch.testing.assert_close(
        weights.cpu().double(), torch.softmax(chosen, dim=1), atol=2e-2, rtol=2e-2
    )
    again_w, again_ids, _ = router_select_experts_x_f16(
        x, w, b, k, counts, weights_dtype=torch.float32
    )
    assert torch.equal(again_ids, ids) and torch.equal(again_w, weights)


def test_bad_arguments_raise_before_launch():
    x = torch.randn(2, 64).to(DEV, torch.bfloat16)
    w = torch.randn(8, 64).to(DEV, torch.bfloat16)
    good = TicketCounts().get(2, x.device)
    with pytest.raises(ValueError, match="counts"):
        router_select_experts_x_f16(x, w, None, 2, good.long(), weights_dtype=torch.float32)
    with pytest.raises(ValueError, match="counts"):
        router_select_experts_x_f16(x, w, None, 2, good[:1], weights_dtype=torch.float32)
    with pytest.raises(ValueError, match="bias"):
        router_select_experts_x_f16(x, w, w[0], 2, good, weights_dtype=torch.float32)
    with pytest.raises(ValueError, match="fused_route_fits"):
        router_select_experts_x_f16(x, w, None, 9, good, weights_dtype=torch.float32)
    assert not fused_route_fits(x[:, :48], w[:, :48], 2)  # H % 32
    assert not fused_route_fits(x.float(), w, 2)
    assert not fused_route_fits(torch.randn(33, 64).to(DEV, torch.bfloat16), w, 2)
    assert not good.any()


def test_ticket_counts_keep_buffers_per_power_of_two():
    tc = TicketCounts()
    a, b = tc.get(5, torch.device("cpu")), tc.get(7, torch.device("cpu"))
    assert a.shape == (5,) and b.shape == (7,) and a.data_ptr() == b.data_ptr()
    assert tc.get(9, torch.device("cpu")).data_ptr() != a.data_ptr()


@gpu
def test_graph_replay_equals_eager_and_unfused_routing():
    """Captured once, replayed on new x: the same bits as an eager call, and the same ids and
    weights as the router GEMM + routing kernel when the logits agree."""
    from srt.layers.moe.topk import select_experts_x_f16

    T, E, k, H = 8, 32, 4, 2880
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(E, H, device="cuda", dtype=torch.bfloat16) * 0.05
    b = torch.randn(E, device="cuda", dtype=torch.bfloat16)
    tc = TicketCounts()
    route = router_select_experts_x_f16
    route(x, w, b, k, tc.get(T, x.device), weights_dtype=torch.bfloat16)  # compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gw, gids, gxf = route(x, w, b, k, tc.get(T, x.device), weights_dtype=torch.bfloat16)
    for seed in range(3):
        x.copy_(
            torch.randn(T, H, device="cuda", generator=torch.Generator("cuda").manual_seed(seed))
        )
        graph.replay()
        ew, eids, exf = route(x, w, b, k, tc.get(T, x.device), weights_dtype=torch.bfloat16)
        torch.cuda.synchronize()
        assert torch.equal(gw, ew) and torch.equal(gids, eids)
        assert torch.equal(gxf.words, exf.words) and torch.equal(gxf.inv, exf.inv)
        uw, uids, uxf = select_experts_x_f16(
            torch.nn.functional.linear(x, w, b), k, x, weights_dtype=torch.bfloat16
        )
        assert torch.equal(uxf.words, exf.words) and torch.equal(uxf.inv, exf.inv)
        same = (uids == eids).all(dim=1)  # cuBLAS may round a logit differently
        assert same.float().mean() >= 0.75
        assert torch.equal(uw[same], ew[same])


def _norm_problem(T, H, E, seed):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(T, H, generator=g).to(DEV, torch.bfloat16)
    r = (torch.randn(T, H, generator=g) * 4).to(DEV, torch.bfloat16)
    nw = (1 + 0.3 * torch.randn(H, generator=g)).to(DEV)  # float32, as gpt-oss keeps it
    w = (torch.randn(E, H, generator=g) * 0.05).to(DEV, torch.bfloat16)
    b = torch.randn(E, generator=g).to(DEV, torch.bfloat16)
    return h, r, nw, w, b


@pytest.mark.parametrize("T, H", [(1, 2880), (7, 2880), (3, 96)])
def test_add_norm_variant_is_the_norm_then_the_router(T, H):
    """The residual add + RMSNorm inside the router launch: residual takes hidden + residual
    exactly, the normalised row is fused_add_rmsnorm's (float32 weight) to bf16 rounding, and
    the routing and fp16 words are the plain fused router's on that row, bit for bit."""
    E, k, eps = 32, 4, 1e-5
    h, r, nw, w, b = _norm_problem(T, H, E, seed=T + H)
    h0, r0 = h.clone(), r.clone()
    counts = TicketCounts().get(T, h.device)
    out = add_rmsnorm_router_select_experts_x_f16(
        h, r, nw, eps, w, b, k, counts, weights_dtype=torch.bfloat16
    )
    ref_x, ref_sum = fused_add_rmsnorm_native(h0, r0, nw, eps, weight_in_fp32=True)
    assert torch.equal(r, ref_sum) and torch.equal(h, h0)  # hidden is not written
    assert out.x.dtype == torch.bfloat16 and out.x.shape == (T, H)
    torch.testing.assert_close(out.x.double(), ref_x.double(), atol=1e-2, rtol=1e-2)
    again = TicketCounts().get(T, h.device)
    rw, rids, rxf = router_select_experts_x_f16(out.x, w, b, k, again, weights_dtype=torch.bfloat16)
    assert torch.equal(out.ids, rids) and torch.equal(out.weights, rw)
    assert torch.equal(out.x_f16.words, rxf.words) and torch.equal(out.x_f16.inv, rxf.inv)
    assert not counts.any()


def test_add_norm_bad_arguments_raise_before_launch():
    T, H, E = 2, 64, 8
    h, r, nw, w, b = _norm_problem(T, H, E, seed=5)
    r0 = r.clone()
    counts = TicketCounts().get(T, h.device)
    call = add_rmsnorm_router_select_experts_x_f16
    with pytest.raises(ValueError, match="residual"):
        call(h, r[:1], nw, 1e-5, w, b, 2, counts, weights_dtype=torch.float32)
    with pytest.raises(ValueError, match="residual"):
        call(h, r.float(), nw, 1e-5, w, b, 2, counts, weights_dtype=torch.float32)
    with pytest.raises(ValueError, match="residual"):
        call(h, r.t().contiguous().t(), nw, 1e-5, w, b, 2, counts, weights_dtype=torch.float32)
    with pytest.raises(ValueError, match="norm_weight"):
        call(h, r, nw[:-1], 1e-5, w, b, 2, counts, weights_dtype=torch.float32)
    with pytest.raises(ValueError, match="norm_weight"):
        call(h, r, nw.int(), 1e-5, w, b, 2, counts, weights_dtype=torch.float32)
    with pytest.raises(ValueError, match="bias"):
        call(h, r, nw, 1e-5, w, w[0], 2, counts, weights_dtype=torch.float32)
    assert torch.equal(r, r0) and not counts.any()


@gpu
def test_add_norm_variant_graph_equals_eager_and_norm_kernel():
    """Captured once, replayed on new inputs: the eager call's bits; the normalised row against
    the fused_add_rmsnorm kernel's (the sum of squares may add in another order: bf16 ulps)."""
    T, E, k, H = 4, 32, 4, 2880
    h, r, nw, w, b = _norm_problem(T, H, E, seed=11)
    hs, rs = h.clone(), r.clone()
    tc = TicketCounts()
    call = add_rmsnorm_router_select_experts_x_f16
    call(h.clone(), r.clone(), nw, 1e-5, w, b, k, tc.get(T, h.device), weights_dtype=h.dtype)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g = call(hs, rs, nw, 1e-5, w, b, k, tc.get(T, h.device), weights_dtype=h.dtype)
    for seed in range(3):
        gen = torch.Generator("cuda").manual_seed(seed)
        h_new = torch.randn(T, H, device="cuda", generator=gen).to(torch.bfloat16)
        r_new = torch.randn(T, H, device="cuda", generator=gen).to(torch.bfloat16) * 4
        hs.copy_(h_new)
        rs.copy_(r_new)
        graph.replay()
        r_eager = r_new.clone()
        e = call(h_new, r_eager, nw, 1e-5, w, b, k, tc.get(T, h.device), weights_dtype=h.dtype)
        torch.cuda.synchronize()
        assert torch.equal(g.x, e.x) and torch.equal(rs, r_eager)
        assert torch.equal(g.ids, e.ids) and torch.equal(g.weights, e.weights)
        assert torch.equal(g.x_f16.words, e.x_f16.words)
        kx, ks = fused_add_rmsnorm(h_new, r_new, nw, 1e-5, weight_in_fp32=True, inplace=False)
        assert torch.equal(ks, r_eager)
        torch.testing.assert_close(e.x.float(), kx.float(), atol=0, rtol=2**-7)
