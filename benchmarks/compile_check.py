"""Compile the Triton kernels for sm_90 without a GPU (catches front-end errors the interpreter
does not, e.g. if/else type mismatches). python benchmarks/compile_check.py"""

from __future__ import annotations

import itertools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from sgl_ext.triton.rope_kv import rope_kv_kernel  # noqa: E402

PTR = {"bf16": "*bf16", "fp16": "*fp16", "fp32": "*fp32", "e4m3": "*fp8e4nv", "e5m2": "*fp8e5"}


def compile_one(
    dtype,
    kv,
    rotate,
    write_kv,
    pair_mode,
    kbuf_mode,
    ks,
    tail,
    pdl,
    bh=4,
    merged=False,
    order=None,
    qk_norm=False,
    num_warps=4,
    ss_fp64=False,
    pos_last=False,
    hoist=False,
    early_release=False,
    norm_w_pre=False,
    slot_pre=False,
):
    names = list(rope_kv_kernel.arg_names)
    sig, consts, attrs = {}, {}, {}
    for idx, n in enumerate(names):
        p = rope_kv_kernel.params[idx]
        if p.is_constexpr:
            continue
        if n.endswith("_ptr") or "stride" in n:  # as the JIT specialises 16-aligned arguments
            attrs[(idx,)] = [["tt.divisibility", 16]]
        if n in ("q_ptr", "k_ptr", "v_ptr", "qw_ptr", "kw_ptr"):
            sig[n] = PTR[dtype]
        elif n in ("kbuf_ptr", "vbuf_ptr"):
            sig[n] = PTR[kv]
        elif n in ("pos_ptr", "loc_ptr"):
            sig[n] = "*i64"
        elif n in ("cos_sin_ptr", "k_scale_ptr", "v_scale_ptr"):
            sig[n] = "*fp32"
        elif n in ("k_scale_f", "v_scale_f", "eps"):
            sig[n] = "fp32"
        else:
            sig[n] = "i64" if "stride" in n else "i32"
    fp8 = {"e4m3": 448.0, "e5m2": 57344.0}.get(kv, 0.0)
    consts.update(
        PAGE_SIZE=16,
        HEAD_DIM=128,
        V_HEAD_DIM=128,
        ROT_DIM=128 - 64 * tail,
        BLOCK_HALF=64 - 32 * tail,
        BLOCK_TAIL=64 * tail,
        BLOCK_DV=128,
        BLOCK_H=bh,
        BLOCK_HKV=min(bh, 8),
        PAIR_MODE=pair_mode,
        KBUF_PAIR_MODE=kbuf_mode,
        IS_BF16=dtype == "bf16",
        ROTATE=rotate,
        WRITE_KV=write_kv,
        K_SCALE_MODE=ks,
        V_SCALE_MODE=ks,
        K_FP8_MAX=fp8,
        V_FP8_MAX=fp8,
        EMULATE_FP8=False,
        USE_PDL=pdl,
        NUM_Q_BLOCKS=32 // bh,
        NUM_KV_BLOCKS=max(1, 8 // bh),
        MERGED=merged,
        GRID_ORDER=int(merged) if order is None else order,
        QK_NORM=qk_norm,
        SS_FP64=ss_fp64,
        POS_LAST=pos_last,
        HOIST=hoist,
        EARLY_RELEASE=early_release,
        NORM_W_PRE=norm_w_pre,
        SLOT_PRE=slot_pre,
    )
    for k in consts:
        sig[k] = "constexpr"
    src = ASTSource(rope_kv_kernel, sig, consts, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})


def sass_loads_before_division() -> tuple[int, int]:
    """(LDGs issued after the first MUFU.RCP on the key/value path, LDGs before it) in the SASS
    of the fp8 tensor-scale variant with merged programs (4 heads). Every
    load must be issued before the scale reciprocal, whose slow-path CALL would otherwise hold
    back the loads after it: one more memory round trip at small T. The key/value path runs from
    its first instruction to the first unpredicated BRA or EXIT after the reciprocal."""
    import re

    kernel = compile_one("bf16", "e4m3", True, True, 0, 0, 2, 0, True, bh=4, merged=True)
    ops = _sass(kernel)
    first_rcp = min(i for i, ln in enumerate(ops) if "MUFU.RCP" in ln)
    end = next(i for i in range(first_rcp, len(ops)) if re.search(r"\*/\s+(BRA|EXIT)\b", ops[i]))
    after = sum(" LDG" in ln for ln in ops[first_rcp:end])
    before = sum(" LDG" in ln for ln in ops[:first_rcp])
    return after, before


