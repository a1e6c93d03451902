"""Host side of the rope_kv Triton kernel: launch heuristics (`launch_config`), the launch plan
(`plan_rope_kv`: grid, fixed arguments, constexprs, a `KernelLauncher`) and the per-call
argument tuple (`rope_kv_args`). The kernel itself is rope_kv.py.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from sgl_ext import rope_kv_schema, settings
from sgl_ext._common import QKNormCall, RopeCall, fp8_max, next_pow2
from sgl_ext.device_tables import device_tables
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


ORDER_2D = 0  # 2-D (tokens, blocks) grid; the hardware runs block 0 of every token first
ORDER_TOKEN = 1  # 1-D grid, token-major: a token's programs are neighbours
ORDER_KV_FIRST = 2  # 1-D grid, merged only: every token's key/value program, then the others


class LaunchConfig(NamedTuple):
    block_h: int  # query heads per program (key/value heads: at most this many)
    num_warps: int
    order: int = ORDER_TOKEN  # program order on the grid (ORDER_*)
    merged: bool = False  # program j does query block j and key/value block j
    spread: bool = False  # merged: key/value heads spread over all query blocks (GQA groups)
    maxnreg: int = 0  # register cap per thread (0: the compiler's choice)
    pos_last: bool = False  # load the position after the data loads (the kernel's POS_LAST)
    hoist: bool = False  # merged: every load before the key/value branch (the kernel's HOIST)
    early_release: bool = False  # PDL: release the next launch before the wait (EARLY_RELEASE)
    load_barrier: bool = False  # every load, then a barrier, then cos/sin (the kernel's POS_LAST 3)
    kv_block_h: int = 0  # key/value heads per program (0: as block_h; spread decides its own)
    pre_wait: bool = False  # the position and cos/sin row before the PDL wait (POS_LAST 4)
    # pre_wait with the q/k norm: its weight rows before the wait too (the kernel's NORM_W_PRE)
    norm_w_pre: bool = False
    # pre_wait with the KV write: the slot and its cache rows before the wait too (SLOT_PRE)
    slot_pre: bool = False


class DecodeRow(NamedTuple):
    """A GPU's own RoPE + KV layout for first <= T <= last tokens at the head sizes listed."""

    first: int
    last: int
    head_dims: tuple[int, ...]
    config: LaunchConfig


# A GPU's own RoPE + KV layouts at decode sizes (T <= 64) with a 16-bit cache (plan_rope_kv
# passes the device only for KV writes into one), by a substring of its name (device_tables);
# elsewhere launch_config's H100 layouts. The measurements: benchmarks/RESULTS.md 1.4. H200:
# - T <= 8, D = 128: 4 heads x 4 warps beat one head a program (fp8 caches lost with it).
# - 25..64 at D = 128, 32..64 at D = 64: 16 heads x 4 warps with the early release beat the
#   H100's 4-head PRE_WAIT row (it lost below those bounds and on fp8 caches).
DECODE_DEVICE_LAYOUTS: dict[str, tuple[DecodeRow, ...]] = {
    "H200": (
        DecodeRow(1, 8, (128,), LaunchConfig(4, 4, ORDER_2D, pre_wait=True)),
        DecodeRow(25, 64, (128,), LaunchConfig(16, 4, ORDER_2D, early_release=True, pre_wait=True)),
        DecodeRow(32, 64, (64,), LaunchConfig(16, 4, ORDER_2D, early_release=True, pre_wait=True)),
    ),
}


def _device_decode_layout(
    num_tokens: int, max_heads: int, head_dim: int, device: torch.device | None
) -> LaunchConfig | None:
    """The GPU's own DECODE_DEVICE_LAYOUTS row for this call (heads capped at the call's), or
    None."""
    for rows in device_tables(DECODE_DEVICE_LAYOUTS, device):
        for row in rows:
            if row.first <= num_tokens <= row.last and head_dim in row.head_dims:
                return row.config._replace(block_h=min(row.config.block_h, next_pow2(max_heads)))
    return None


