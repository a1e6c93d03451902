"""The q/k-norm op's launch table (sgl_ext/tables/qk_norm.json) and the kernel's POS_LAST (the
position loaded after every other load): float64-reference results and unchanged bits under
each kind of program layout, and the plan's constexpr following the table. Then the q/k bits
with and without the KV write (the fused and unfused Qwen3 paths agree bit for bit), for both
sum-of-squares dtypes."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

import sgl_ext
from sgl_ext import FusedSetKVBufferArg, settings
from sgl_ext.launch_layout import LoadOrder, Programs
from tests.sgl_ext.sgl_ext_testutil import FP8, bits, make_cos_sin_cache
from tests.sgl_ext.test_qk_norm_rope import EPS, _inputs, run_case

HAS_CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
DEV = "cuda" if HAS_CUDA else "cpu"


def _layouts():
    """One of each program kind, with POS_LAST: separate (1 head x 1 warp, 4 x 4), merged
    (token-major, key/value programs first) and merged with GQA groups spread."""
    from sgl_ext.launch_layout import GridOrder, LaunchConfig, LoadOrder, Programs

    two_d, token, kv_first = GridOrder.TWO_D, GridOrder.TOKEN, GridOrder.KV_FIRST
    merged, spread = Programs.MERGED, Programs.SPREAD
    pl, lb, pw = LoadOrder.POS_LAST, LoadOrder.LOAD_BARRIER, LoadOrder.PRE_WAIT
    return [
        LaunchConfig(1, 1, two_d, load=pl),
        LaunchConfig(4, 4, two_d, load=pl),
        LaunchConfig(2, 2, token, merged, pl),
        LaunchConfig(2, 4, kv_first, merged, pl),
        LaunchConfig(4, 2, token, spread, pl),
        LaunchConfig(2, 2, token, merged, hoist=True, early_release=True),
        LaunchConfig(2, 4, kv_first, merged, pl, hoist=True),
        LaunchConfig(4, 2, token, spread, pl, hoist=True),
        LaunchConfig(1, 1, two_d, load=lb),
        LaunchConfig(4, 4, token, load=lb),
        LaunchConfig(2, 2, token, merged, lb),
        LaunchConfig(2, 4, kv_first, merged, lb, hoist=True),
        LaunchConfig(4, 2, token, spread, lb),
        LaunchConfig(4, 4, two_d, load=lb, kv_block_h=1),
        LaunchConfig(4, 4, two_d, load=pw, early_release=True),
        LaunchConfig(2, 2, token, merged, pw, hoist=True),
        # the norm weights before the PDL wait too: separate, merged and merged with HOIST
        LaunchConfig(4, 4, two_d, load=pw, early_release=True, norm_w_pre=True),
        LaunchConfig(2, 2, token, merged, pw, norm_w_pre=True),
        LaunchConfig(2, 2, token, merged, pw, hoist=True, norm_w_pre=True),
        # the slot and its cache rows before the PDL wait too: separate, merged, merged HOIST
        LaunchConfig(4, 4, two_d, load=pw, norm_w_pre=True, slot_pre=True),
        LaunchConfig(2, 2, token, merged, pw, slot_pre=True),
        LaunchConfig(2, 2, token, merged, pw, hoist=True, slot_pre=True),
        # 16 query heads a program (the H200's 9..64 rows), 4 key/value heads
        LaunchConfig(16, 4, two_d, load=pw, early_release=True, norm_w_pre=True),
        LaunchConfig(16, 4, two_d, load=pw, early_release=True, kv_block_h=4, norm_w_pre=True),
    ]


IDS = ["1x1", "4x4", "merged", "kv-first", "spread", "hoist", "hoist-kv-first", "hoist-spread"]
IDS += ["lb-1x1", "lb-4x4", "lb-merged", "lb-hoist-kv-first", "lb-spread", "lb-kv1"]
IDS += ["pw-4x4", "pw-hoist", "pw-w-4x4", "pw-w-merged", "pw-w-hoist"]
IDS += ["pw-s-4x4", "pw-s-merged", "pw-s-hoist", "pw-w-16x4", "pw-16x4-kv4"]


@pytest.fixture
def layout():
    """layout(cfg): the q/k-norm op uses cfg at every T and head size on every GPU (its table
    replaced through launch_tables.override, which drops the cached plans); the table comes
    back afterwards."""
    from sgl_ext import launch_tables

    with contextlib.ExitStack() as stack:

        def _set(cfg) -> None:
            row = {"head_dim": "other", "tokens": [1, None], **cfg.to_row()}
            stack.enter_context(launch_tables.override("qk_norm", {"rows": [row]}))

        yield _set


@pytest.mark.parametrize("idx", range(len(IDS)), ids=IDS)
def test_triton_pos_last_against_float64(backend, layout, idx):
    """Every program kind with POS_LAST holds the float64 reference (q, k, exact cache/V)."""
    backend("triton")
    layout(_layouts()[idx])
    run_case(device=DEV, dtype=torch.bfloat16, hq=6, hkv=2, num_tokens=5, seed=20 + idx)
    if idx in (1, 2, 5):  # partial GPT-J rotary with a tail, fp8 cache with a tensor scale
        run_case(
            device=DEV,
            dtype=torch.float16,
            kv_dtype=torch.float8_e4m3fn,
            scale="tensor",
            neox=False,
            rot_frac=0.5,
            hq=3,
            hkv=1,
            num_tokens=3,
            seed=30 + idx,
        )
    if idx >= len(IDS) - 2:  # 16 heads a program: 20 query heads fill one and a bit of another
        for kv, scale, t in ((None, "none", 33), (torch.float8_e4m3fn, "float", 9)):
            kw = dict(kv_dtype=kv, scale=scale, hq=20, hkv=4, num_tokens=t, seed=40 + t)
            run_case(device=DEV, dtype=torch.bfloat16, **kw)


@pytest.mark.parametrize("idx", [0, 2, 5], ids=["1x1", "merged", "hoist"])
def test_triton_pos_last_keeps_the_bits(backend, layout, idx):
    """POS_LAST and HOIST only move loads: the same q/k bits with them on and off, KV write or
    not."""
    backend("triton")
    cfg = _layouts()[idx]
    outs = []
    merged = cfg.programs is not Programs.SEPARATE
    for pos_last in (False, True):
        load = LoadOrder.POS_LAST if pos_last else LoadOrder.START
        layout(dataclasses.replace(cfg, load=load, hoist=pos_last and merged))
        outs.append(_qk_with_and_without_kv(DEV, 5, 4, 2, 16, torch.bfloat16, seed=4, calls=1))
    for (f0, q0, k0), (f1, q1, k1) in zip(*outs, strict=True):
        assert f0 == f1 and torch.equal(q0, q1) and torch.equal(k0, k1)


@pytest.mark.parametrize("num_tokens", [1, 8, 9, 32, 33, 64, 65, 300, 513, 1024, 4096])
def test_plan_pos_last_follows_the_table(num_tokens):
    """The plan's POS_LAST is the table's choice for T, with and without the KV write; RoPE
    alone (no norm) never loads the position last."""
    from sgl_ext.triton.rope_kv_plan import QK_NORM_LAYOUTS, qk_norm_launch_config

    assert [r.first for r in QK_NORM_LAYOUTS] == sorted(r.first for r in QK_NORM_LAYOUTS)
    cfg = qk_norm_launch_config(num_tokens, 32, 128, torch.device("cpu"))  # _plan's tensors
    merged = cfg.programs is not Programs.SEPARATE
    want = {  # POS_LAST 2: behind a barrier (merged programs without HOIST)
        LoadOrder.START: 0,
        LoadOrder.POS_LAST: 2 if merged and not cfg.hoist else 1,
        LoadOrder.LOAD_BARRIER: 3,
        LoadOrder.PRE_WAIT: 4,  # the position and cos/sin before the wait
    }[cfg.load]
    pre_wait = cfg.load is LoadOrder.PRE_WAIT
    for kv_dtype in (None, torch.bfloat16, torch.float8_e4m3fn):
        c = _plan(num_tokens, kv_dtype).constexprs
        assert c["POS_LAST"] == want and c["HOIST"] == (merged and cfg.hoist)
        assert c["EARLY_RELEASE"] == (c["USE_PDL"] and cfg.early_release)
        assert c["NORM_W_PRE"] == (pre_wait and cfg.norm_w_pre)
        assert c["SLOT_PRE"] == (kv_dtype is not None and pre_wait and cfg.slot_pre)


@pytest.mark.parametrize("name", ["NVIDIA H200", "NVIDIA H100 80GB HBM3"])
def test_device_layouts_by_gpu_name(monkeypatch, name):
    """A GPU whose name holds a QK_NORM_DEVICE_LAYOUTS key takes that section's rows first (each
    differs from the H100's row it replaces), any other GPU and the CPU the H100's."""
    from sgl_ext import device_tables
    from sgl_ext.triton import rope_kv_plan as rp

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: name)
    monkeypatch.setattr(device_tables, "_names", {})
    cuda = torch.device("cuda", 0)
    mine = ()
    for sub, rows in rp.QK_NORM_DEVICE_LAYOUTS.items():
        assert rows and all(r.head_dim == 128 and r.config is not None for r in rows)
        mine += rows if sub in name else ()
        for t in (1, 8, 9, 33, 64, 65, 300, 512, 1024, 1025, 4096, 32768):
            own = next((r for r in rows if r.covers(t)), None)
            base = next(r for r in rp.QK_NORM_LAYOUTS if r.covers(t))
            assert own is None or own.config != base.config  # an exception, not a copy
            cfg = rp.qk_norm_launch_config(t, 32, 128, cuda)
            assert cfg == (own if own is not None and sub in name else base).config
            assert rp.qk_norm_launch_config(t, 32, 128) == base.config  # no device: the H100's
            assert rp.qk_norm_launch_config(t, 32, 128, torch.device("cpu")) == base.config
    assert rp.qk_norm_layouts(cuda) == mine + rp.qk_norm_table().rows


def test_override_and_rope_alone_do_not_load_the_position_last(monkeypatch):
    """RoPE alone's layouts and an SGL_EXT_TRITON_CONFIG override keep the position first."""
    from sgl_ext.triton.rope_kv_plan import launch_config, qk_norm_launch_config

    pos_last = LoadOrder.POS_LAST
    assert not any(launch_config(t, 32, 128).load is pos_last for t in (1, 32, 512, 4096))
    monkeypatch.setenv("SGL_EXT_TRITON_CONFIG", "1,4,0")
    settings.reload()
    assert qk_norm_launch_config(1, 32, 128).load is LoadOrder.START


