"""Host side of the rope_kv Triton kernel: launch layouts (`launch_config`,
`qk_norm_launch_config`, read from the tables sgl_ext/tables/rope_kv.json and qk_norm.json), the
launch plan (`plan_rope_kv`: grid, fixed arguments, constexprs, a `KernelLauncher`). The
kernel itself is rope_kv.py; a layout's named values are sgl_ext/launch_layout.py.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from sgl_ext import launch_tables, rope_kv_schema, settings
from sgl_ext._common import QKNormCall, RopeCall, fp8_max, next_pow2
from sgl_ext.launch_layout import (  # noqa: F401 (parse_tuning, tuning_string: re-exported)
    GridOrder,
    LaunchConfig,
    LoadOrder,
    Programs,
    parse_tuning,
    tuning_string,
)
from sgl_ext.triton.launcher import KernelLauncher, make_launcher, pdl_on
from sgl_ext.triton.rope_kv import rope_kv_kernel


def _pow2_floor(n: int) -> int:
    """Largest power of two <= n (1 for n < 1)."""
    return 1 << max(0, n.bit_length() - 1)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _word_aligned(align: int, *strides: int) -> bool:
    """Every head row starts on a 4-byte boundary (16-bit pairs load as int32 words), given
    the data pointer % 16 and the element strides."""
    return align % 4 == 0 and all(s % 2 == 0 for s in strides)


def _gptj_mode(dtype: torch.dtype, rows: list[tuple[int, int, int]]) -> int:
    """2: 16-bit GPT-J pairs as int32 words when every row is 4-byte aligned, else 1 (strided).

    rows: (data_ptr % 16, token stride, head stride) of query and key.
    """
    if dtype not in (torch.bfloat16, torch.float16):
        return 1
    return 2 if all(_word_aligned(a, ts, hs) for a, ts, hs in rows) else 1


@dataclass(frozen=True)
class LayoutRow:
    """A row of the rope_kv or q/k-norm table: the layout for first <= T <= last tokens (last
    None: no bound) at head size `head_dim` (None: the sizes without rows of their own) and,
    in rope_kv.json, cache kind `cache` ("16bit" or "fp8").

    config None (q/k-norm rows only): launch_config's layout for a 16-bit cache, with `load`
    instead where that layout loads the position at the start.
    """

    first: int
    last: int | None
    head_dim: int | None
    cache: str | None
    config: LaunchConfig | None
    load: LoadOrder | None = None

    def covers(self, num_tokens: int) -> bool:
        return self.first <= num_tokens and (self.last is None or num_tokens <= self.last)


CACHES = ("16bit", "fp8")


def _rope_kv_row(row: dict) -> LayoutRow:
    first, last = launch_tables.token_range(row)
    head_dim = launch_tables.take(row, "head_dim", int)
    cache = launch_tables.take(row, "cache", str)
    if head_dim < 1 or cache not in CACHES:
        raise ValueError(f"head_dim must be >= 1 and cache one of {', '.join(CACHES)}")
    return LayoutRow(first, last, head_dim, cache, LaunchConfig.from_row(row))


def _qk_norm_row(row: dict) -> LayoutRow:
    first, last = launch_tables.token_range(row)
    head_dim = launch_tables.take(row, "head_dim", int, str)
    if head_dim == "other":
        head_dim = None
    elif isinstance(head_dim, str) or head_dim < 1:
        raise ValueError(f'head_dim must be >= 1 or "other", got {head_dim!r}')
    if row.get("layout") != "rope_kv":
        return LayoutRow(first, last, head_dim, None, LaunchConfig.from_row(row))
    del row["layout"]
    load = LoadOrder(launch_tables.take(row, "load", str)) if "load" in row else None
    launch_tables.no_more(row)
    return LayoutRow(first, last, head_dim, None, None, load)


def _check(rows: tuple[LayoutRow, ...], device: str | None) -> None:
    """Per (head_dim, cache): increasing token ranges; the H100's from 1 with no gap or bound."""
    ranges = (((r.head_dim or "other", r.cache or "any"), r.first, r.last) for r in rows)
    launch_tables.check_ranges(ranges, cover=device is None, what="head_dim, cache")


