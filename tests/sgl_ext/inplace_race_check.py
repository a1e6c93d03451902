"""Compile the rope_kv kernel's launch plans for sm_90 (no GPU needed) and check, in the TTGIR,
that no program can read an input it rotates in place after another warp overwrote it.

    python -m tests.sgl_ext.inplace_race_check [--quick]   (TRITON_INTERPRET unset: a real
    compile; --quick: two combinations of each layout, as CI runs it)

Triton may load one element in several warps: a replicated layout, or a load it rematerialises
in each layout that uses it (a tile of fewer elements than threads is "cheap to load again").
The query and the key are rotated in place, so such a second load must complete before any
warp stores: every store into the query or the key must follow a barrier with no load of that
tensor between the barrier and the store, and no load of it may follow its first store. Prints
"checked N plans" and exits 1 listing the plans that break the rule.
"""

from __future__ import annotations

import itertools
import re
import sys

import torch

from sgl_ext import FusedSetKVBufferArg, rope
from sgl_ext._common import QKNormCall
from sgl_ext.rope_kv_schema import CALL_NAMES
from sgl_ext.triton import rope_kv_plan as rp
from sgl_ext.triton.rope_kv import rope_kv_kernel

TRITON_PTR = {
    torch.bfloat16: "*bf16",
    torch.float16: "*fp16",
    torch.float32: "*fp32",
    torch.float8_e4m3fn: "*fp8e4nv",
    torch.float8_e5m2: "*fp8e5",
    torch.int32: "*i32",
    torch.int64: "*i64",
}
WRITTEN = ("q_ptr", "k_ptr")  # rotated in place