@gpu
@pytest.mark.parametrize("num_tokens", [1, 7, 129, 300, 513])
def test_cuda_pos_last_keeps_the_bits(backend, layout, num_tokens):
    """Qwen3-8B shapes on the GPU: the table's layout for T with POS_LAST (and HOIST, merged) on
    and off gives the same q/k bits, with and without the KV write, through the JIT and direct
    launches."""
    from sgl_ext.triton.rope_kv_plan import qk_norm_launch_config

    backend("triton")
    cfg = qk_norm_launch_config(num_tokens, 32, 128)
    merged = cfg.programs is not Programs.SEPARATE

    def variant(load: LoadOrder, hoist: bool):
        keep = cfg.load is LoadOrder.PRE_WAIT  # PRE_WAIT rows keep it (it wins in the kernel)
        return dataclasses.replace(cfg, load=cfg.load if keep else load, hoist=hoist and merged)

    variants = (
        variant(LoadOrder.START, False),
        variant(LoadOrder.POS_LAST, True),
        variant(LoadOrder.LOAD_BARRIER, False),
        variant(LoadOrder.LOAD_BARRIER, True),
    )
    outs = []
    for v in variants:
        layout(v)
        outs.append(_qk_with_and_without_kv("cuda", num_tokens, 32, 8, 128, torch.bfloat16, 7))
    for other in outs[1:]:
        for (f0, q0, k0), (f1, q1, k1) in zip(outs[0], other, strict=True):
            assert f0 == f1 and torch.equal(q0, q1) and torch.equal(k0, k1)