def rope_kv_table() -> launch_tables.LaunchTable[LayoutRow]:
    """The RoPE + KV layouts (sgl_ext/tables/rope_kv.json), loaded on first use."""
    return launch_tables.load("rope_kv", _rope_kv_row, _check)


def qk_norm_table() -> launch_tables.LaunchTable[LayoutRow]:
    """The q/k-norm op's layouts (sgl_ext/tables/qk_norm.json), loaded on first use."""
    return launch_tables.load("qk_norm", _qk_norm_row, _check)


def __getattr__(name: str) -> object:
    """The tables by their names in the code that held them (read-only views of the data)."""
    if name == "DECODE_DEVICE_LAYOUTS":  # a GPU's own RoPE + KV rows
        return rope_kv_table().devices
    if name in ("QK_NORM_LAYOUTS", "QK_NORM_LAYOUTS_OTHER"):  # D = 128, other head sizes
        dim = 128 if name == "QK_NORM_LAYOUTS" else None
        return tuple(r for r in qk_norm_table().rows if r.head_dim == dim)
    if name == "QK_NORM_DEVICE_LAYOUTS":  # a GPU's own q/k-norm rows
        return qk_norm_table().devices
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _find(
    table: launch_tables.LaunchTable[LayoutRow],
    device: torch.device | None,
    num_tokens: int,
    head_dim: int | None,
    cache: str | None,
) -> LayoutRow | None:
    """The first row of `device`'s own, then the H100's, for this call."""
    for row in table.rows_for(device):
        if row.head_dim == head_dim and row.cache == cache and row.covers(num_tokens):
            return row
    return None


def _capped(cfg: LaunchConfig, max_heads: int) -> LaunchConfig:
    """cfg with block_h at most the call's heads rounded up to a power of two."""
    block_h = min(cfg.block_h, next_pow2(max_heads))
    return cfg if block_h == cfg.block_h else replace(cfg, block_h=block_h)


def launch_config(
    num_tokens: int,
    max_heads: int,
    head_dim: int,
    fp8_cache: bool = False,
    device: torch.device | None = None,
) -> LaunchConfig:
    """The RoPE + KV layout: SGL_EXT_TRITON_CONFIG's if set, else rope_kv.json's row for (T,
    head size, cache) (device: the GPU whose own rows come first; None: the H100's), else,
    for head sizes without rows, the formula the rows follow (`_formula`)."""
    override = settings.get().triton_config
    if override is not None:  # SGL_EXT_TRITON_CONFIG, for tuning
        return override
    cache = "fp8" if fp8_cache else "16bit"
    row = _find(rope_kv_table(), device, num_tokens, head_dim, cache)
    if row is None:
        return _formula(num_tokens, max_heads, head_dim)
    assert row.config is not None
    return _capped(row.config, max_heads)


