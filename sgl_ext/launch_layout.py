"""A launch layout of the rope_kv Triton kernel (the RoPE op, the q/k-norm op, `set_kv_buffer`):
`LaunchConfig` and its named values, spelled as a table row (`sgl_ext/tables/rope_kv.json`,
`qk_norm.json`) and as `SGL_EXT_TRITON_CONFIG`.

`SGL_EXT_TRITON_CONFIG` forces one layout (tuning, tests) in either spelling:
- readable: `block_h=16,num_warps=4,order=2d,load=pre_wait,early_release=1` (LaunchConfig's
  fields; block_h and num_warps required, the rest default; `tuning_string` writes it);
- positional: up to 14 integers, the fields of the boolean layout this one replaced, in order
  (`LEGACY_FIELDS`: block_h, num_warps, order 0-2, merged, spread, maxnreg, pos_last, hoist,
  early_release, load_barrier, kv_block_h, pre_wait, norm_w_pre, slot_pre; flags 0 / 1).

Plain Python (no torch, no Triton): `settings` reads the variable through it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from enum import Enum

ENV = "SGL_EXT_TRITON_CONFIG"


class GridOrder(Enum):
    """The order of the programs on the grid."""

    TWO_D = "2d"  # (tokens, blocks) grid, no index division; block 0 of every token runs first
    TOKEN = "token"  # 1-D, token-major: a token's programs are neighbours (its cos/sin row)
    KV_FIRST = "kv_first"  # 1-D, merged programs: every token's key/value program first

    @property
    def code(self) -> int:
        """The kernel's GRID_ORDER."""
        return _GRID_CODES.index(self)


_GRID_CODES = (GridOrder.TWO_D, GridOrder.TOKEN, GridOrder.KV_FIRST)


class Programs(Enum):
    """What one program does."""

    SEPARATE = "separate"  # a block of query heads, or a block of key/value heads
    MERGED = "merged"  # query block j and key/value block j (one position and cos/sin row)
    SPREAD = "spread"  # merged, the key/value heads spread over all query blocks (GQA groups)


class LoadOrder(Enum):
    """When a program loads the position and its cos/sin row (the kernel's POS_LAST)."""

    START = "start"  # first
    POS_LAST = "pos_last"  # after the data loads
    LOAD_BARRIER = "load_barrier"  # every other load, a barrier, then the position and cos/sin
    PRE_WAIT = "pre_wait"  # before the PDL wait, while the previous kernel still runs


@dataclass(frozen=True)
class LaunchConfig:
    """One launch layout of the rope_kv kernel.

    block_h : query heads per program (key/value heads: at most this many), a power of two.
    num_warps : warps per program, a power of two <= 32.
    order, programs, load : GridOrder, Programs, LoadOrder.
    hoist : merged programs issue every load before the key/value branch (the kernel's HOIST).
    early_release : with PDL, release the next launch before the wait (EARLY_RELEASE).
    kv_block_h : key/value heads per program (0: as block_h; spread programs choose their own).
    maxnreg : register cap per thread (0: the compiler's choice).
    norm_w_pre : load PRE_WAIT, the q/k norm: its weight rows before the wait too (NORM_W_PRE).
    slot_pre : load PRE_WAIT, a KV write: the slot and its cache rows before the wait too.
    """

    block_h: int
    num_warps: int
    order: GridOrder = GridOrder.TOKEN
    programs: Programs = Programs.SEPARATE
    load: LoadOrder = LoadOrder.START
    hoist: bool = False
    early_release: bool = False
    kv_block_h: int = 0
    maxnreg: int = 0
    norm_w_pre: bool = False
    slot_pre: bool = False

    def __post_init__(self) -> None:
        for f in fields(self):
            want = _KINDS[f.name]
            v = getattr(self, f.name)
            if not isinstance(v, want) or (want is int and isinstance(v, bool)):
                raise TypeError(f"LaunchConfig.{f.name} must be {want.__name__}, got {v!r}")
        if not _pow2(self.block_h) or not _pow2(self.num_warps) or self.num_warps > 32:
            raise ValueError(f"block_h and num_warps must be powers of two (warps <= 32): {self}")
        if self.kv_block_h and not _pow2(self.kv_block_h):
            raise ValueError(f"kv_block_h must be 0 or a power of two: {self}")
        if self.maxnreg < 0:
            raise ValueError(f"maxnreg must be >= 0: {self}")
        if self.hoist and self.programs is Programs.SEPARATE:
            raise ValueError(f"hoist needs merged or spread programs: {self}")
        if (self.norm_w_pre or self.slot_pre) and self.load is not LoadOrder.PRE_WAIT:
            raise ValueError(f"norm_w_pre and slot_pre need load pre_wait: {self}")

    @classmethod
    def from_row(cls, row: Mapping[str, object]) -> LaunchConfig:
        """The layout a table row spells: {"block_h": 4, "num_warps": 4, "order": "2d", ...};
        block_h and num_warps required, every other field defaulting; flags true / false."""
        unknown = sorted(set(row) - set(_KINDS))
        if unknown:
            raise ValueError(f"unknown key {unknown[0]!r} (a layout takes {', '.join(_KINDS)})")
        missing = [k for k in ("block_h", "num_warps") if k not in row]
        if missing:
            raise ValueError(f"missing {missing[0]!r}")
        return cls(**{k: _value(k, v) for k, v in row.items()})  # type: ignore[arg-type]

    def to_row(self) -> dict[str, object]:
        """The table row of this layout: block_h, num_warps, then the fields not at their
        default (enums by name, flags as true)."""
        out: dict[str, object] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name in ("block_h", "num_warps") or v != f.default:
                out[f.name] = v.value if isinstance(v, Enum) else v
        return out