def launch_config(
    num_tokens: int,
    max_heads: int,
    head_dim: int,
    fp8_cache: bool = False,
    device: torch.device | None = None,
) -> LaunchConfig:
    """Heads per program and warps: small batches split heads finer for parallelism. device:
    the GPU whose own rows apply (DECODE_DEVICE_LAYOUTS; None: the H100's)."""
    override = settings.get().triton_config
    if override:  # SGL_EXT_TRITON_CONFIG, for tuning
        return parse_tuning(override)
    # The H100's rules (measurements: benchmarks/RESULTS.md 8; why: docs/performance.md).
    # Up to 64 tokens:
    # separate query and key/value programs, one head each up to 8 tokens (latency: the K/V
    # program is the long one, and fp8 scales make it longer), 512 elements each up to 64.
    # More tokens: merged programs (a query block and a key/value block share the program, its
    # position and its cos/sin row), ~1K (D=128) or ~2K (D=64) elements per program, about 4
    # elements of each half tile per thread.
    # The 2-D grid (no index division) is faster than the 1-D grid at T <= 8.
    # LOAD_BARRIER (load_barrier): every load, then a barrier, then the cos/sin row (two round
    # trips; ptxas otherwise issues V's load after the slot's or the position's has come back),
    # with bf16 / fp16 caches where it measured faster: D = 64 at T <= 8 and 65 <= T <= 1024.
    # PRE_WAIT (pre_wait) up to 64 tokens: the position and its cos/sin row are loaded while the
    # previous kernel still runs, one round trip less after the wait (docs/performance.md).
    d64 = head_dim == 64 and not fp8_cache
    own = None if fp8_cache else _device_decode_layout(num_tokens, max_heads, head_dim, device)
    if own is not None:
        return own
    if num_tokens <= 8:
        if d64:  # 8 query heads or 2 key/value heads a program (0.91-0.97x one-head programs)
            bh = min(8, next_pow2(max_heads))
            return LaunchConfig(bh, 4, ORDER_2D, kv_block_h=2, pre_wait=True)
        return LaunchConfig(1, 4, ORDER_2D, pre_wait=True)
    if num_tokens <= 64:
        # PRE_WAIT here too: faster than the LOAD_BARRIER / plain layouts it replaced, at both
        # head sizes and cache dtypes measured
        bh = min(_pow2_floor(512 // head_dim), 32, next_pow2(max_heads))
        return LaunchConfig(bh, 4, ORDER_2D, pre_wait=True)
    if d64 and num_tokens <= 384:  # separate programs of 16 heads (merged: 1.02-1.04x)
        return LaunchConfig(min(16, next_pow2(max_heads)), 4, ORDER_2D, load_barrier=True)
    maxnreg = 0
    if fp8_cache and num_tokens > 896 and head_dim in (64, 128):
        # fp8 caches from ~1K tokens: 16 heads x 4 warps, so each thread stores 8-byte pieces
        # of K and V rather than 4-byte ones; measured -1 to -4% (T 1024..32768), D = 64 with
        # a 40-register cap (without it, 16 x 4 is slower than 32 x 8).
        block_h, num_warps, maxnreg = 16, 4, 40 if head_dim == 64 else 0
    elif num_tokens <= 256 or head_dim > 64:
        block_h, num_warps = _pow2_floor(1024 // head_dim), 4
    else:
        block_h, num_warps = _pow2_floor(2048 // head_dim), 8
    block_h = min(block_h, 32, next_pow2(max_heads))
    # At D = 128 the program with the key/value block moves ~3.5x the bytes of a query-only
    # one. Where the grid is a little over one wave, starting those first shortens the tail:
    # measured -1 to -3% (bf16 cache, T 448..640) and -2 to -5% (fp8, T 384..896 with 8
    # heads), +1 to +7% outside those windows (Llama-3-8B shape, H100, benchmarks/RESULTS.md 8).
    # D = 64 (gpt-oss): no gain.
    lo, hi = (352, 896) if fp8_cache else (416, 704)
    order = ORDER_KV_FIRST if head_dim == 128 and lo < num_tokens <= hi else ORDER_TOKEN
    lb = d64 and num_tokens <= 1024
    return LaunchConfig(block_h, num_warps, order, merged=True, maxnreg=maxnreg, load_barrier=lb)


# The q/k-norm variant (QK_NORM, issue 17): its choices, in one place.
# QK_NORM_SUM_FP64: the norm's sum of squares in float64 (exact: q/k bits independent of any
# launch layout) or float32 (bits pinned by qk_norm_launch_config's layout, which is the same
# with and without the KV write, so the fused and unfused Qwen3 paths still agree bit for bit).
QK_NORM_SUM_FP64 = False
# Its layout by token count, D = 128 (Qwen3): the first row whose bound is >= T; None:
# launch_config's bf16-cache layout. `benchmarks/tune_qk_norm.py` times candidates per row
# against RoPE + KV alone and prints this table with the winners (`gpu_run.sh qknorm_sweep`).
# Separate programs of 4 query heads (or a key/value block) x 4 warps up to 64 tokens, then of
# 8 query heads (2 key/value heads up to 160 tokens, 8 up to 256, then 4). POS_LAST (see
# rope_kv_kernel) up to 32 tokens, where a program's latency is the time: the norm overlaps the
# position -> cos/sin round trips instead of following them; EARLY_RELEASE (the PDL order of
# the other kernels; this kernel waits first by default) up to 8; PRE_WAIT up to 8 and at
# 33..64. From 65 tokens LOAD_BARRIER (POS_LAST 3): every load, a barrier, then the cos/sin
# row, the norm under its round trip; without it ptxas issued V's (or the slot's) load after the
# key's norm, three round trips in a key/value program. (Merged programs, HOIST included, were
# slower there: 1.07-1.24x.)
QK_NORM_LAYOUTS: tuple[tuple[int, LaunchConfig | None], ...] = (
    # Comments: the worst ratio to RoPE + KV alone over Qwen3-8B / -32B at the row's swept T
    # (H100), and what the row beat; the measurements are benchmarks/RESULTS.md 8.
    # Up to 8: PRE_WAIT, plus the norm weights (from DRAM at decode) and the slot's cache rows
    # (its arithmetic sat behind the key's norm) before the wait, in this row only: elsewhere
    # they measured slower.
    (
        8,
        LaunchConfig(
            4, 4, ORDER_2D, early_release=True, pre_wait=True, norm_w_pre=True, slot_pre=True
        ),
    ),
    (32, LaunchConfig(4, 4, ORDER_2D, pos_last=True)),  # 1.017 (1 x 1 with POS_LAST: 1.094)
    # 33..64: PRE_WAIT (LOAD_BARRIER was slower); RoPE + KV alone has PRE_WAIT here as well
    (64, LaunchConfig(4, 4, ORDER_2D, pre_wait=True)),
    # separate programs of 8 query heads or 2 key/value heads up to 160 tokens: 1.052-1.065
    # (8 key/value heads: 1.064; merged 4 x 4 programs: 1.08-1.24); from 161 of 8 (2: 1.079
    # at 192 on Qwen3-32B, 1.09 waves)
    (160, LaunchConfig(8, 4, ORDER_2D, load_barrier=True, kv_block_h=2)),
    (256, LaunchConfig(8, 4, ORDER_2D, load_barrier=True)),  # 1.037
    # 4 key/value heads a program: bf16 1.00-1.04 (8: 0.98-1.04), fp8 e4m3 0.96-1.05 (8:
    # 1.05-1.18) at T 300..4096
    (1 << 62, LaunchConfig(8, 4, ORDER_TOKEN, load_barrier=True, kv_block_h=4)),
)
# A GPU's own table, by a substring of its name (device_tables), where its sweep measured the
# H100's rows worse (benchmarks/RESULTS.md 8). The layout cannot follow the cache dtype, so a
# row is judged on bf16 and fp8 caches together. H200: at 9..64 tokens 16 query and 4 key/value
# heads a program (PRE_WAIT, norm weights before the wait, early release; 8 key/value heads lost
# on fp8); from 1025 tokens 16 heads x 4 warps (at 512 / 1024 it lost on fp8).
QK_NORM_DEVICE_LAYOUTS: dict[str, tuple[tuple[int, LaunchConfig | None], ...]] = {
    "H200": (
        QK_NORM_LAYOUTS[0],
        (
            64,
            LaunchConfig(
                16, 4, ORDER_2D, early_release=True, kv_block_h=4, pre_wait=True, norm_w_pre=True
            ),
        ),
        *(row for row in QK_NORM_LAYOUTS[:-1] if row[0] > 64),
        (1024, QK_NORM_LAYOUTS[-1][1]),
        (1 << 62, LaunchConfig(16, 4, ORDER_TOKEN, load_barrier=True)),
    ),
}
# Other head sizes: one head x one warp up to 8 tokens, then launch_config's layout.
QK_NORM_LAYOUTS_OTHER: tuple[tuple[int, LaunchConfig | None], ...] = (
    (8, LaunchConfig(1, 1, ORDER_2D, pre_wait=True)),
    (1 << 62, None),
)
# The rows with None (launch_config's layout) load the position last up to this many tokens.
QK_NORM_POS_LAST_TOKENS = 1023


def qk_norm_layouts(device: torch.device | None) -> tuple[tuple[int, LaunchConfig | None], ...]:
    """The D = 128 layout table on `device`: its GPU's own (QK_NORM_DEVICE_LAYOUTS), else
    QK_NORM_LAYOUTS."""
    own = device_tables(QK_NORM_DEVICE_LAYOUTS, device)
    return own[0] if own else QK_NORM_LAYOUTS


def qk_norm_launch_config(
    num_tokens: int, max_heads: int, head_dim: int, device: torch.device | None = None
) -> LaunchConfig:
    """The QK_NORM variant's layout on `device` (None: the H100 table): a function of the token
    count, head shape and GPU only, never of the KV write or the cache dtype, so the op rounds
    the float32 sum of squares the same way with and without the write. SGL_EXT_TRITON_CONFIG
    overrides it as it does launch_config."""
    if settings.get().triton_config:
        return launch_config(num_tokens, max_heads, head_dim, fp8_cache=False)
    rows = qk_norm_layouts(device) if head_dim == 128 else QK_NORM_LAYOUTS_OTHER
    cfg = next((c for hi, c in rows if num_tokens <= hi), None)
    if cfg is None:
        cfg = launch_config(num_tokens, max_heads, head_dim, fp8_cache=False)
        return cfg._replace(pos_last=num_tokens <= QK_NORM_POS_LAST_TOKENS)
    return cfg._replace(block_h=min(cfg.block_h, next_pow2(max_heads)))


def tuning_string(cfg: LaunchConfig) -> str:
    """The SGL_EXT_TRITON_CONFIG string that forces `cfg` (parse_tuning reads it back)."""
    return ",".join(str(int(x)) for x in cfg)


def parse_tuning(values: tuple[int, ...]) -> LaunchConfig:
    """The LaunchConfig an SGL_EXT_TRITON_CONFIG string gives: LaunchConfig's fields in order
    (the first two required, the rest defaulting), each bool field from 0 / 1."""
    fields = LaunchConfig._fields
    if not 2 <= len(values) <= len(fields):
        raise ValueError(
            f"SGL_EXT_TRITON_CONFIG takes 2 to {len(fields)} integers ({', '.join(fields)}), "
            f"got {len(values)}"
        )
    kinds = [type(LaunchConfig._field_defaults.get(f, 0)) for f in fields]  # bool or int
    return LaunchConfig(*(kind(v) for kind, v in zip(kinds, values, strict=False)))


def _pos_last_mode(cfg: LaunchConfig, merged: bool) -> int:
    """The kernel's POS_LAST for a layout (see rope_kv_kernel)."""
    if cfg.pre_wait:
        return 4
    if cfg.load_barrier:
        return 3
    if cfg.pos_last:
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
    order (`rope_kv_args` fills the ones a call does not have).
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
    merged = cfg.merged and num_q_blocks > 0
    block_hkv = min(cfg.kv_block_h or block_h, next_pow2(k.num_heads))
    if merged and cfg.spread:
        block_hkv = next_pow2(_cdiv(k.num_heads, num_q_blocks))
    num_kv_blocks = _cdiv(k.num_heads, block_hkv)
    per_token = max(num_q_blocks, num_kv_blocks) if merged else num_q_blocks + num_kv_blocks
    order = cfg.order
    if order == ORDER_KV_FIRST and not (merged and per_token > num_kv_blocks):
        order = ORDER_TOKEN  # nothing to put first
    # The 2-D grid's second axis holds at most 65535 blocks per token (never reached: heads).
    n = call.num_tokens
    grid = (n * per_token,) if order != ORDER_2D else (n, per_token)
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
        GRID_ORDER=order,
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
        NORM_W_PRE=norm is not None and rotate and cfg.pre_wait and cfg.norm_w_pre,
        SLOT_PRE=kv is not None and rotate and cfg.pre_wait and cfg.slot_pre,
    )
    return make_launcher(
        rope_kv_kernel, grid, fixed, constexprs, options, call.device, rope_kv_schema.CALL_NAMES
    )


def _strides(v) -> tuple[int, int]:
    return v.token_stride, v.head_stride


def rope_kv_args(
    positions: torch.Tensor | None,
    query: torch.Tensor | None,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor | None,
    value: torch.Tensor | None,
    k_buffer: torch.Tensor | None,
    v_buffer: torch.Tensor | None,
    cache_loc: torch.Tensor | None,
    k_scale: object,
    v_scale: object,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """The kernel's per-call tensors in pointer order (rope_kv_schema.pointer_tensors); key
    stands in for the ones a call does not have."""
    return rope_kv_schema.pointer_tensors(
        key,
        positions=positions,
        cos_sin_cache=cos_sin_cache,
        query=query,
        value=value,
        k_buffer=k_buffer,
        v_buffer=v_buffer,
        cache_loc=cache_loc,
        k_scale=k_scale,
        v_scale=v_scale,
        q_norm_weight=q_norm_weight,
        k_norm_weight=k_norm_weight,
    )
