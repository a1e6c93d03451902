"""Cascade decode attention (prefix_decode.py): groups of requests that share their first
prefix_len KV slots, the prefix read once per work item, against the float64 reference and the
kernel without a cascade on the same inputs. TRITON_INTERPRET=1 on CPU: small shapes."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from srt.layers.attention.triton_backend import KVArgs
from srt.layers.attention.triton_ops.decode_attention import (
    decode_attention_fwd,
    decode_scratch_shape,
    launch_decode,
    plan_decode,
)
from srt.layers.attention.triton_ops.kv_load import (
    KV_FP8_E4M3,
    KV_FP8_E5M2,
    KV_FP8_NONE,
    SCALE_FLOAT,
    SCALE_NONE,
    SCALE_PTR,
)
from srt.layers.attention.triton_ops.prefix_decode import (
    CASCADE_ROWS_PER_ITEM,
    MAX_CASCADE_SPLITS,
    CascadeArgs,
    PrefixConfig,
    cascade_splits,
    prefix_config,
)
from tests.conftest import gpu
from tests.srt.layers.attention.attn_reference import ref_attention

DEV = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = {torch.float8_e4m3fn: KV_FP8_E4M3, torch.float8_e5m2: KV_FP8_E5M2}


@dataclass
class Problem:
    q: torch.Tensor  # [B, Hq, D]
    kv: KVArgs
    k_ref: torch.Tensor  # float64 [slots, Hkv, D]: what the cache holds, dequantised
    v_ref: torch.Tensor
    req_to_token: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    cascade: CascadeArgs
    sinks: torch.Tensor | None


def _problem(
    B,
    hq,
    hkv,
    d,
    groups,
    *,
    page_size=1,
    dtype=torch.float32,
    kv_dtype=None,
    scale=None,
    sinks=False,
    rows_per_item=CASCADE_ROWS_PER_ITEM,
    unused_items=2,
    seed=0,
    device=DEV,
) -> Problem:
    """B requests; groups: [(rows, prefix_len)] of requests sharing their first prefix_len
    slots (the other rows share nothing). Slots are whole pages in shuffled order; one row of
    the first group has prefix_len == seq_len - 1; the second group's items name a request
    outside the batch (the tree's copy of the prefix) as their req_pool_index."""
    g = torch.Generator().manual_seed(seed)
    kv_dtype = kv_dtype or dtype
    ps = page_size
    perm = torch.randperm(B, generator=g).tolist()
    members, taken = [], 0
    for n, plen in groups:
        assert plen % ps == 0 and taken + n <= B
        members.append((perm[taken : taken + n], plen))
        taken += n
    prefix = [0] * B
    for rows, plen in members:
        for r in rows:
            prefix[r] = plen
    own = [int(torch.randint(1, 40, (), generator=g)) for _ in range(B)]
    if members:
        own[members[0][0][0]] = 1  # prefix_len == seq_len - 1
    seq = [p + o for p, o in zip(prefix, own, strict=True)]
    pages_needed = sum(-(-p // ps) for _, p in members) + sum(-(-o // ps) for o in own) + 1
    pages = (torch.randperm(pages_needed, generator=g) + 1).tolist()  # page 0: unused
    max_ctx = max(seq) + 3
    req_of_row = [B + 1 - r for r in range(B)]  # request pool rows, not the batch order
    r2t = torch.zeros(B + 4, max_ctx, dtype=torch.int32)

    def take(n):
        out = []
        for _ in range(-(-n // ps)):
            p = pages.pop()
            out += [p * ps + i for i in range(ps)]
        return torch.tensor(out[:n], dtype=torch.int32)

    owner = {}
    for gi, (rows, plen) in enumerate(members):
        shared = take(plen)
        for r in rows:
            r2t[req_of_row[r], :plen] = shared
        owner[gi] = B + 2 if gi == 1 else req_of_row[rows[-1]]
        r2t[owner[gi], :plen] = shared
    for r in range(B):
        r2t[req_of_row[r], prefix[r] : seq[r]] = take(own[r])
    num_slots = (pages_needed + 1) * ps
    q = torch.randn(B, hq, d, generator=g).to(dtype)
    k = torch.randn(num_slots, hkv, d, generator=g)
    v = torch.randn(num_slots, hkv, d, generator=g)
    s = 1.0 if scale is None else float(scale)
    if kv_dtype in FP8:
        k8, v8 = (x.div(s).to(kv_dtype) for x in (k, v))
        k_ref, v_ref = (x.double() * s for x in (k8, v8))
        kbuf, vbuf = k8.view(torch.uint8), v8.view(torch.uint8)
    else:
        kbuf, vbuf = k.to(kv_dtype), v.to(kv_dtype)
        k_ref, v_ref = kbuf.double(), vbuf.double()
    if ps > 1:
        kbuf = kbuf.view(-1, ps, hkv, d)
        vbuf = vbuf.view(-1, ps, hkv, d)
    kbuf, vbuf = kbuf.to(device), vbuf.to(device)
    st = (kbuf.stride(0), 0, kbuf.stride(1)) if ps == 1 else kbuf.stride()[:3]
    fp8 = FP8.get(kv_dtype, KV_FP8_NONE)
    mode, ptr, sf = SCALE_NONE, kbuf, 1.0
    if fp8 != KV_FP8_NONE and isinstance(scale, torch.Tensor):
        mode, ptr = SCALE_PTR, scale.to(device)
    elif fp8 != KV_FP8_NONE and scale is not None:
        mode, sf = SCALE_FLOAT, float(scale)
    kv = KVArgs(kbuf, vbuf, ps, st, st, fp8, mode, mode, ptr, ptr, sf, sf)
    # work items: each group cut into items of at most rows_per_item rows, in shuffled order,
    # with unused items (prefix_len 0) that name real rows after them
    items, order = [], []
    for gi, (rows, plen) in enumerate(members):
        for i in range(0, len(rows), rows_per_item):
            chunk = rows[i : i + rows_per_item]
            items.append((len(order), len(order) + len(chunk), plen, owner[gi]))
            order += chunk
    items = [items[i] for i in torch.randperm(len(items), generator=g).tolist()]
    for i in range(unused_items):
        stale = items[0][:2] if items else (0, min(B, 3))
        items.insert(2 * i + 1, (*stale, 0, 0))
    order += [r for r in range(B) if prefix[r] == 0]
    cascade = CascadeArgs(
        torch.tensor(prefix, dtype=torch.int32, device=device),
        torch.tensor(order + [0, 0], dtype=torch.int32, device=device),  # [>= B]
        torch.tensor(items, dtype=torch.int32, device=device).view(-1, 4),
    )
    return Problem(
        q.to(device),
        kv,
        k_ref,
        v_ref,
        r2t.to(device),
        torch.tensor(req_of_row, device=device),
        torch.tensor(seq, device=device),
        cascade,
        torch.randn(hq, generator=g).to(device) if sinks else None,
    )


def _reference(p: Problem, cap: float) -> torch.Tensor:
    B, hq, d = p.q.shape
    out = []
    for b in range(B):
        n = int(p.seq_lens[b])
        slots = p.req_to_token[p.req_pool_indices[b], :n].long().cpu()
        sinks = None if p.sinks is None else p.sinks.cpu()
        qpos = torch.tensor([n - 1])
        q = p.q[b : b + 1].cpu()
        out.append(ref_attention(q, p.k_ref[slots], p.v_ref[slots], qpos, d**-0.5, -1, cap, sinks))
    return torch.cat(out)  # [B, Hq, D] float64


def _run(p: Problem, splits, P, cap=0.0, cfg=None, poison=True):
    """The decode launch with (P > 0) or without a cascade; o and the whole scratch poisoned
    first (NaN partial outputs, huge log-sum-exps)."""
    B, hq, d = p.q.shape
    o = torch.full_like(p.q, float("nan"))
    slots = splits + P
    shape = decode_scratch_shape(B, hq, d, slots)
    mid_o = torch.full(shape, float("nan"), device=p.q.device)
    mid_lse = torch.full(shape[:3], 1e30 if poison else 0.0, device=p.q.device)
    plan = plan_decode(
        p.q, o, p.req_to_token, d**-0.5, p.kv, p.sinks is not None, -1, cap, splits, None, P, cfg
    )
    args = (p.req_to_token, p.req_pool_indices, p.seq_lens, p.kv, p.sinks)
    launch_decode(plan, p.q, o, *args, mid_o, mid_lse, p.cascade if P else None)
    return o


def _check(p: Problem, splits, P, cap=0.0, cfg=None):
    tol = 2e-5 if p.q.dtype == torch.float32 else 2e-2
    if p.kv.fp8 != KV_FP8_NONE:  # TF32 dots on the dequantised float32 tiles
        tol = max(tol, 2e-3)
    got = _run(p, splits, P, cap, cfg)
    plain = _run(p, splits, 0, cap)
    assert not got.isnan().any()
    ref = _reference(p, cap)
    torch.testing.assert_close(got.cpu().double(), ref, atol=tol, rtol=tol)
    torch.testing.assert_close(got, plain, atol=tol, rtol=tol)


@pytest.mark.parametrize(
    "case",
    [
        # B 7, GQA 4, page 1, fp32: prefixes of 37 (not a multiple of BLOCK_N) and 70 keys;
        # one split with sinks (the merge adds the sink, not stage 1)
        dict(B=7, hq=8, hkv=2, groups=[(3, 37), (2, 70)], splits=1, P=2, sinks=True),
        # B 33, GQA 6 (padded to 8), page 16, bf16, sinks, 4 stage-1 splits, 3 groups
        dict(
            B=33,
            hq=6,
            hkv=1,
            groups=[(9, 48), (5, 80), (2, 16)],
            page_size=16,
            dtype=torch.bfloat16,
            sinks=True,
            splits=4,
            P=1,
        ),
        # B 1: a group of one; fp8 E4M3 with a float scale, logit cap
        dict(
            B=1,
            hq=4,
            hkv=1,
            groups=[(1, 96)],
            page_size=16,
            dtype=torch.bfloat16,
            kv_dtype=torch.float8_e4m3fn,
            scale=0.5,
            cap=4.0,
            splits=1,
            P=4,
        ),
        # items of 5 rows over tiles of 2 (row blocks looped in the program), 16-key tiles;
        # fp8 E5M2 with a scale tensor; GQA 1
        dict(
            B=12,
            hq=2,
            hkv=2,
            groups=[(11, 45)],
            dtype=torch.float16,
            kv_dtype=torch.float8_e5m2,
            scale="tensor",
            rows_per_item=5,
            cfg=PrefixConfig(2, 16, 4, 1),
            splits=4,
            P=2,
        ),
        # no group at all (every item unused): the prefix slots never count
        dict(B=5, hq=4, hkv=1, groups=[], splits=2, P=2, sinks=True),
    ],
    ids=["b7-gqa4-fp32", "b33-gqa6-bf16-page16", "b1-fp8-cap", "row-blocks-e5m2", "no-groups"],
)
def test_cascade_equals_reference_and_plain_kernel(case):
    case = dict(case)
    splits, P, cap, cfg = (
        case.pop("splits"),
        case.pop("P"),
        case.pop("cap", 0.0),
        case.pop("cfg", None),
    )
    if case.get("scale") == "tensor":
        case["scale"] = torch.tensor([0.25])
    p = _problem(case.pop("B"), case.pop("hq"), case.pop("hkv"), 16, case.pop("groups"), **case)
    _check(p, splits, P, cap, cfg)


def test_decode_attention_fwd_cascade_allocates_scratch_and_matches():
    """The public entry point: cascade=... with the scratch allocated inside (P from
    cascade_splits), and the wrong scratch shape is a ValueError before any launch."""
    p = _problem(9, 8, 2, 16, [(4, 32), (3, 21)], dtype=torch.bfloat16, seed=3)
    d = p.q.shape[-1]
    o = torch.full_like(p.q, float("nan"))
    args = (p.req_to_token, p.req_pool_indices, p.seq_lens, d**-0.5, p.kv)
    decode_attention_fwd(p.q, o, *args, num_splits=2, cascade=p.cascade)
    torch.testing.assert_close(o.cpu().double(), _reference(p, 0.0), atol=2e-2, rtol=2e-2)
    bad = torch.empty(decode_scratch_shape(9, 8, d, 2), device=p.q.device)  # P slots missing
    with pytest.raises(ValueError, match="mid_o"):
        decode_attention_fwd(
            p.q, o, *args, num_splits=2, mid_o=bad, mid_lse=bad[..., 0], cascade=p.cascade
        )


def test_cascade_rejections():
    """A window, malformed cascade tensors and a plan / cascade mismatch: ValueErrors naming
    the argument, raised before any launch (o stays untouched)."""
    p = _problem(4, 4, 2, 16, [(2, 8)])
    d = p.q.shape[-1]
    o = torch.zeros_like(p.q)
    args = (p.req_to_token, p.req_pool_indices, p.seq_lens, d**-0.5, p.kv)
    with pytest.raises(ValueError, match="cascade"):
        decode_attention_fwd(p.q, o, *args, window=8, cascade=p.cascade)
    c = p.cascade
    bad = [
        CascadeArgs(c.prefix_lens.long(), c.rows, c.items),
        CascadeArgs(c.prefix_lens[:3], c.rows, c.items),
        CascadeArgs(c.prefix_lens, c.rows[:3], c.items),
        CascadeArgs(c.prefix_lens, c.rows, c.items[:, :3]),
        CascadeArgs(c.prefix_lens, c.rows, c.items.t().contiguous().t()),
    ]
    for cas, name in zip(
        bad, ["prefix_lens", "prefix_lens", "rows", "items", "items"], strict=True
    ):
        with pytest.raises(ValueError, match=f"cascade.{name}"):
            decode_attention_fwd(p.q, o, *args, cascade=cas)
    plan = plan_decode(p.q, o, p.req_to_token, d**-0.5, p.kv, False, cascade_splits=2)
    with pytest.raises(ValueError, match="cascade"):
        launch_decode(plan, p.q, o, *args[:3], p.kv, None, None, None)
    plain = plan_decode(p.q, o, p.req_to_token, d**-0.5, p.kv, False)
    with pytest.raises(ValueError, match="cascade"):
        launch_decode(plain, p.q, o, *args[:3], p.kv, None, None, None, p.cascade)
    with pytest.raises(ValueError, match="cascade_splits"):
        plan_decode(p.q, o, p.req_to_token, d**-0.5, p.kv, False, cascade_splits=3)
    assert torch.count_nonzero(o) == 0


def test_plan_without_cascade_is_unchanged():
    """cascade_splits 0: no HAS_PREFIX / PREFIX_SPLITS constexprs (the kernels compiled as
    without the cascade path), scratch strides of the splits alone, no prefix launch."""
    p = _problem(4, 4, 2, 16, [])
    o = torch.zeros_like(p.q)
    for splits in (1, 4):
        plan = plan_decode(p.q, o, p.req_to_token, 0.25, p.kv, True, num_splits=splits)
        assert plan.prefix is None and "HAS_PREFIX" not in plan.constexprs
        assert "PREFIX_SPLITS" not in plan.merge_constexprs
        assert plan.scalars[10:12] == (4 * splits, splits) and plan.grid == (4, 2, splits)
        casc = plan_decode(p.q, o, p.req_to_token, 0.25, p.kv, True, -1, 0.0, splits, None, 4)
        assert casc.constexprs["HAS_PREFIX"] and casc.prefix is not None
        assert casc.scalars[10:12] == (4 * (splits + 4), splits + 4)
        assert casc.merge_constexprs["BLOCK_S"] == 1 << (splits + 3).bit_length()


def test_cascade_splits_and_prefix_config():
    """P: a power of two in [1, 16], the same for a graph bucket and the batches it serves; the
    query tile holds whole GQA groups, at least 16 and at most 128 rows."""
    from srt.model_executor.cuda_graph_runner import get_batch_sizes_to_capture

    buckets = get_batch_sizes_to_capture(256)
    for sms in (132, 78):
        for hkv in (1, 8):
            for raw in range(1, 257):
                b = next(x for x in buckets if x >= raw)
                s = cascade_splits(raw, hkv, sms)
                assert s == cascade_splits(b, hkv, sms)
                assert 1 <= s <= MAX_CASCADE_SPLITS and s & (s - 1) == 0
    assert cascade_splits(256, 8, 132) == 2 and cascade_splits(1, 8, 132) == 16
    for group in (1, 2, 4, 6, 8, 16, 64):
        for dot16, ieee, most in ((True, False, 128), (False, False, 64), (False, True, 16)):
            cfg = prefix_config(group, dot16, ieee)
            rows = cfg.block_r * (1 << (group - 1).bit_length())
            assert 16 <= rows <= max(most, group) and cfg.block_r <= CASCADE_ROWS_PER_ITEM
            assert cfg.num_warps == (8 if rows >= 128 else 4)
    assert prefix_config(4) == PrefixConfig(16, 32, 4, 3)  # Llama-3-8B: 64 rows
    assert prefix_config(8, False) == PrefixConfig(8, 32, 4, 2)  # fp8 cache, group 8


@gpu
@pytest.mark.parametrize("B", [64, 256])
def test_cascade_llama3_8b_shape_gpu(B):
    """Llama-3-8B heads (Hq 32, Hkv 8, D 128), bf16, page 16: 8 groups with a 512-key shared
    prefix (items of 16 rows), the backend's split counts, against the kernel without cascade."""
    from srt.layers.attention.triton_ops.decode_attention import num_kv_splits

    n = B // 8
    p = _problem(B, 32, 8, 128, [(n, 512)] * 8, page_size=16, dtype=torch.bfloat16, seed=B)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    splits, P = num_kv_splits(B, 8, sms), cascade_splits(B, 8, sms)
    got = _run(p, splits, P)
    plain = _run(p, splits, 0)
    torch.cuda.synchronize()
    assert not got.isnan().any()
    torch.testing.assert_close(got, plain, atol=2e-2, rtol=2e-2)
    assert math.isfinite(float(got.float().abs().max()))


@gpu
def test_cascade_cuda_graph_replay_equals_eager():
    """The cascade launch captured in a CUDA graph, replayed after the host rewrote q and the
    cascade tensors in place (the groups cut into other items, then half the prefixes, then no
    groups): the same bits as eager launches, and close to the kernel without a cascade."""
    kw = dict(page_size=16, dtype=torch.bfloat16)
    p = _problem(48, 32, 8, 128, [(20, 256), (9, 128)], **kw)  # items 16 + 4, 9, 2 unused
    B, hq, d = p.q.shape
    splits, P = 2, cascade_splits(B, 8, torch.cuda.get_device_properties(0).multi_processor_count)
    o = torch.empty_like(p.q)
    plan = plan_decode(p.q, o, p.req_to_token, d**-0.5, p.kv, False, -1, 0.0, splits, None, P)
    shape = decode_scratch_shape(B, hq, d, splits + P)
    mid_o = torch.empty(shape, device=DEV)
    mid_lse = torch.empty(shape[:3], device=DEV)
    args = (p.req_to_token, p.req_pool_indices, p.seq_lens, p.kv, None, mid_o, mid_lse)

    def launch(out):
        launch_decode(plan, p.q, out, *args, p.cascade)

    launch(o)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch(o)
    # the same table (same seed), its groups in items of at most 10 rows: 10 + 10, 9, 2 unused
    regrouped = _problem(48, 32, 8, 128, [(20, 256), (9, 128)], rows_per_item=10, **kw).cascade
    assert regrouped.items.shape == p.cascade.items.shape
    c = p.cascade
    for step in ("regrouped", "half", "none"):
        p.q.copy_(torch.randn_like(p.q))
        if step == "regrouped":
            for mine, new in zip(c.__dict__.values(), regrouped.__dict__.values(), strict=True):
                mine.copy_(new)
        elif step == "half":  # a prefix of a shared prefix is shared too (page-aligned)
            c.prefix_lens.copy_(c.prefix_lens // 2)
            c.items[:, 2] //= 2
        else:
            c.prefix_lens.zero_()
            c.items[:, 2] = 0
        graph.replay()
        eager = torch.empty_like(o)
        launch(eager)
        torch.cuda.synchronize()
        assert torch.equal(o, eager), step
        torch.testing.assert_close(o, _run(p, splits, 0), atol=2e-2, rtol=2e-2)
