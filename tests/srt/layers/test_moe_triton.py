"""Triton routed-expert MoE: the alignment by expert, the grouped GEMMs against a float64
reference and the torch layer, TP shards, argument checks; on CUDA: bigger shapes, every launch
configuration and CUDA-graph replay with new routings."""

import dataclasses

import pytest
import torch

from srt.layers.moe import TopKExperts
from srt.layers.moe.fused_moe_triton import config as moe_config
from srt.layers.moe.fused_moe_triton.fused_moe import (
    SHARED_MEMORY_BUDGET,
    fused_experts,
    get_config,
)
from srt.layers.moe.fused_moe_triton.moe_align_block_size import (
    max_num_blocks,
    moe_align_block_size,
)
from srt.layers.moe.fused_moe_triton.moe_sum import moe_sum
from srt.layers.moe.topk_pairs import TopKPairs

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# The kernel tests run the compiled kernels on CUDA when present, else the interpreter on CPU.
DEV = "cuda" if torch.cuda.is_available() else "cpu"

ALPHA, LIMIT = 1.5, 0.8  # small limit: the clamps are exercised


def _ref(x, w13, b13, w2, b2, weights, ids, act="swiglu_oai", alpha=ALPHA, limit=LIMIT):
    """float64 [T, H]: sum over j of weights[t, j] * expert(ids[t, j])(x[t])."""
    x, w13, w2 = x.double(), w13.double(), w2.double()
    out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    inter = w2.shape[-1]
    for e in ids.unique().tolist():
        tok, slot = torch.where(ids == e)
        h = x[tok] @ w13[e].T  # [n, 2I]
        if b13 is not None:
            h = h + b13[e].double()
        g, u = h[:, :inter], h[:, inter:]
        if act == "silu":
            a = torch.nn.functional.silu(g) * u
        else:
            g, u = g.clamp(max=limit), u.clamp(-limit, limit)
            a = (u + 1) * g * torch.sigmoid(alpha * g)
        y = a @ w2[e].T  # [n, H]
        if b2 is not None:
            y = y + b2[e].double()
        out.index_add_(0, tok, y * weights[tok, slot, None].double())
    return out


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _problem(T, E, H, inter, k, dtype=torch.float32, device="cpu", seed=0, bias=True, ids=None):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s, scale=1.0: (torch.randn(s, generator=g) * scale).to(dtype).to(device)
    x = r(T, H)
    w13, w2 = r(E, 2 * inter, H, scale=H**-0.5), r(E, H, inter, scale=inter**-0.5)
    b13, b2 = (r(E, 2 * inter), r(E, H)) if bias else (None, None)
    if ids is None:
        ids = torch.rand(T, E, generator=g).argsort(-1)[:, :k]  # k distinct experts per token
    weights = torch.softmax(torch.randn(T, ids.shape[1], generator=g), -1)
    return x, w13, b13, w2, b2, weights.to(device), ids.to(device)