def _formula(num_tokens: int, max_heads: int, head_dim: int) -> LaunchConfig:
    """Head sizes without rows: one head a program up to 8 tokens (the key/value program is
    the long one), ~512 elements a program up to 64; then merged programs (a query and a
    key/value block share the position and its cos/sin row) of ~1K elements, or ~2K on 8 warps
    for heads of at most 64 past 256 tokens. Block heads capped at 32 and at the call's heads."""
    cap = min(32, next_pow2(max_heads))
    if num_tokens <= 8:
        return LaunchConfig(1, 4, GridOrder.TWO_D, load=LoadOrder.PRE_WAIT)
    if num_tokens <= 64:
        block_h = min(_pow2_floor(512 // head_dim), cap)
        return LaunchConfig(block_h, 4, GridOrder.TWO_D, load=LoadOrder.PRE_WAIT)
    if num_tokens <= 256 or head_dim > 64:
        block_h, num_warps = _pow2_floor(1024 // head_dim), 4
    else:
        block_h, num_warps = _pow2_floor(2048 // head_dim), 8
    return LaunchConfig(min(block_h, cap), num_warps, programs=Programs.MERGED)


# The norm's sum of squares in float64 (exact: q/k bits independent of any launch layout) or
# float32 (bits pinned by qk_norm_launch_config's layout, which is the same with and without
# the KV write, so the fused and unfused Qwen3 paths still agree bit for bit).
QK_NORM_SUM_FP64 = False


def qk_norm_layouts(device: torch.device | None) -> tuple[LayoutRow, ...]:
    """The q/k-norm rows a call on `device` reads, in order: its GPU's own, then the H100's."""
    return qk_norm_table().rows_for(device)


def qk_norm_launch_config(
    num_tokens: int, max_heads: int, head_dim: int, device: torch.device | None = None
) -> LaunchConfig:
    """The QK_NORM variant's layout on `device` (None: the H100's rows): a function of the
    token count, head shape and GPU only, never of the KV write or the cache dtype, so the op
    rounds the float32 sum of squares the same way with and without the write.
    SGL_EXT_TRITON_CONFIG overrides it as it does launch_config."""
    if settings.get().triton_config is not None:
        return launch_config(num_tokens, max_heads, head_dim, fp8_cache=False)
    table = qk_norm_table()
    dim = head_dim if any(r.head_dim == head_dim for r in table.rows) else None
    row = _find(table, device, num_tokens, dim, None)
    assert row is not None  # the H100's rows cover every token count of each head size
    if row.config is not None:
        return _capped(row.config, max_heads)
    cfg = launch_config(num_tokens, max_heads, head_dim, fp8_cache=False)
    if row.load is not None and cfg.load is LoadOrder.START:
        cfg = replace(cfg, load=row.load)
    return cfg


def _pos_last_mode(cfg: LaunchConfig, merged: bool) -> int:
    """The kernel's POS_LAST for a layout (see rope_kv_kernel)."""
    if cfg.load is LoadOrder.PRE_WAIT:
        return 4
    if cfg.load is LoadOrder.LOAD_BARRIER:
        return 3
    if cfg.load is LoadOrder.POS_LAST:
        return 2 if merged and not cfg.hoist else 1
    return 0


def plan_rope_kv(
    call: RopeCall,
    q_align: int,
    k_align: int,
    kb_align: int,
    enable_pdl: bool | None,
    norm: QKNormCall | None = None,
) -> KernelLauncher:
    """The kernel launch for a checked call: grid, fixed arguments, constexprs, options.

    q_align / k_align / kb_align: data_ptr() % 16 of query, key and k_buffer (GPT-J pairs load
    as 32-bit words only from 4-byte aligned rows). query None in `call`: the KV write alone;
    kv None: RoPE alone; norm: RMSNorm every q and k head first (the QK_NORM variant). Per
    call, `launch` (tensors) or `KernelLauncher.direct` (pointers) takes pos, cos_sin, q, k, v,
    k_buffer, v_buffer, cache_loc, k_scale, v_scale, q_norm_weight, k_norm_weight in that
    order (`rope_kv_schema.stand_in` fills the ones a call does not have).
    """
    s = settings.get()
    head_size = call.head_size
    rotate = call.query is not None
    # A plain KV write moves each head as one neox-style "pair" tile (plus an odd tail dim).
    rot = call.rot_dim if rotate else head_size - head_size % 2
    q = call.query
    num_q_heads, q_tok, q_head = (q.num_heads, q.token_stride, q.head_stride) if q else (0, 0, 0)
    k = call.key
    kv = call.kv
    kv_fixed, kv_consts = rope_kv_schema.kv_write_values(kv)
    if kv is not None:
        v_tok, v_head, v_head_dim = kv.value.token_stride, kv.value.head_stride, kv.v_head_dim
        k_dtype, kb_strides = kv.k_dtype, kv.k_layout.strides
    else:
        v_tok, v_head, v_head_dim = 0, 0, 1
        k_dtype, kb_strides = call.dtype, (0, 0, 0)
    k_fp8_max = fp8_max(k_dtype)
    max_heads = max(num_q_heads, k.num_heads)
    if norm is not None:  # one layout with and without the KV write (q/k bits)
        cfg = qk_norm_launch_config(call.num_tokens, max_heads, head_size, call.device)
    else:
        # the GPU's own decode rows were measured with a KV write into a 16-bit cache
        own_rows = kv is not None and k_dtype in (torch.bfloat16, torch.float16)
        dev = call.device if own_rows else None
        cfg = launch_config(call.num_tokens, max_heads, head_size, k_fp8_max > 0, dev)
    block_h = cfg.block_h
    num_q_blocks = _cdiv(num_q_heads, block_h)
    merged = cfg.programs is not Programs.SEPARATE and num_q_blocks > 0
    block_hkv = min(cfg.kv_block_h or block_h, next_pow2(k.num_heads))
    if merged and cfg.programs is Programs.SPREAD:
        block_hkv = next_pow2(_cdiv(k.num_heads, num_q_blocks))
    num_kv_blocks = _cdiv(k.num_heads, block_hkv)
    per_token = max(num_q_blocks, num_kv_blocks) if merged else num_q_blocks + num_kv_blocks
    order = cfg.order
    if order is GridOrder.KV_FIRST and not (merged and per_token > num_kv_blocks):
        order = GridOrder.TOKEN  # nothing to put first
    # The 2-D grid's second axis holds at most 65535 blocks per token (never reached: heads).
    n = call.num_tokens
    grid = (n * per_token,) if order is not GridOrder.TWO_D else (n, per_token)
    if enable_pdl is None:
        enable_pdl = pdl_on(call.device)
    use_pdl = bool(enable_pdl) and not s.interpret
    tail = head_size - rot
    pair_mode = 0
    if rotate and not call.is_neox:
        rows = [(q_align, q_tok, q_head), (k_align, *_strides(k))]
        if norm is not None:  # the weights load as pairs too
            rows += [(norm.q_weight_align, 0, 0), (norm.k_weight_align, 0, 0)]
        pair_mode = _gptj_mode(call.dtype, rows)
    kbuf_mode = pair_mode
    if pair_mode == 2 and (k_dtype != call.dtype or not _word_aligned(kb_align, *kb_strides)):
        kbuf_mode = 1
    pre_wait = cfg.load is LoadOrder.PRE_WAIT
    options: dict[str, object] = {"num_warps": cfg.num_warps}
    if use_pdl:
        options["launch_pdl"] = True
    if cfg.maxnreg and not s.interpret:
        options["maxnreg"] = cfg.maxnreg
    fixed = rope_kv_schema.fixed(
        **kv_fixed,
        cs_stride=call.cs_stride if rotate else 0,
        q_tok_stride=q_tok,
        q_head_stride=q_head,
        k_tok_stride=k.token_stride,
        k_head_stride=k.head_stride,
        v_tok_stride=v_tok,
        v_head_stride=v_head,
        num_q_heads=num_q_heads,
        num_kv_heads=k.num_heads,
        max_pos=call.max_pos if rotate else 1,
        eps=norm.eps if norm is not None else 0.0,
    )
    constexprs = rope_kv_schema.constexprs(
        **kv_consts,
        NUM_Q_BLOCKS=num_q_blocks,
        NUM_KV_BLOCKS=num_kv_blocks,
        MERGED=merged,
        GRID_ORDER=order.code,
        HEAD_DIM=head_size,
        V_HEAD_DIM=v_head_dim,
        ROT_DIM=rot,
        BLOCK_HALF=next_pow2(max(1, rot // 2)),
        BLOCK_TAIL=next_pow2(tail) if tail > 0 else 0,
        BLOCK_DV=next_pow2(v_head_dim),
        BLOCK_H=block_h,
        BLOCK_HKV=block_hkv,
        PAIR_MODE=pair_mode,
        KBUF_PAIR_MODE=kbuf_mode,
        IS_BF16=call.dtype == torch.bfloat16,
        ROTATE=rotate,
        WRITE_KV=kv is not None,
        EMULATE_FP8=s.interpret,
        USE_PDL=use_pdl,
        QK_NORM=norm is not None,
        SS_FP64=norm is not None and QK_NORM_SUM_FP64,
        POS_LAST=_pos_last_mode(cfg, merged) if rotate else 0,
        HOIST=merged and cfg.hoist,
        EARLY_RELEASE=use_pdl and cfg.early_release,
        NORM_W_PRE=norm is not None and rotate and pre_wait and cfg.norm_w_pre,
        SLOT_PRE=kv is not None and rotate and pre_wait and cfg.slot_pre,
    )
    return make_launcher(
        rope_kv_kernel, grid, fixed, constexprs, options, call.device, rope_kv_schema.CALL_NAMES
    )


def _strides(v) -> tuple[int, int]:
    return v.token_stride, v.head_stride