def compile_plan(plan, dtypes: dict[str, torch.dtype]):
    """Compile a KernelLauncher's kernel for sm_90 as the JIT would specialise its arguments
    (16-aligned pointers, ints equal to 1 or divisible by 16)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    values = dict(zip(CALL_NAMES[12:], plan.fixed, strict=True))
    sig: dict[str, str] = {}
    consts = dict(plan.constexprs)
    attrs = {}
    for idx, name in enumerate(rope_kv_kernel.arg_names):
        if rope_kv_kernel.params[idx].is_constexpr:
            sig[name] = "constexpr"
            continue
        if name.endswith("_ptr"):
            sig[name] = TRITON_PTR[dtypes.get(name, torch.float32)]
            attrs[(idx,)] = [["tt.divisibility", 16]]
            continue
        v = values[name]
        if isinstance(v, float):
            sig[name] = "fp32"
        elif v == 1:
            sig[name], consts[name] = "constexpr", 1
        else:
            sig[name] = "i32" if -(2**31) <= v < 2**31 else "i64"
            if v % 16 == 0:
                attrs[(idx,)] = [["tt.divisibility", 16]]
    options = {k: v for k, v in plan.options.items() if k != "launch_pdl"}
    src = ASTSource(rope_kv_kernel, sig, consts, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def inplace_races(ttgir: str) -> list[str]:
    """The rule's breaches in a kernel's TTGIR (text order follows the structured control
    flow: a branch's loads and stores stay in order). Every SSA value is traced to the kernel
    arguments it is computed from, within the scopes of its region (sibling regions reuse
    names)."""
    scopes: list[dict[str, frozenset[str]]] = [{}]

    def bases_of(name: str) -> frozenset[str]:
        for scope in reversed(scopes):
            if name in scope:
                return scope[name]
        return frozenset({name})  # a kernel argument

    problems = []
    loads_since_barrier = dict.fromkeys(WRITTEN, 0)
    stored: set[str] = set()
    for i, ln in enumerate(ttgir.splitlines()):
        body = ln.split(" loc(")[0]
        if body.strip().startswith("}"):
            scopes.pop()
            if body.strip().startswith("} else {"):
                scopes.append({})
            continue
        m = re.match(r"\s*(%[\w.]+)(?::\d+)?\s*=\s*(.*)$", body)
        operands = re.findall(r"%[\w.]+", (m.group(2) if m else body).split(" : ")[0])
        b = frozenset().union(*(bases_of(n) for n in operands)) if operands else frozenset()
        ptr = bases_of(operands[0]) if operands else frozenset()  # a load's or store's address
        w = next((w for w in WRITTEN if f"%{w}" in ptr), None)
        if re.search(r"\b(gpu|ttg)\.barrier\b", body):  # Triton 3.6 / 3.9 spellings
            loads_since_barrier = dict.fromkeys(WRITTEN, 0)
        elif re.search(r"\btt\.load\b", body) and w:
            loads_since_barrier[w] += 1
            if w in stored:
                problems.append(f"line {i}: a load of {w} after a store into it")
        elif re.search(r"\btt\.store\b", body) and w:
            if loads_since_barrier[w]:
                problems.append(f"line {i}: a store into {w} with no barrier after its loads")
            stored.add(w)
        if m:
            scopes[-1][m.group(1)] = b
        if body.rstrip().endswith("{"):
            scopes.append({})
    return problems


def plans(quick: bool = False):
    """(name, plan, pointer dtypes) for every layout of the launch tables and launch_config's
    own (rope_kv_sweep.table_rows), on 16-bit and fp8 caches, neox and GPT-J, full and partial
    rotary, 32 / 8 and 4 / 4 heads. quick: two combinations a layout, one of them the shape
    whose fp8 cache the race corrupted (GPT-J pairs, half rotary, e5m2, 4 / 4 heads)."""
    from sgl_ext import settings
    from tests.sgl_ext.rope_kv_sweep import table_rows

    fp8 = (torch.float8_e4m3fn, torch.float8_e5m2)
    for _, cfg, _, _, dims, norm in table_rows():
        d = dims[0]
        combos = itertools.product(
            (torch.bfloat16, *fp8), (True, False), (d, d // 2), ((32, 8), (4, 4))
        )
        if quick:
            combos = [
                (torch.float8_e5m2, False, d // 2, (4, 4)),
                (torch.bfloat16, True, d, (32, 8)),
            ]
        for kv_dtype, neox, rot, heads in combos:
            with settings.override(triton_config=cfg):
                plan = _plan(d, rot, neox, kv_dtype, norm, heads)
            style = "neox" if neox else "gptj"
            name = f"{cfg} D={d} rot={rot} {style} {kv_dtype} heads={heads} norm={norm}"
            dtypes = {n: torch.bfloat16 for n in ("q_ptr", "k_ptr", "v_ptr", "qw_ptr", "kw_ptr")}
            dtypes.update(kbuf_ptr=kv_dtype, vbuf_ptr=kv_dtype, pos_ptr=torch.int64)
            dtypes.update(loc_ptr=torch.int32)
            yield name, plan, dtypes


def _plan(d: int, rot: int, neox: bool, kv_dtype: torch.dtype, norm: bool, heads=(32, 8)):
    (hq, hkv), t = heads, 16
    qkv = torch.empty(t, (hq + 2 * hkv) * d, dtype=torch.bfloat16)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)  # strided views of one qkv row
    kb = torch.empty(64, 16, hkv, d, dtype=kv_dtype)  # [pages, page, H, D]
    scale = 0.5 if kv_dtype != torch.bfloat16 else None
    loc = torch.zeros(t, dtype=torch.int32)
    arg = FusedSetKVBufferArg(v, kb, torch.empty_like(kb), scale, scale, loc)
    cs = torch.empty(4096, rot)
    call = rope.check(torch.zeros(t, dtype=torch.int64), q, k, d, cs, neox, arg)
    qn = QKNormCall(1e-6, 0, 0) if norm else None
    return rp.plan_rope_kv(call, 0, 0, 0, True, qn)


def main(argv: list[str] | None = None) -> int:
    quick = "--quick" in (sys.argv[1:] if argv is None else argv)
    bad, n = [], 0
    for name, plan, dtypes in plans(quick):
        n += 1
        problems = inplace_races(compile_plan(plan, dtypes).asm["ttgir"])
        if problems:
            bad.append(f"{name}: {problems[:3]}")
    for b in bad:
        print("RACE", b)
    print(f"checked {n} plans, {len(bad)} with a race")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