_KINDS: dict[str, type] = {
    "block_h": int,
    "num_warps": int,
    "order": GridOrder,
    "programs": Programs,
    "load": LoadOrder,
    "hoist": bool,
    "early_release": bool,
    "kv_block_h": int,
    "maxnreg": int,
    "norm_w_pre": bool,
    "slot_pre": bool,
}
# The positional SGL_EXT_TRITON_CONFIG: the fields of the boolean layout, in its order.
LEGACY_FIELDS = (
    "block_h",
    "num_warps",
    "order",
    "merged",
    "spread",
    "maxnreg",
    "pos_last",
    "hoist",
    "early_release",
    "load_barrier",
    "kv_block_h",
    "pre_wait",
    "norm_w_pre",
    "slot_pre",
)
_TRUE = ("1", "true")
_FALSE = ("0", "false")


def _pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def _value(key: str, v: object) -> object:
    """A row's or a tuning string's value of field `key`, as LaunchConfig takes it."""
    kind = _KINDS[key]
    if issubclass(kind, Enum):
        names = [m.value for m in kind]  # type: ignore[attr-defined]
        if v not in names:
            raise ValueError(f"{key} must be one of {', '.join(names)}, got {v!r}")
        return kind(v)
    if isinstance(v, str):  # a tuning string's text
        text = v.strip().lower()
        if kind is bool and text in _TRUE + _FALSE:
            return text in _TRUE
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"{key} must be an integer, got {v!r}") from None
    if kind is bool and not isinstance(v, bool):
        raise ValueError(f"{key} must be true or false, got {v!r}")
    return v


def tuning_string(cfg: LaunchConfig) -> str:
    """The readable SGL_EXT_TRITON_CONFIG that forces `cfg` (parse_tuning reads it back)."""
    row = cfg.to_row()
    return ",".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in row.items())


def parse_tuning(value: str | Sequence[int] | LaunchConfig) -> LaunchConfig:
    """The layout an SGL_EXT_TRITON_CONFIG gives: readable `key=value,...` text, positional
    integers (text or a sequence; see the module docstring) or a LaunchConfig."""
    if isinstance(value, LaunchConfig):
        return value
    if isinstance(value, str):
        items = [s.strip() for s in value.split(",")]
        if any("=" in s for s in items):
            return _parse_readable(items)
        try:
            value = tuple(int(s) for s in items)
        except ValueError:
            raise ValueError(
                f"{ENV} takes key=value pairs or comma-separated integers, got {value!r}"
            ) from None
    return _parse_positional(tuple(value))


def _parse_readable(items: list[str]) -> LaunchConfig:
    row: dict[str, str] = {}
    for item in items:
        key, sep, v = item.partition("=")
        key = key.strip()
        if not sep or key in row:
            raise ValueError(f"{ENV}: {item!r} is not one new key=value")
        row[key] = v.strip()
    try:
        return LaunchConfig.from_row(row)
    except (ValueError, TypeError) as err:
        raise ValueError(f"{ENV}: {err}") from None


def _parse_positional(values: tuple[int, ...]) -> LaunchConfig:
    """The layout of the positional spelling; a flag without effect in the boolean layout (hoist
    or spread on separate programs, norm_w_pre / slot_pre without pre_wait) is dropped, and of
    pre_wait, load_barrier and pos_last the first set wins (the kernel's precedence)."""
    if not 2 <= len(values) <= len(LEGACY_FIELDS):
        raise ValueError(
            f"{ENV} takes 2 to {len(LEGACY_FIELDS)} integers ({', '.join(LEGACY_FIELDS)}), "
            f"got {len(values)}"
        )
    if any(not isinstance(v, int) or isinstance(v, bool) for v in values):
        raise ValueError(f"{ENV} positional values must be integers, got {values!r}")
    v = dict.fromkeys(LEGACY_FIELDS, 0)
    v["order"] = GridOrder.TOKEN.code  # the boolean layout's default
    v.update(zip(LEGACY_FIELDS, values, strict=False))
    if not 0 <= v["order"] < len(_GRID_CODES):
        raise ValueError(
            f"{ENV}: order must be 0 (2d), 1 (token) or 2 (kv_first), got {v['order']}"
        )
    merged = bool(v["merged"])
    programs = Programs.SEPARATE
    if merged:
        programs = Programs.SPREAD if v["spread"] else Programs.MERGED
    load = LoadOrder.START
    for flag, order in (
        ("pre_wait", LoadOrder.PRE_WAIT),
        ("load_barrier", LoadOrder.LOAD_BARRIER),
        ("pos_last", LoadOrder.POS_LAST),
    ):
        if v[flag]:
            load = order
            break
    pre = load is LoadOrder.PRE_WAIT
    try:
        return LaunchConfig(
            v["block_h"],
            v["num_warps"],
            _GRID_CODES[v["order"]],
            programs,
            load,
            hoist=merged and bool(v["hoist"]),
            early_release=bool(v["early_release"]),
            kv_block_h=v["kv_block_h"],
            maxnreg=v["maxnreg"],
            norm_w_pre=pre and bool(v["norm_w_pre"]),
            slot_pre=pre and bool(v["slot_pre"]),
        )
    except (ValueError, TypeError) as err:
        raise ValueError(f"{ENV}: {err}") from None