def _sass(kernel) -> list[str]:
    """The kernel's SASS instruction lines (cuobjdump from Triton's NVIDIA backend)."""
    import re
    import subprocess
    from pathlib import Path

    import triton.backends.nvidia as nv

    cuobjdump = Path(nv.__file__).parent / "bin" / "cuobjdump"
    cubin = Path("/tmp") / f"sgl_ext_check_{os.getpid()}.cubin"
    cubin.write_bytes(kernel.asm["cubin"])
    try:
        sass = subprocess.run(
            [str(cuobjdump), "-sass", str(cubin)], capture_output=True, text=True, check=True
        ).stdout
    finally:
        cubin.unlink()
    return [ln for ln in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4}\*/", ln)]


def _loads_after_barriers(ops: list[str], barrier: str) -> tuple[list[int], list[int]]:
    """The SASS lines holding `barrier`, and the loads after each up to its path's end (the
    next branch or exit)."""
    import re

    bars = [i for i, ln in enumerate(ops) if barrier in ln]
    after = []
    for b in bars:
        end = next(
            (i for i in range(b, len(ops)) if re.search(r"\*/\s+(BRA|EXIT)\b", ops[i])),
            len(ops),
        )
        after.append(sum(" LDG" in ln for ln in ops[b:end]))
    return bars, after


def pos_last_misplaced() -> list[str]:
    """POS_LAST in the SASS. Separate programs (POS_LAST 1: the position loaded in each program
    kind's own path, after its data loads in program order) must not order the loads with a
    barrier: a BAR.SYNC waits for the loads in flight, one more memory round trip (+0.12-0.15 µs
    a call at T = 1 on the H100, RoPE + KV alone with and without it); their layouts reduce each
    head inside a warp, so no barrier at all. Merged programs (POS_LAST 2) keep the barrier: each
    must be followed by exactly three loads on its path (the position, then cos and sin) and the
    data loads must come before the first one. The in-place fence (pairs.inplace_fence: a barrier
    after the last load, before the query / key is overwritten) orders no load and is not
    counted. Returns the layouts where that fails (empty: all hold)."""

    bad = []
    for bh, merged, warps, mode in ((1, False, 1, 1), (4, False, 4, 1), (4, True, 4, 2)):
        for kv, ks in (("bf16", 0), ("e4m3", 2)):
            args = ("bf16", kv, True, True, 0, 0, ks, 0, True, bh, merged)
            ops = _sass(compile_one(*args, qk_norm=True, num_warps=warps, pos_last=mode))
            bars, after = _loads_after_barriers(ops, "BAR.SYNC")
            bars = [b for b, n in zip(bars, after, strict=True) if n]  # not the in-place fence
            after = [n for n in after if n]
            name = f"{bh} heads x {warps} warps{' merged' if merged else ''}, {kv}"
            if mode == 1:
                if bars:
                    bad.append(f"{name}: {len(bars)} barriers")
                continue
            before = sum(" LDG" in ln for ln in ops[: bars[0]]) if bars else 0
            if not bars or before < 4 or any(n != 3 for n in after):
                bad.append(f"{name}: {before} loads first, {after}")
    return bad


def load_barrier_misplaced() -> list[str]:
    """POS_LAST 3 (LoadOrder.LOAD_BARRIER) in the SASS: each program path has one barrier
    (BAR.RED.POPC, whose result the position's clamp takes), every load of the path but the cos
    and sin rows before it and exactly those two after it. Returns the layouts where that fails
    (empty: all hold)."""

    bad = []
    for qk, bh, warps, merged in ((True, 4, 4, False), (True, 8, 4, False), (False, 8, 4, True)):
        for kv, ks in (("bf16", 0), ("e4m3", 2)):
            args = ("bf16", kv, True, True, 0, 0, ks, 0, True, bh, merged)
            ops = _sass(compile_one(*args, qk_norm=qk, num_warps=warps, pos_last=3))
            bars, after = _loads_after_barriers(ops, "BAR.RED.POPC")
            name = f"{bh} heads x {warps} warps{' merged' if merged else ''}, {kv}, norm {qk}"
            if len(bars) != 2 or any(n != 2 for n in after):
                bad.append(f"{name}: {len(bars)} barriers, loads after each {after}")
    return bad