@pytest.mark.parametrize("T, E, k, block_m", [(1, 5, 2, 16), (7, 4, 3, 16), (33, 9, 2, 32)])
def test_align_groups_every_pair_once_by_expert(T, E, k, block_m):
    ids = torch.randint(0, E, (T, k), generator=torch.Generator().manual_seed(T))
    ids[0, :] = 1  # same expert twice for one token, and for several tokens
    a = moe_align_block_size(ids.to(DEV), E, block_m)
    a = dataclasses.replace(
        a,
        sorted_token_ids=a.sorted_token_ids.cpu(),
        expert_ids=a.expert_ids.cpu(),
        num_tokens_post_padded=a.num_tokens_post_padded.cpu(),
    )
    n = T * k
    assert a.max_blocks == max_num_blocks(n, E, block_m)
    sorted_ids = a.sorted_token_ids.view(-1, block_m)  # [blocks, block_m]
    counts = torch.bincount(ids.flatten(), minlength=E)
    used = int(((counts + block_m - 1) // block_m * block_m).sum())
    assert int(a.num_tokens_post_padded) == used
    nb = used // block_m
    assert (a.expert_ids[nb:] == -1).all() and (sorted_ids[nb:] == n).all()
    real = sorted_ids[:nb][sorted_ids[:nb] < n]
    assert sorted(real.tolist()) == list(range(n))  # every pair exactly once
    assert (sorted_ids[:nb] <= n).all()
    for b in range(nb):
        e = int(a.expert_ids[b])
        pairs = sorted_ids[b][sorted_ids[b] < n].long()
        assert (ids.flatten()[pairs] == e).all()
    order = a.expert_ids[:nb].tolist()
    assert order == sorted(order) and set(order) == set(ids.flatten().tolist())
    for e in range(E):  # pair order kept within an expert
        rows = sorted_ids[:nb][a.expert_ids[:nb] == e]
        rows = rows[rows < n]
        assert rows.tolist() == sorted(rows.tolist())


@pytest.mark.parametrize(
    "T, E, H, inter, k",
    [(1, 5, 40, 24, 2), (7, 4, 33, 17, 3), (33, 9, 48, 16, 2)],  # bs 1, odd sizes, idle experts
)
def test_fused_experts_match_float64_reference_fp32(T, E, H, inter, k):
    x, w13, b13, w2, b2, wts, ids = _problem(T, E, H, inter, k, device=DEV, seed=T)
    out = fused_experts(x, w13, w2, wts, ids, b13, b2, swiglu_alpha=ALPHA, swiglu_limit=LIMIT)
    ref = _ref(x, w13, b13, w2, b2, wts, ids)
    assert out.dtype == torch.float32 and out.shape == (T, H)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-5)


def test_repeated_expert_per_token_silu_no_bias_int32_ids():
    """A token routed twice to one expert counts twice; silu, no biases, int32 ids."""
    ids = torch.tensor([[2, 2], [0, 2], [2, 0]], dtype=torch.int32)
    x, w13, b13, w2, b2, wts, ids = _problem(3, 6, 24, 20, 2, device=DEV, bias=False, ids=ids)
    out = fused_experts(x, w13, w2, wts, ids, activation="silu")
    torch.testing.assert_close(
        out.double(), _ref(x, w13, None, w2, None, wts, ids, "silu"), atol=2e-5, rtol=1e-5
    )


def _bf16_layer(T: int, E: int, H: int, inter: int, k: int, seed: int):
    """A bf16 TopKExperts (tp 1) holding _problem's weights, and that problem."""
    m = TopKExperts(E, H, inter, swiglu_alpha=ALPHA, swiglu_limit=LIMIT, tp_rank=0, tp_size=1)
    prob = _problem(T, E, H, inter, k, torch.bfloat16, DEV, seed=seed)
    m.to(device=DEV, dtype=torch.bfloat16)
    params = (m.w13_weight, m.w13_bias, m.w2_weight, m.w2_bias)
    for p, v in zip(params, prob[1:5], strict=True):
        p.data.copy_(v)
    return m, prob


def test_bf16_matches_reference_and_torch_layer():
    m, (x, w13, b13, w2, b2, wts, ids) = _bf16_layer(9, 6, 64, 32, 2, seed=3)
    m.moe_runner_backend = "torch"
    torch_out = m(x, wts.bfloat16(), ids)
    m.moe_runner_backend = "triton"
    out = m(x, wts.bfloat16(), ids)
    assert out.dtype == torch.bfloat16
    ref = _ref(x, w13, b13, w2, b2, wts.bfloat16(), ids)
    assert _rel(out, ref) < 1e-2 and _rel(torch_out, ref) < 1e-2
    assert _rel(out, torch_out) < 2e-2


def test_layer_hands_over_pair_rows_uncombined():
    """combine=False (tp 1, Triton path): TopKPairs whose combine() has the combined call's
    bits; the torch path and tp > 1 always combine."""
    T, H, k = 5, 64, 3
    m, (x, _, _, _, _, wts, ids) = _bf16_layer(T, 6, H, 32, k, seed=4)
    m.moe_runner_backend = "triton"
    pairs = m(x, wts.bfloat16(), ids, combine=False)
    assert isinstance(pairs, TopKPairs) and pairs.top_k == k
    assert pairs.rows.shape == (T * k, H) and pairs.rows.dtype == torch.bfloat16
    assert torch.equal(pairs.combine(), m(x, wts.bfloat16(), ids))
    m.moe_runner_backend = "torch"
    assert isinstance(m(x, wts.bfloat16(), ids, combine=False), torch.Tensor)


def test_tp_shards_sum_to_full_and_down_bias_counts_once():
    E, H, full_i, T, k = 4, 24, 32, 5, 2
    x, w13, b13, w2, b2, wts, ids = _problem(T, E, H, full_i, k, device=DEV, seed=5)
    ref = _ref(x, w13, b13, w2, b2, wts, ids)
    total = torch.zeros(T, H, dtype=torch.float64, device=DEV)
    for r in range(2):
        m = TopKExperts(E, H, full_i, swiglu_alpha=ALPHA, swiglu_limit=LIMIT, tp_rank=r, tp_size=2)
        m = m.to(DEV)
        m.moe_runner_backend, m.reduce_results = "triton", False
        for p, v in zip(
            (m.w13_weight, m.w13_bias, m.w2_weight, m.w2_bias), (w13, b13, w2, b2), strict=True
        ):
            m.weight_loader(p, v)
        total += m(x, wts, ids).double()
    torch.testing.assert_close(total, ref, atol=2e-5, rtol=1e-5)


def test_bad_arguments_raise_before_launch():
    x, w13, b13, w2, b2, wts, ids = _problem(3, 4, 16, 8, 2)
    with pytest.raises(ValueError, match="w2"):
        fused_experts(x, w13, w2[:, :, :4].contiguous(), wts, ids)
    with pytest.raises(TypeError, match="topk_ids"):
        fused_experts(x, w13, w2, wts, ids.float())
    with pytest.raises(ValueError, match="topk_weights"):
        fused_experts(x, w13, w2, wts[:, :1], ids)
    with pytest.raises(TypeError, match="dtype"):
        fused_experts(x.double(), w13, w2, wts, ids)
    with pytest.raises(ValueError, match="activation"):
        fused_experts(x, w13, w2, wts, ids, activation="gelu")
    with pytest.raises(ValueError, match="w13_bias"):
        fused_experts(x, w13, w2, wts, ids, b13[:, :3], b2)
    with pytest.raises(ValueError, match="moe_runner_backend"):
        TopKExperts(2, 4, 2, moe_runner_backend="cuda", tp_rank=0, tp_size=1)


def test_config_table_covers_every_token_count():
    table = moe_config.moe_table()
    for rows in (moe_config.MOE_CONFIGS, moe_config.MXFP4_CONFIGS):
        assert rows[0].first == 1 and rows[-1].last is None
        assert all(
            a.last is not None and a.last + 1 == b.first
            for a, b in zip(rows, rows[1:], strict=False)
        )
    cuda = torch.device("cuda")
    for T in (1, 8, 32, 64, 512, 4096, 1 << 20):
        for mx in (False, True):
            cfg = get_config(T, cuda, mxfp4=mx)
            assert cfg.block_m in (16, 32, 64, 128)
            experts = "mxfp4" if mx else "bf16"
            rows = table.rows_for(cuda)  # this GPU's own rows first
            want = next(r.config for r in rows if r.experts == experts and r.covers(T))
            assert cfg == want  # bf16: the table as measured
            for dtype in (torch.bfloat16, torch.float32):  # pipelined tiles fit in shared memory
                c = get_config(T, cuda, dtype, mxfp4=mx)
                assert c.mxfp4_mode == (
                    "split" if mx and dtype == torch.float32 else cfg.mxfp4_mode
                )
                w_size = 0.5 if mx else dtype.itemsize
                for g, mats in ((c.gate_up, 2), (c.down, 1)):
                    per_k = c.block_m * dtype.itemsize + mats * g.block_n * w_size
                    assert g.num_stages * g.block_k * per_k <= SHARED_MEMORY_BUDGET, (T, dtype, g)
                    assert not mx or g.block_k % 32 == 0


# ----------------------------------------------------------------------------- CUDA


@gpu
@pytest.mark.parametrize("T", [1, 7, 20, 64, 300, 2048])  # every config of the table
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_matches_reference(T, dtype):
    E, H, inter, k = 8, 256, 192, 4  # 192: the uneven-K path of 128-wide K blocks
    x, w13, b13, w2, b2, wts, ids = _problem(T, E, H, inter, k, dtype, "cuda", seed=T)
    ids[0, :2] = 3  # a repeated expert
    out = fused_experts(x, w13, w2, wts, ids, b13, b2, swiglu_alpha=ALPHA, swiglu_limit=LIMIT)
    ref = _ref(x, w13, b13, w2, b2, wts, ids)
    assert _rel(out, ref) < (1e-5 if dtype == torch.float32 else 1e-2), (T, dtype)


def graph_replay_equals_eager(run, x, wts, ids, num_experts, steps, seed, check=None) -> None:
    """Captures run() (fused_experts over x, wts, ids) in a CUDA graph, then for each step: a
    new routing (random experts, some idle, expert `step` shared by every token), new weights
    and x; the replay (output poisoned first) must equal an eager run bit for bit; check(out)
    after, if given."""
    T, k = ids.shape
    run()  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = run()
    g = torch.Generator().manual_seed(seed)
    for step in range(steps):
        new_ids = torch.rand(T, num_experts, generator=g).argsort(-1)[:, :k]
        new_ids[:, 0] = step
        ids.copy_(new_ids)
        wts.copy_(torch.softmax(torch.randn(T, k, generator=g), -1))
        x.copy_(torch.randn(x.shape, generator=g))
        static_out.fill_(float("nan"))
        graph.replay()
        eager = run()
        torch.cuda.synchronize()
        assert torch.equal(static_out, eager), f"step {step}: replay != eager"
        if check is not None:
            check(static_out)


@gpu
@pytest.mark.parametrize("T", [1, 8, 64])
def test_gpu_graph_replay_with_new_routings(T):
    E, H, inter, k = 32, 384, 256, 4
    x, w13, b13, w2, b2, wts, ids = _problem(T, E, H, inter, k, torch.bfloat16, "cuda", seed=1)

    def run():
        return fused_experts(x, w13, w2, wts, ids, b13, b2, swiglu_alpha=ALPHA, swiglu_limit=LIMIT)

    def check(out):
        assert _rel(out, _ref(x, w13, b13, w2, b2, wts, ids)) < 1e-2

    graph_replay_equals_eager(run, x, wts, ids, E, steps=4, seed=T, check=check)


@gpu
def test_gpu_layer_uses_triton_and_matches_torch_path():
    E, H, inter, T, k = 8, 128, 64, 40, 2
    m = TopKExperts(E, H, inter, swiglu_alpha=ALPHA, swiglu_limit=LIMIT, tp_rank=0, tp_size=1)
    m = m.to("cuda")
    x, w13, b13, w2, b2, wts, ids = _problem(T, E, H, inter, k, torch.float32, "cuda", seed=2)
    for p, v in zip(
        (m.w13_weight, m.w13_bias, m.w2_weight, m.w2_bias), (w13, b13, w2, b2), strict=True
    ):
        p.data.copy_(v)
    assert m.uses_triton(x)
    out = m(x, wts, ids)
    m.moe_runner_backend = "torch"
    torch.testing.assert_close(out, m(x, wts, ids), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "T, k, H, dtype", [(1, 4, 2880, torch.bfloat16), (7, 2, 33, torch.float32)]
)
def test_moe_sum_adds_each_tokens_pairs_in_order(T, k, H, dtype):
    """The top-k combine: float32 sum of a token's k rows in pair order, one rounding (bit-exact
    against the same float32 order on CUDA); odd H and H over one 1024-wide block."""
    g = torch.Generator().manual_seed(T * H + k)
    pairs = torch.randn(T * k, H, generator=g).to(dtype).to(DEV)
    out = moe_sum(pairs, T, k)
    ref = torch.zeros(T, H, dtype=torch.float32)
    for j in range(k):
        ref += pairs.view(T, k, H)[:, j].float().cpu()
    assert out.dtype == dtype and out.shape == (T, H)
    assert torch.equal(out.cpu(), ref.to(dtype))  # rounded to nearest even (the interpreter too)
