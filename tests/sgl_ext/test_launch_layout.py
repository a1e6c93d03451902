"""sgl_ext.launch_layout: a RoPE + KV launch layout's named values, its table-row and
SGL_EXT_TRITON_CONFIG spellings (readable key=value and the positional integers), and the bad
spellings' errors."""

from __future__ import annotations

import json
import os
import random

import pytest

from sgl_ext import settings
from sgl_ext.launch_layout import (
    LEGACY_FIELDS,
    GridOrder,
    LaunchConfig,
    LoadOrder,
    Programs,
    parse_tuning,
    tuning_string,
)

SEED = int.from_bytes(os.urandom(4), "little")


def _random_config(rng: random.Random) -> LaunchConfig:
    programs = rng.choice(list(Programs))
    load = rng.choice(list(LoadOrder))
    pre = load is LoadOrder.PRE_WAIT
    return LaunchConfig(
        1 << rng.randrange(7),
        1 << rng.randrange(6),
        rng.choice(list(GridOrder)),
        programs,
        load,
        hoist=programs is not Programs.SEPARATE and rng.random() < 0.5,
        early_release=rng.random() < 0.5,
        kv_block_h=rng.choice((0, 1, 2, 4, 8)),
        maxnreg=rng.choice((0, 40, 128)),
        norm_w_pre=pre and rng.random() < 0.5,
        slot_pre=pre and rng.random() < 0.5,
    )


def _legacy(cfg: LaunchConfig) -> tuple[int, ...]:
    """cfg in the positional spelling (the boolean layout's fields)."""
    merged = cfg.programs is not Programs.SEPARATE
    v = dict(
        block_h=cfg.block_h,
        num_warps=cfg.num_warps,
        order=cfg.order.code,
        merged=merged,
        spread=cfg.programs is Programs.SPREAD,
        maxnreg=cfg.maxnreg,
        pos_last=cfg.load is LoadOrder.POS_LAST,
        hoist=cfg.hoist,
        early_release=cfg.early_release,
        load_barrier=cfg.load is LoadOrder.LOAD_BARRIER,
        kv_block_h=cfg.kv_block_h,
        pre_wait=cfg.load is LoadOrder.PRE_WAIT,
        norm_w_pre=cfg.norm_w_pre,
        slot_pre=cfg.slot_pre,
    )
    return tuple(int(v[f]) for f in LEGACY_FIELDS)


def test_every_spelling_reads_back():
    """Fresh random layouts: the readable string, the table row (through JSON) and the positional
    integers (as text and as a tuple) all give the layout back."""
    rng = random.Random(SEED)
    for _ in range(300):
        cfg = _random_config(rng)
        msg = f"seed {SEED}: {cfg}"
        assert parse_tuning(tuning_string(cfg)) == cfg, msg
        assert LaunchConfig.from_row(json.loads(json.dumps(cfg.to_row()))) == cfg, msg
        legacy = _legacy(cfg)
        assert parse_tuning(legacy) == cfg, msg
        assert parse_tuning(",".join(map(str, legacy))) == cfg, msg
        assert parse_tuning(cfg) is cfg


def test_readable_string_as_documented():
    got = parse_tuning("block_h=16,num_warps=4,order=2d,load=pre_wait,early_release=1")
    assert got == LaunchConfig(16, 4, GridOrder.TWO_D, load=LoadOrder.PRE_WAIT, early_release=True)
    assert tuning_string(got) == "block_h=16,num_warps=4,order=2d,load=pre_wait,early_release=1"
    # defaults: token-major separate programs, position loaded first; flags also true / false
    assert parse_tuning(" block_h = 2 , num_warps=1, hoist=false ") == LaunchConfig(2, 1)
    assert parse_tuning("num_warps=8,block_h=32,programs=spread,hoist=true").hoist


def test_positional_precedence_and_dropped_flags():
    """The boolean layout's spelling: of pre_wait, load_barrier and pos_last the first set wins
    (the kernel's precedence); hoist and spread without merged programs and the pre-wait loads
    without pre_wait had no effect and are dropped; a short string takes the defaults
    (token-major)."""
    assert parse_tuning("8,4") == LaunchConfig(8, 4, GridOrder.TOKEN)
    assert parse_tuning((4, 4, 0, 0, 0, 0, 1, 0, 0, 1, 0, 1)).load is LoadOrder.PRE_WAIT
    assert parse_tuning((4, 4, 0, 0, 0, 0, 1, 0, 0, 1)).load is LoadOrder.LOAD_BARRIER
    assert parse_tuning((4, 4, 2, 0, 1, 0, 1, 1)) == LaunchConfig(
        4, 4, GridOrder.KV_FIRST, load=LoadOrder.POS_LAST
    )
    assert parse_tuning((2, 2, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1)) == LaunchConfig(2, 2)


@pytest.mark.parametrize(
    "text, match",
    [
        ("block_h=4,num_warps=4,colour=red", "unknown key 'colour'"),
        ("block_h=4,num_warps=4,order=diagonal", "order must be one of 2d, token, kv_first"),
        ("block_h=4,num_warps=4,block_h=8", "not one new key=value"),
        ("block_h=4,4", "not one new key=value"),
        ("num_warps=4", "missing 'block_h'"),
        ("block_h=3,num_warps=4", "powers of two"),
        ("block_h=4,num_warps=4,hoist=1", "hoist needs merged or spread programs"),
        ("block_h=4,num_warps=4,slot_pre=1", "need load pre_wait"),
        ("block_h=4,num_warps=four", "num_warps must be an integer"),
        ("4,x", "key=value pairs or comma-separated integers"),
        ("4", "takes 2 to 14 integers"),
        (",".join(["1"] * 15), "takes 2 to 14 integers"),
        ("4,4,3", "order must be 0 \\(2d\\), 1 \\(token\\) or 2 \\(kv_first\\)"),
        ("6,4,1", "powers of two"),
    ],
)
def test_bad_spelling_raises(text, match):
    with pytest.raises(ValueError, match=match) as err:
        parse_tuning(text)
    assert "SGL_EXT_TRITON_CONFIG" in str(err.value)


def test_row_errors_name_the_value():
    with pytest.raises(ValueError, match="hoist must be true or false"):
        LaunchConfig.from_row({"block_h": 4, "num_warps": 4, "hoist": 2})
    with pytest.raises(TypeError, match="block_h must be int"):
        LaunchConfig.from_row({"block_h": 4.0, "num_warps": 4})
    with pytest.raises(TypeError, match="order must be GridOrder"):
        LaunchConfig(4, 4, "2d")  # type: ignore[arg-type]


def test_settings_read_either_spelling(monkeypatch):
    """SGL_EXT_TRITON_CONFIG in either spelling is a LaunchConfig in the settings (a bad one a
    ValueError when read); override() takes text, integers or a layout."""
    want = LaunchConfig(4, 4, GridOrder.TWO_D, load=LoadOrder.PRE_WAIT)
    for text in ("block_h=4,num_warps=4,order=2d,load=pre_wait", "4,4,0,0,0,0,0,0,0,0,0,1"):
        assert settings.from_env({"SGL_EXT_TRITON_CONFIG": text}).triton_config == want
    assert settings.from_env({"SGL_EXT_TRITON_CONFIG": ""}).triton_config is None
    with pytest.raises(ValueError, match="SGL_EXT_TRITON_CONFIG"):
        settings.from_env({"SGL_EXT_TRITON_CONFIG": "block_h=4"})
    for given in (tuning_string(want), _legacy(want), want):
        with settings.override(triton_config=given) as s:
            assert s.triton_config == want