def norm_reduce_layouts_differ() -> list[str]:
    """The QK_NORM variant's float32 sums of squares add in the order of their operand's layout.
    For each layout (1 head x 1 warp, 4 heads x 4 warps, merged 4 x 4, these three with
    POS_LAST, then merged 8 x 4 and 16 x 4, the latter with HOIST too, and the default
    rope_kv_plan.qk_norm_launch_config layouts of 4 and 8 heads x 4 warps with LOAD_BARRIER),
    compile
    without the KV write and with bf16 / fp8 caches and compare the layouts of every tt.reduce
    operand in the TTGIR: the fused and unfused Qwen3 paths get the same q/k bits only if they
    match. Returns the layouts that differ (empty: all match)."""
    import re

    bad = []
    for bh, merged, warps, pos_last, hoist in (
        (1, False, 1, True, False),
        (4, False, 4, True, False),
        (4, True, 4, True, False),
        (8, True, 4, False, False),
        (16, True, 4, False, False),
        (16, True, 4, False, True),
        (4, False, 4, 3, False),  # LOAD_BARRIER (POS_LAST 3)
        (8, False, 4, 3, False),
    ):
        seen = {}
        for write_kv, kv, ks in ((False, "bf16", 0), (True, "bf16", 0), (True, "e4m3", 2)):
            args = ("bf16", kv, True, write_kv, 0, 0, ks, 0, True, bh, merged)
            kw = dict(qk_norm=True, num_warps=warps, pos_last=pos_last, hoist=hoist)
            ir = compile_one(*args, **kw).asm["ttgir"]
            alias = dict(re.findall(r"^(#\w+) = (#ttg\.\w+<\{.*?\}>)", ir, re.M))
            ops = re.findall(r"\}\) : \(tensor<([^>]*)>\) -> tensor", ir)  # tt.reduce operands
            # (shape, the layout the #alias names): aliases number differently per kernel
            seen[(write_kv, kv)] = [(o.split(",")[0], alias.get(o.split(", ")[-1])) for o in ops]
        found = all(len(v) == 2 and all(lay for _, lay in v) for v in seen.values())  # q, k
        if len({str(v) for v in seen.values()}) != 1 or not found:
            bad.append(f"{bh} heads x {warps} warps: {seen}")
    return bad


def pdl_wait_first() -> bool:
    """The rope_kv kernel waits for the previous kernel (ACQBULK) before it lets the next one
    launch (PREEXIT), unlike the other kernels (pdl.pdl_enter's WAIT_FIRST; docs/performance.md),
    and the other way round with EARLY_RELEASE."""
    order = []
    for early in (False, True):
        args = ("bf16", "bf16", True, True, 0, 0, 0, 0, True, 4, True)
        ops = _sass(compile_one(*args, qk_norm=True, early_release=early))
        wait = next((i for i, ln in enumerate(ops) if "ACQBULK" in ln), -1)
        release = next((i for i, ln in enumerate(ops) if "PREEXIT" in ln), -1)
        order.append(min(wait, release) >= 0 and wait < release)
    return order == [True, False]


def pre_wait_misplaced() -> list[str]:
    """POS_LAST 4 (PRE_WAIT): the position and both halves of the cos/sin row are loaded before
    the kernel waits for the previous one (ACQBULK), with the q/k norm and NORM_W_PRE its weight
    rows too (both halves of the query's and the key's), with SLOT_PRE the slot, every other
    load after it. Checked for separate programs (Llama-3 decode at 1 and at 9..64 tokens,
    q/k-norm decode with and without SLOT_PRE) and merged programs with HOIST."""
    bad = []
    for qk, slot, bh, merged, hoist in (
        (False, False, 1, False, False),
        (True, True, 4, False, False),
        (True, False, 4, False, False),
        (False, False, 4, False, False),
        (False, True, 8, True, True),
    ):
        args = ("bf16", "bf16", True, True, 0, 0, 0, 0, True, bh, merged)
        kernel = compile_one(
            *args, qk_norm=qk, pos_last=4, hoist=hoist, norm_w_pre=qk, slot_pre=slot
        )
        ops = _sass(kernel)
        wait = next((i for i, ln in enumerate(ops) if "ACQBULK" in ln), -1)
        before = sum("LDG" in ln for ln in ops[:wait]) if wait >= 0 else 0
        # position, cos, sin (+ 4 weight halves) (+ the slot)
        if wait < 0 or before != 3 + 4 * qk + slot:
            name = f"{bh} heads{' merged' if merged else ''}, norm {qk}, slot {slot}"
            bad.append(f"{name}: {before} loads")
    return bad


