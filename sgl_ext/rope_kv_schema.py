"""The rope_kv kernel family's arguments, declared once.

The RoPE op, the q/k-norm op and set_kv_buffer launch one Triton kernel (`triton/rope_kv.py`);
the qkv GEMM's epilogue (`triton/gemm_rope_kv.py`) writes the cache through the same KV-write
arguments. This module declares the kernel's arguments, each with its role, and each op's own
arguments; everything else is derived from the two declarations:

- `CALL_NAMES`: the kernel's runtime parameters in the order a launch plan passes them (the
  per-call pointers, then the plan's fixed arguments): `KernelLauncher`'s call_names;
- `fixed(...)` / `constexprs(...)`: a plan's fixed arguments by name, in that order, and its
  constexprs, every name checked against the kernel's;
- `pointer_tensors(...)` / `stand_in(...)`: a call's tensors in pointer order (the key standing
  in for the ones a call does not have);
- `OpSpec.leaves(...)` / `OpSpec.grad`: where the C fast path (`fast_launch.py`) finds each
  pointer among an op's arguments, and which of them it keys requires_grad on;
- `OpSpec.schema`: the `torch.library` schema of the op's registered form (`_ops.py`).

The kernel's Python signature lists the same names (its own order: each pointer beside its
strides); tests/sgl_ext/test_rope_kv_schema.py checks the two against each other.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from enum import Enum

from sgl_ext._common import KVWrite, fp8_max


class Role(Enum):
    """What a kernel argument is: a per-call pointer, a stride or scalar fixed by the plan, or a
    compile-time constant."""

    POINTER = "pointer"
    STRIDE = "stride"
    SCALAR = "scalar"
    CONSTEXPR = "constexpr"


@dataclass(frozen=True)
class KernelArg:
    """One argument of the rope_kv kernel. tensor: for a pointer, the op argument it points
    into (the name every op of the family gives it)."""

    name: str
    role: Role
    tensor: str | None = None


P, ST, SC, CE = Role.POINTER, Role.STRIDE, Role.SCALAR, Role.CONSTEXPR

# The per-call pointers, in the order a plan receives them.
POINTERS = tuple(
    KernelArg(name, P, tensor)
    for name, tensor in (
        ("pos_ptr", "positions"),
        ("cos_sin_ptr", "cos_sin_cache"),
        ("q_ptr", "query"),
        ("k_ptr", "key"),
        ("v_ptr", "value"),
        ("kbuf_ptr", "k_buffer"),
        ("vbuf_ptr", "v_buffer"),
        ("loc_ptr", "cache_loc"),
        ("k_scale_ptr", "k_scale"),
        ("v_scale_ptr", "v_scale"),
        ("qw_ptr", "q_norm_weight"),
        ("kw_ptr", "k_norm_weight"),
    )
)
# What a plan fixes: strides (elements) and scalars, in the order it passes them.
FIXED = tuple(
    KernelArg(name, role)
    for name, role in (
        ("k_scale_f", SC),  # a float scale's fp32 reciprocal (1.0 without one)
        ("v_scale_f", SC),
        ("cs_stride", ST),
        ("q_tok_stride", ST),
        ("q_head_stride", ST),
        ("k_tok_stride", ST),
        ("k_head_stride", ST),
        ("v_tok_stride", ST),
        ("v_head_stride", ST),
        ("kb_page_stride", ST),
        ("kb_off_stride", ST),
        ("kb_head_stride", ST),
        ("vb_page_stride", ST),
        ("vb_off_stride", ST),
        ("vb_head_stride", ST),
        ("num_slots", SC),
        ("num_q_heads", SC),
        ("num_kv_heads", SC),
        ("max_pos", SC),
        ("eps", SC),  # the q/k norm's epsilon (0.0 without the norm)
    )
)
# The compile-time constants (rope_kv_kernel documents each).
CONSTEXPRS = tuple(
    KernelArg(name, CE)
    for name in (
        "NUM_Q_BLOCKS NUM_KV_BLOCKS MERGED GRID_ORDER PAGE_SIZE HEAD_DIM V_HEAD_DIM ROT_DIM "
        "BLOCK_HALF BLOCK_TAIL BLOCK_DV BLOCK_H BLOCK_HKV PAIR_MODE KBUF_PAIR_MODE IS_BF16 "
        "ROTATE WRITE_KV K_SCALE_MODE V_SCALE_MODE K_FP8_MAX V_FP8_MAX EMULATE_FP8 USE_PDL "
        "QK_NORM SS_FP64 POS_LAST HOIST EARLY_RELEASE NORM_W_PRE SLOT_PRE"
    ).split()
)
KERNEL_ARGS = (*POINTERS, *FIXED, *CONSTEXPRS)
CALL_NAMES = tuple(a.name for a in (*POINTERS, *FIXED))
POINTER_TENSORS = tuple(str(a.tensor) for a in POINTERS)
KV_FIELDS = ("value", "k_buffer", "v_buffer", "cache_loc", "k_scale", "v_scale")


def _ordered(kind: str, args: tuple[KernelArg, ...], values: Mapping[str, object]) -> tuple:
    return ordered(tuple(a.name for a in args), values, f"rope_kv {kind}")


def fixed(**values: int | float) -> tuple[int | float, ...]:
    """A plan's fixed arguments in the order it passes them (every name of FIXED, no other)."""
    return _ordered("fixed arguments", FIXED, values)