# ------------------------------------------- q/k bits do not depend on the KV write (issue 17)
def _qk_with_and_without_kv(device, t, hq, hkv, d, kv_dtype, seed, calls=2):
    """q/k after the op without the KV write, then with it, on the same inputs; each `calls`
    times (the first call of a plan goes through the JIT, later ones launch directly)."""
    gen = torch.Generator().manual_seed(seed)
    qkv, qw, kw = _inputs(gen, t, hq, hkv, d, d, torch.bfloat16)
    qkv, qw, kw = qkv.to(device), qw.to(device), kw.to(device)
    max_pos = 8192
    pos = torch.randint(0, max_pos, (t,), generator=gen).to(device)
    cs = make_cos_sin_cache(max_pos, d).to(device)
    page, slots = 16, 16 * (t // 16 + 2)
    kb = torch.zeros(slots // page, page, hkv, d, dtype=kv_dtype, device=device)  # [P, ps, H, D]
    loc = torch.randperm(slots, generator=gen)[:t].to(device)
    ks = torch.tensor([0.5], device=device) if kv_dtype in FP8 else None
    out = []
    for fused in (False, True, False, True)[: 2 * calls]:
        x = qkv.clone()
        q, k, v = x.split([hq * d, hkv * d, hkv * d], dim=-1)  # strided views
        arg = FusedSetKVBufferArg(v, kb, torch.zeros_like(kb), ks, ks, loc) if fused else None
        sgl_ext.apply_qk_norm_rope_with_cos_sin_cache_inplace(
            pos, q, k, d, cs, qw, kw, EPS, True, arg
        )
        out.append((fused, bits(q.contiguous()).cpu(), bits(k.contiguous()).cpu()))
    return out


def _assert_same_bits(out):
    _, q0, k0 = out[0]
    for fused, q, k in out[1:]:
        assert torch.equal(q, q0), f"query bits differ (KV write {'on' if fused else 'off'})"
        assert torch.equal(k, k0), f"key bits differ (KV write {'on' if fused else 'off'})"


@pytest.fixture(params=[False, True], ids=["sum_fp32", "sum_fp64"])
def sum_fp64(request, monkeypatch):
    """The norm's sum-of-squares dtype (rope_kv_plan.QK_NORM_SUM_FP64), plans dropped."""
    from sgl_ext.triton import rope_kv_plan

    monkeypatch.setattr(rope_kv_plan, "QK_NORM_SUM_FP64", request.param)
    settings.reload()
    yield request.param
    monkeypatch.undo()
    settings.reload()


@pytest.mark.parametrize("config", ["", "1,4,0,0", "4,2,1,1"], ids=["default", "sep", "merged"])
def test_triton_qk_bits_do_not_depend_on_kv_write(backend, monkeypatch, sum_fp64, config):
    """Interpreter: under each launch layout, with and without the KV write, the op returns the
    same q/k bits (the float32 sum adds in the layout's order: the claim is per layout)."""
    backend("triton")
    dev = "cuda" if HAS_CUDA else "cpu"
    if config:
        monkeypatch.setenv("SGL_EXT_TRITON_CONFIG", config)
        settings.reload()
    out = _qk_with_and_without_kv(dev, 5, 4, 2, 16, torch.bfloat16, seed=3, calls=1)
    _assert_same_bits(out)


def test_triton_fp64_sum_of_squares_against_float64(backend, sum_fp64):
    """Both sum-of-squares dtypes hold the float64 reference (fp8 cache, partial GPT-J too)."""
    backend("triton")
    dev = "cuda" if HAS_CUDA else "cpu"
    run_case(device=dev, dtype=torch.bfloat16, hq=4, hkv=2, num_tokens=7, seed=5)
    run_case(
        device=dev,
        dtype=torch.float16,
        kv_dtype=torch.float8_e4m3fn,
        scale="tensor",
        neox=False,
        rot_frac=0.5,
        hq=3,
        hkv=1,
        num_tokens=6,
        seed=6,
    )


def _plan(t: int, kv_dtype: torch.dtype | None):
    """The Triton launch plan of the op at Qwen3-8B heads (32/8/128, bf16) for T tokens, with a
    KV write into a kv_dtype cache or (None) without one. Metadata only: nothing runs."""
    from sgl_ext import qk_norm_rope
    from sgl_ext._common import QKNormCall
    from sgl_ext.triton.rope_kv_plan import plan_rope_kv

    hq, hkv, d = 32, 8, 128
    qkv = torch.empty(t, (hq + 2 * hkv) * d, dtype=torch.bfloat16)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)  # strided views
    pos, loc = torch.zeros(t, dtype=torch.int64), torch.zeros(t, dtype=torch.int64)
    cs = torch.empty(16, d)
    w = torch.empty(d, dtype=torch.bfloat16)
    arg = None
    if kv_dtype is not None:
        kb = torch.empty(64, 16, hkv, d, dtype=kv_dtype)  # [pages, page, H, D]
        ks = torch.tensor([0.5]) if kv_dtype != torch.bfloat16 else None
        arg = FusedSetKVBufferArg(v, kb, torch.empty_like(kb), ks, ks, loc)
    call, eps = qk_norm_rope.check(pos, q, k, d, cs, w, w, EPS, True, arg)
    norm = QKNormCall(eps, 0, 0)
    return plan_rope_kv(call, 0, 0, 0, False, norm)


@pytest.mark.parametrize("num_tokens", [1, 8, 9, 64, 513, 897, 4096])
def test_qk_norm_layout_is_the_same_with_and_without_kv_write(num_tokens):
    """The QK_NORM plan's layout (heads per program, warps, blocks, grid) is the same without
    the KV write and with bf16 or fp8 caches (RoPE alone's layout depends on the cache dtype
    past ~900 tokens): the fused and unfused Qwen3 paths sum squares in the same order."""
    keys = ("BLOCK_H", "BLOCK_HKV", "NUM_Q_BLOCKS", "NUM_KV_BLOCKS", "MERGED", "SS_FP64")
    seen = []
    for kv_dtype in (None, torch.bfloat16, torch.float8_e4m3fn):
        plan = _plan(num_tokens, kv_dtype)
        c = plan.constexprs
        assert c["QK_NORM"] and c["WRITE_KV"] == (kv_dtype is not None)
        seen.append(([c[k] for k in keys], plan.options.get("maxnreg"), plan.options["num_warps"]))
    assert seen[1:] == seen[:1] * 2, seen


@gpu
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("num_tokens", [1, 7, 64, 129, 513, 4096])
def test_cuda_qk_bits_do_not_depend_on_kv_write(backend, sum_fp64, kv_dtype, num_tokens):
    """Qwen3-8B shapes (32/8/128, bf16) on the GPU: the op with and without the KV argument
    (the fused and unfused model paths) gives bit-identical q and k, through the JIT and
    through direct launches, with either sum-of-squares dtype (fp8 caches would change RoPE
    alone's layout past ~900 tokens; the QK_NORM plan keeps one)."""
    backend("triton")
    out = _qk_with_and_without_kv("cuda", num_tokens, 32, 8, 128, kv_dtype, seed=num_tokens)
    _assert_same_bits(out)