def main() -> int:
    n = 0
    cases = [
        ("bf16", "bf16", True, True, 0, 0, 0, 0, True),
        ("bf16", "e4m3", True, True, 0, 0, 2, 1, True),
        ("fp16", "e5m2", True, True, 2, 1, 1, 0, False),
        ("bf16", "bf16", True, True, 2, 2, 0, 1, True),
        ("fp32", "fp32", True, True, 1, 1, 0, 0, True),
        ("bf16", "bf16", True, False, 0, 0, 0, 0, True),
        ("bf16", "bf16", True, False, 2, 2, 0, 0, True),
        ("bf16", "bf16", False, True, 0, 0, 0, 0, True),
        ("fp16", "e4m3", False, True, 0, 0, 2, 1, False),
    ]
    for case in cases:
        compile_one(*case)
        n += 1
    for bh, merged in ((1, False), (32, False), (8, True), (32, True)):
        compile_one("bf16", "bf16", True, True, 0, 0, 0, 0, True, bh, merged)
    compile_one("bf16", "e4m3", True, True, 2, 1, 2, 1, True, 8, True)
    compile_one("bf16", "bf16", True, True, 0, 0, 0, 0, True, 8, True, order=2)  # k/v first
    # merged programs with every load before the key/value branch (HOIST)
    compile_one("bf16", "e4m3", True, True, 2, 1, 2, 1, True, 8, True, hoist=True)
    compile_one("bf16", "bf16", True, True, 0, 0, 0, 0, True, 8, True, qk_norm=True, hoist=True)
    # q/k RMSNorm (QK_NORM): separate and merged programs, GPT-J words, partial rotary, fp8,
    # RoPE only
    for case, bh, merged in (
        (("bf16", "bf16", True, True, 0, 0, 0, 0, True), 1, False),
        (("bf16", "bf16", True, True, 0, 0, 0, 0, True), 8, True),
        (("bf16", "e4m3", True, True, 2, 1, 2, 1, True), 4, False),
        (("fp16", "fp16", True, True, 1, 1, 0, 1, False), 8, True),
        (("fp32", "e5m2", True, True, 0, 0, 1, 0, True), 32, True),
        (("bf16", "bf16", True, False, 0, 0, 0, 1, True), 2, False),
    ):
        compile_one(*case, bh, merged, qk_norm=True)
    for case, bh, merged in (  # the float64 sum of squares (rope_kv_plan.QK_NORM_SUM_FP64)
        (("bf16", "bf16", True, True, 0, 0, 0, 0, True), 1, False),
        (("fp16", "e4m3", True, True, 1, 1, 2, 1, False), 8, True),
    ):
        compile_one(*case, bh, merged, qk_norm=True, ss_fp64=True)
    print(f"compiled {n + 16} kernel variants for sm_90")
    after, before = sass_loads_before_division()
    print(f"fp8 tensor-scale SASS: {before} loads before the first reciprocal, {after} after it")
    bad = norm_reduce_layouts_differ()
    print(f"q/k-norm reductions: same layout with and without the KV write: {not bad} {bad}")
    misplaced = pos_last_misplaced()
    print(f"POS_LAST: separate programs barrier-free, merged loads first: {not misplaced}")
    for line in misplaced:
        print(f"  {line}")
    lb_bad = load_barrier_misplaced()
    print(f"LOAD_BARRIER: every load but cos/sin before the barrier: {not lb_bad}")
    for line in lb_bad:
        print(f"  {line}")
    wait_first = pdl_wait_first()
    print(f"PDL: rope_kv waits before it releases the next launch: {wait_first}")
    pw_bad = pre_wait_misplaced()
    print(f"PRE_WAIT: position, cos/sin (norm weights, slot) before the wait: {not pw_bad}")
    for line in pw_bad:
        print(f"  {line}")
    ok = after == 0 and before > 0 and not bad and not misplaced and not lb_bad and wait_first
    ok = ok and not pw_bad
    return 0 if ok else 1


if __name__ == "__main__":
    del itertools
    sys.exit(main())