def constexprs(**values: object) -> dict[str, object]:
    """A plan's constexprs, every name of CONSTEXPRS and no other, in declaration order."""
    names = [a.name for a in CONSTEXPRS]
    return dict(zip(names, _ordered("constexprs", CONSTEXPRS, values), strict=True))


# The KV write's part of FIXED, which the qkv GEMM's epilogue kernel takes under the same names.
KV_WRITE_FIXED = (
    "k_scale_f",
    "v_scale_f",
    "kb_page_stride",
    "kb_off_stride",
    "kb_head_stride",
    "vb_page_stride",
    "vb_off_stride",
    "vb_head_stride",
    "num_slots",
)


def kv_write_values(kv: KVWrite | None) -> tuple[dict[str, int | float], dict[str, object]]:
    """A checked KV write's fixed arguments (KV_WRITE_FIXED) and constexprs (page size, scale
    modes, fp8 maxima), as every kernel of the family takes them; without a write, values no
    program reads (strides 0, one slot, no scales)."""
    fixed_v: dict[str, int | float]
    modes: dict[str, object]
    if kv is None:
        fixed_v = {"k_scale_f": 1.0, "v_scale_f": 1.0, **dict.fromkeys(KV_WRITE_FIXED[2:8], 0)}
        fixed_v["num_slots"] = 1
        modes = dict(PAGE_SIZE=1, K_SCALE_MODE=0, V_SCALE_MODE=0, K_FP8_MAX=0.0, V_FP8_MAX=0.0)
        return fixed_v, modes
    k, v = kv.k_layout, kv.v_layout
    fixed_v = {
        "k_scale_f": kv.k_inv,
        "v_scale_f": kv.v_inv,
        "kb_page_stride": k.page_stride,
        "kb_off_stride": k.offset_stride,
        "kb_head_stride": k.head_stride,
        "vb_page_stride": v.page_stride,
        "vb_off_stride": v.offset_stride,
        "vb_head_stride": v.head_stride,
        "num_slots": k.num_slots,
    }
    modes = dict(
        PAGE_SIZE=k.page_size,
        K_SCALE_MODE=kv.k_scale_mode,
        V_SCALE_MODE=kv.v_scale_mode,
        K_FP8_MAX=fp8_max(kv.k_dtype),
        V_FP8_MAX=fp8_max(kv.v_dtype),
    )
    return fixed_v, modes


def ordered(names: tuple[str, ...], values: Mapping[str, object], kind: str) -> tuple:
    """values by name in the order of names (a kernel's parameters), every one given once."""
    missing = [n for n in names if n not in values]
    extra = [n for n in values if n not in names]
    if missing or extra:
        raise TypeError(f"{kind}: missing {missing}, unknown {extra}")
    return tuple(values[n] for n in names)


def pointer_tensors(key: object, **tensors: object) -> tuple:
    """A call's per-call tensors in pointer order: each pointer's op argument from `tensors`
    (by its name in POINTERS), `key` for the ones missing (`stand_in`)."""
    unknown = [n for n in tensors if n not in POINTER_TENSORS]
    if unknown:
        raise TypeError(f"rope_kv pointers: unknown {unknown}")
    return stand_in((key if n == "key" else tensors.get(n) for n in POINTER_TENSORS), key)


def stand_in(tensors: Iterable[object], key: object) -> tuple:
    """tensors (pointer order) with key in place of each one that is None or not a tensor (a
    float scale): the kernel never reads a pointer the call does not have."""
    return tuple(t if t is not None and hasattr(t, "data_ptr") else key for t in tensors)


@dataclass(frozen=True)
class OpArg:
    """An op argument: its torch.library type, whether the op writes it, and for an argument
    the C fast path expands (FusedSetKVBufferArg) the fields it is keyed by."""

    name: str
    type: str
    mutable: bool = False
    fields: tuple[OpArg, ...] = ()


def _tensor(name: str, mutable: bool = False, optional: bool = False) -> OpArg:
    return OpArg(name, "Tensor?" if optional else "Tensor", mutable)


# FusedSetKVBufferArg's fields as the C fast path keys them (KV_FIELDS' order).
_KV_ARG_FIELDS = (
    _tensor("value"),
    _tensor("k_buffer", True),
    _tensor("v_buffer", True),
    _tensor("cache_loc"),
    OpArg("k_scale", "Any"),
    OpArg("v_scale", "Any"),
)
_KV_ARG = OpArg("fused_set_kv_buffer_arg", "Any", fields=_KV_ARG_FIELDS)
# The registered ops take the write as separate arguments: #9014's field order, float scales
# as 0-d tensors, all None without a write.
_KV_REGISTERED = (
    _tensor("value", optional=True),
    _tensor("k_buffer", True, True),
    _tensor("v_buffer", True, True),
    _tensor("k_scale", optional=True),
    _tensor("v_scale", optional=True),
    _tensor("cache_loc", optional=True),
)


