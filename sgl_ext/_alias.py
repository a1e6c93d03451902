"""Aliasing between an op's tensor arguments, decided on metadata alone (no device sync).

The RoPE + KV ops write some arguments in place (query, key, the KV buffers) and read the
others. A written tensor that shares a byte with another argument makes the result depend on
the order the backends happen to read and write in (native rotates K and then stores V = the
rotated K when `value` is `key`, Triton stores the unrotated one; `k_buffer` being `v_buffer`
loses K), so such a call is a ValueError naming both arguments, raised before any write.

Two views of one buffer in disjoint places stay legal: q, k and v are usually column views of
one qkv row, and the cross-layer KV layout [pages, layers, 2, page, H, D] passes K and V as two
strided views of one allocation. `views_disjoint` proves that from the data pointers, shapes,
strides and element sizes: both views must step over one common stride S in their outer dims
and keep their inner dims within S bytes, so each touches only a fixed band of addresses
modulo S; disjoint bands mean disjoint views. Anything it cannot prove counts as overlapping.

The ops cache their checks per call metadata, and the plan key holds `data_ptr() % 16`, not
the pointer, so aliasing can change under an unchanged key. `alias_guard` therefore returns an
`AliasGuard`: the arguments in groups whose byte ranges meet (usually one per allocation),
each member's offset from its group's lowest tensor, and the pairs of a group with a written
member and another group. For the same metadata, the same offsets within groups and no
written group meeting another imply the same decision, which `AliasGuard.holds(ptrs)` checks
per call (a few integer comparisons a pair, whatever the groups' address order, which changes
from layer to layer); when it fails, the op checks the call again on the new pointers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sgl_ext.rope_kv_schema import POINTER_TENSORS

# The kernels' pointer order (`rope.call_key`, `KernelLauncher.run_ptrs`): names of the
# arguments whose data pointer is at each index of the per-call pointer tuple.
ROPE_KV_NAMES = POINTER_TENSORS


@dataclass(frozen=True)
class _View:
    """One argument's memory: name, index into the per-call pointers, written in place, byte
    range [ptr, end), dims (size, byte stride) of size > 1, element bytes. (torch strides are
    never negative, so the data pointer is the lowest byte.)"""

    name: str
    index: int
    written: bool
    ptr: int
    end: int
    dims: tuple[tuple[int, int], ...]
    elem: int


def _view(name: str, index: int, written: bool, t: torch.Tensor) -> _View | None:
    """The view of t, or None when it occupies no memory (no elements; a fake or meta tensor,
    whose data pointer is 0)."""
    if t.numel() == 0:
        return None
    es = t.element_size()
    ptr = t.data_ptr()
    if ptr == 0:
        return None
    dims = tuple((n, st * es) for n, st in zip(t.shape, t.stride(), strict=True) if n > 1)
    return _View(name, index, written, ptr, ptr + es + sum((n - 1) * s for n, s in dims), dims, es)


def _band(v: _View, s: int) -> tuple[int, int] | None:
    """(start mod s, length) of the addresses v touches modulo s, when every dim of v either
    steps by a multiple of s or stays within one s-byte band with the others; else None."""
    inner = v.elem
    for n, st in v.dims:
        if st % s:
            inner += (n - 1) * st
    if inner > s:
        return None
    return v.ptr % s, inner


def views_disjoint(a: _View, b: _View) -> bool:
    """Whether a and b share no byte (True only when it can be proven from the metadata)."""
    if a.end <= b.ptr or b.end <= a.ptr:
        return True
    strides = sorted({st for _, st in a.dims + b.dims if st}, reverse=True)
    for s in strides:
        ba, bb = _band(a, s), _band(b, s)
        if ba is None or bb is None:
            continue
        d = (bb[0] - ba[0]) % s  # b's band starts d bytes after a's, around a circle of s
        if d >= ba[1] and d + bb[1] <= s:
            return True
    return False


@dataclass(frozen=True)
class AliasGuard:
    """What keeps an aliasing decision valid for later calls with the same metadata.

    The arguments fall into groups whose byte ranges meet (usually one per allocation).
    members: (index, index of its group's lowest tensor, offset from that tensor's pointer) of
    every tensor that is not its group's lowest; pairs: (lowest tensor of a group with a
    written member, that group's byte length, lowest tensor of another group, its length),
    each pair once. Indexes are into the op's per-call pointer tuple.
    """

    members: tuple[tuple[int, int, int], ...]
    pairs: tuple[tuple[int, int, int, int], ...]

    def holds(self, ptrs: Sequence[int]) -> bool:
        """Whether pointers `ptrs` (a call's per-call pointers) keep every member at its
        offset in its group and every written group apart from the other groups."""
        for i, first, off in self.members:
            if ptrs[i] - ptrs[first] != off:
                return False
        for wi, wn, gi, gn in self.pairs:
            a, b = ptrs[wi], ptrs[gi]
            if b < a + wn and a < b + gn:
                return False
        return True


def alias_guard(tensors: Sequence[tuple[str, int, bool, object]]) -> AliasGuard:
    """Check that no written tensor overlaps another argument; the guard of the decision.

    Parameters
    ----------
    tensors : (name, index into the per-call pointers, written in place, tensor or anything
        else) per argument; non-tensors (None, a float scale) and empty tensors are skipped.
        All tensors are on one device (the ops check that first).

    Raises
    ------
    ValueError
        Naming both arguments, when a written one may share memory with another.
    """
    views: list[_View] = []
    if torch.compiler.is_compiling():  # traced tensors have no addresses: the op checks at run
        return AliasGuard((), ())
    for name, index, written, t in tensors:
        if isinstance(t, torch.Tensor):
            v = _view(name, index, written, t)
            if v is not None:
                views.append(v)
    views.sort(key=lambda v: (v.ptr, v.index))
    groups: list[list[_View]] = []
    end = 0
    for v in views:  # sweep: a view that starts before the group's end joins it
        if groups and v.ptr < end:
            groups[-1].append(v)
            end = max(end, v.end)
        else:
            groups.append([v])
            end = v.end
    for g in groups:
        for i, a in enumerate(g):
            for b in g[i + 1 :]:
                if (a.written or b.written) and not views_disjoint(a, b):
                    w, o = (a, b) if a.written else (b, a)
                    raise ValueError(
                        f"{w.name} and {o.name} overlap in memory, and the op writes {w.name}"
                        " in place: pass tensors that share no element (views of one buffer"
                        " in disjoint places are fine)"
                    )
    members = tuple((v.index, g[0].index, v.ptr - g[0].ptr) for g in groups for v in g[1:])
    spans = [
        (g[0].index, max(v.end for v in g) - g[0].ptr, any(v.written for v in g)) for g in groups
    ]
    pairs = tuple(
        (wi, wn, gi, gn)
        for k, (wi, wn, written) in enumerate(spans)
        if written
        for m, (gi, gn, other_written) in enumerate(spans)
        if m != k and not (other_written and m < k)
    )
    return AliasGuard(members, pairs)


def rope_kv_guard(
    tensors: Sequence[object], written: frozenset[int], extra: Sequence[object] = ()
) -> AliasGuard:
    """`alias_guard` of a call of the rope_kv kernel's ops: tensors[i] is the argument named
    ROPE_KV_NAMES[i] (None where absent), `written` the indexes written in place; `extra`:
    more (name, index, written, tensor) entries (indexes past the kernel's pointers)."""
    entries = [
        (ROPE_KV_NAMES[i], i, i in written, t)
        for i, t in enumerate(tensors)
        if isinstance(t, torch.Tensor)
    ]
    return alias_guard([*entries, *extra])  # type: ignore[list-item]
