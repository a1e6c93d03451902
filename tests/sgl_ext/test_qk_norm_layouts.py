"""The q/k-norm op's launch table (rope_kv_plan.QK_NORM_LAYOUTS) and the kernel's POS_LAST (the
position loaded after every other load): float64-reference results and unchanged bits under
each kind of program layout, and the plan's constexpr following the table."""

from __future__ import annotations

import pytest
import torch

from sgl_ext import settings
from tests.sgl_ext.test_qk_norm_rope import _plan, _qk_with_and_without_kv, run_case

HAS_CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
DEV = "cuda" if HAS_CUDA else "cpu"


def _layouts():
    """One of each program kind, with POS_LAST: separate (1 head x 1 warp, 4 x 4), merged
    (token-major, key/value programs first) and merged with GQA groups spread."""
    from sgl_ext.triton.rope_kv_plan import (
        ORDER_2D,
        ORDER_KV_FIRST,
        ORDER_TOKEN,
        LaunchConfig,
    )

    return [
        LaunchConfig(1, 1, ORDER_2D, pos_last=True),
        LaunchConfig(4, 4, ORDER_2D, pos_last=True),
        LaunchConfig(2, 2, ORDER_TOKEN, merged=True, pos_last=True),
        LaunchConfig(2, 4, ORDER_KV_FIRST, merged=True, pos_last=True),
        LaunchConfig(4, 2, ORDER_TOKEN, merged=True, spread=True, pos_last=True),
        LaunchConfig(2, 2, ORDER_TOKEN, merged=True, hoist=True, early_release=True),
        LaunchConfig(2, 4, ORDER_KV_FIRST, merged=True, pos_last=True, hoist=True),
        LaunchConfig(4, 2, ORDER_TOKEN, merged=True, spread=True, pos_last=True, hoist=True),
        LaunchConfig(1, 1, ORDER_2D, load_barrier=True),
        LaunchConfig(4, 4, ORDER_TOKEN, load_barrier=True),
        LaunchConfig(2, 2, ORDER_TOKEN, merged=True, load_barrier=True),
        LaunchConfig(2, 4, ORDER_KV_FIRST, merged=True, hoist=True, load_barrier=True),
        LaunchConfig(4, 2, ORDER_TOKEN, merged=True, spread=True, load_barrier=True),
        LaunchConfig(4, 4, ORDER_2D, load_barrier=True, kv_block_h=1),
        LaunchConfig(4, 4, ORDER_2D, early_release=True, pre_wait=True),
        LaunchConfig(2, 2, ORDER_TOKEN, merged=True, hoist=True, pre_wait=True),
    ]


IDS = ["1x1", "4x4", "merged", "kv-first", "spread", "hoist", "hoist-kv-first", "hoist-spread"]
IDS += ["lb-1x1", "lb-4x4", "lb-merged", "lb-hoist-kv-first", "lb-spread", "lb-kv1"]
IDS += ["pw-4x4", "pw-hoist"]


@pytest.fixture
def layout(monkeypatch):
    """layout(cfg): the q/k-norm op uses cfg at every T (cached plans dropped); the autouse
    settings fixture restores the table and reloads afterwards."""
    from sgl_ext.triton import rope_kv_plan

    def _set(cfg) -> None:
        monkeypatch.setattr(rope_kv_plan, "QK_NORM_LAYOUTS", ((1 << 62, cfg),))
        monkeypatch.setattr(rope_kv_plan, "QK_NORM_LAYOUTS_OTHER", ((1 << 62, cfg),))
        settings.reload()

    return _set


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


@pytest.mark.parametrize("idx", [0, 2, 5], ids=["1x1", "merged", "hoist"])
def test_triton_pos_last_keeps_the_bits(backend, layout, idx):
    """POS_LAST and HOIST only move loads: the same q/k bits with them on and off, KV write or
    not."""
    backend("triton")
    cfg = _layouts()[idx]
    outs = []
    for pos_last in (False, True):
        layout(cfg._replace(pos_last=pos_last, hoist=pos_last and cfg.merged))
        outs.append(_qk_with_and_without_kv(DEV, 5, 4, 2, 16, torch.bfloat16, seed=4, calls=1))
    for (f0, q0, k0), (f1, q1, k1) in zip(*outs, strict=True):
        assert f0 == f1 and torch.equal(q0, q1) and torch.equal(k0, k1)


@pytest.mark.parametrize("num_tokens", [1, 8, 9, 32, 33, 64, 65, 300, 513, 1024, 4096])
def test_plan_pos_last_follows_the_table(num_tokens):
    """The plan's POS_LAST is the table's choice for T, with and without the KV write; RoPE
    alone (no norm) never loads the position last."""
    from sgl_ext.triton.rope_kv_plan import QK_NORM_LAYOUTS, qk_norm_launch_config

    assert [hi for hi, _ in QK_NORM_LAYOUTS] == sorted(hi for hi, _ in QK_NORM_LAYOUTS)
    cfg = qk_norm_launch_config(num_tokens, 32, 128)
    # 2: behind a barrier (merged programs without HOIST)
    want = (2 if cfg.merged and not cfg.hoist else 1) if cfg.pos_last else 0
    want = 3 if cfg.load_barrier else want
    want = 4 if cfg.pre_wait else want  # PRE_WAIT: the position and cos/sin before the wait
    for kv_dtype in (None, torch.bfloat16, torch.float8_e4m3fn):
        c = _plan(num_tokens, kv_dtype).constexprs
        assert c["POS_LAST"] == want and c["HOIST"] == (cfg.merged and cfg.hoist)
        assert c["EARLY_RELEASE"] == (c["USE_PDL"] and cfg.early_release)


def test_override_and_rope_alone_do_not_load_the_position_last(monkeypatch):
    """RoPE alone's layouts and an SGL_EXT_TRITON_CONFIG override keep the position first."""
    from sgl_ext.triton.rope_kv_plan import launch_config, qk_norm_launch_config

    assert not any(launch_config(t, 32, 128).pos_last for t in (1, 32, 512, 4096))
    monkeypatch.setenv("SGL_EXT_TRITON_CONFIG", "1,4,0")
    settings.reload()
    assert not qk_norm_launch_config(1, 32, 128).pos_last


@gpu
@pytest.mark.parametrize("num_tokens", [1, 7, 129, 300, 513])
def test_cuda_pos_last_keeps_the_bits(backend, layout, num_tokens):
    """Qwen3-8B shapes on the GPU: the table's layout for T with POS_LAST (and HOIST, merged) on
    and off gives the same q/k bits, with and without the KV write, through the JIT and direct
    launches."""
    from sgl_ext.triton.rope_kv_plan import qk_norm_launch_config

    backend("triton")
    cfg = qk_norm_launch_config(num_tokens, 32, 128)
    plain = cfg._replace(pos_last=False, hoist=False, load_barrier=False)
    variants = (
        plain,
        plain._replace(pos_last=True, hoist=cfg.merged),
        plain._replace(load_barrier=True),
        plain._replace(load_barrier=True, hoist=cfg.merged),
    )
    outs = []
    for v in variants:
        layout(v)
        outs.append(_qk_with_and_without_kv("cuda", num_tokens, 32, 8, 128, torch.bfloat16, 7))
    for other in outs[1:]:
        for (f0, q0, k0), (f1, q1, k1) in zip(outs[0], other, strict=True):
            assert f0 == f1 and torch.equal(q0, q1) and torch.equal(k0, k1)