@dataclass(frozen=True)
class OpSpec:
    """One op of the family.

    fast_args: the arguments in the order the op's hot path hands them to its C table (leaves
    0..n-1; an argument with fields is followed, after all of them, by its fields).
    registered: the arguments of its torch.library form (`sgl_ext::<name>`, for torch.compile).
    stand_in: the argument whose pointer the kernel receives for a pointer the op lacks."""

    name: str
    fast_args: tuple[OpArg, ...]
    registered: tuple[OpArg, ...]
    stand_in: str = "key"

    def leaf_names(self) -> tuple[str, ...]:
        """The C table's leaves in order: the arguments, then the expanded ones' fields."""
        fields = tuple(f.name for a in self.fast_args for f in a.fields)
        return (*(a.name for a in self.fast_args), *fields)

    def expand(self) -> tuple[tuple[int, tuple[str, ...]], ...]:
        """OpTable's `expand`: (argument index, field names) of each expanded argument."""
        return tuple(
            (i, tuple(f.name for f in a.fields)) for i, a in enumerate(self.fast_args) if a.fields
        )

    def grad(self) -> tuple[int, ...]:
        """OpTable's `grad`: the leaves the op writes (their requires_grad is keyed)."""
        written = {a.name for a in self.fast_args if a.mutable}
        written |= {f.name for a in self.fast_args for f in a.fields if f.mutable}
        return tuple(i for i, n in enumerate(self.leaf_names()) if n in written)

    def written_pointers(self) -> frozenset[int]:
        """The kernel pointers (their index in POINTER_TENSORS) of the tensors the op writes."""
        written = {a.name for a in self.fast_args if a.mutable}
        written |= {f.name for a in self.fast_args for f in a.fields if f.mutable}
        return frozenset(i for i, t in enumerate(POINTER_TENSORS) if t in written)

    def leaves(self, present: Collection[str]) -> tuple[int, ...]:
        """For each kernel pointer, the leaf whose data pointer it is: its tensor's leaf where
        the call has that tensor (`present`: the names of the tensors it passes; a float scale
        is not one), else the stand-in's."""
        names = self.leaf_names()
        stand_in = names.index(self.stand_in)
        return tuple(
            names.index(t) if t in present and t in names else stand_in for t in POINTER_TENSORS
        )

    @property
    def mutates(self) -> tuple[str, ...]:
        """The registered form's written arguments (torch.library's mutates_args)."""
        return tuple(a.name for a in self.registered if a.mutable)

    @property
    def schema(self) -> str:
        """The registered form's torch.library schema (the one torch infers from annotations:
        each written tensor its own alias set a<i>, ints symbolic)."""
        parts = []
        for i, a in enumerate(self.registered):
            t = {"int": "SymInt"}.get(a.type, a.type)
            if a.mutable:
                t = f"Tensor(a{i}!)" + ("?" if t.endswith("?") else "")
            parts.append(f"{t} {a.name}")
        return f"({', '.join(parts)}) -> ()"


_HEAD_SIZE = OpArg("head_size", "int")
_ROPE_HEAD = (
    _tensor("positions"),
    _tensor("query", True),
    _tensor("key", True),
    _HEAD_SIZE,
    _tensor("cos_sin_cache"),
)
_NORM_ARGS = (_tensor("q_norm_weight"), _tensor("k_norm_weight"), OpArg("eps", "float"))
_PDL = OpArg("enable_pdl", "Any")
_NEOX = OpArg("is_neox", "bool")

ROPE_OP = OpSpec(
    "rope_kv",
    fast_args=(*_ROPE_HEAD, _NEOX, _PDL, _KV_ARG),
    registered=(*_ROPE_HEAD, _NEOX, *_KV_REGISTERED),
)
QK_NORM_OP = OpSpec(
    "qk_norm_rope_kv",
    fast_args=(*_ROPE_HEAD, *_NORM_ARGS, _NEOX, _PDL, _KV_ARG),
    registered=(*_ROPE_HEAD, *_NORM_ARGS, _NEOX, *_KV_REGISTERED),
)
_SET_KV_ARGS = (
    _tensor("key"),
    _tensor("value"),
    _tensor("k_buffer", True),
    _tensor("v_buffer", True),
    _tensor("cache_loc"),
)
SET_KV_OP = OpSpec(
    "set_kv",
    fast_args=(*_SET_KV_ARGS, OpArg("k_scale", "Any"), OpArg("v_scale", "Any"), _HEAD_SIZE),
    registered=(
        *_SET_KV_ARGS,
        _tensor("k_scale", optional=True),
        _tensor("v_scale", optional=True),
        _HEAD_SIZE,
    ),
)
