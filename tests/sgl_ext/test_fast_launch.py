"""The C fast path (`sgl_ext/fast_launch.py`, `csrc/fast_launch.c`).

CPU: the extension builds; its key holds everything the ops' Python plan keys hold (equal C
keys imply equal plan keys, over a grid of changed inputs); keys of objects it does not know are
refused; register / probe / clear; the launch parameters of a compiled kernel. GPU: the second
call of each op launches from C, with the same bits as the Python path, inside CUDA graphs too;
a launch hook sends calls back to Python.
"""

from __future__ import annotations

import itertools
import shutil
import types

import pytest
import torch

import sgl_ext
from sgl_ext import fast_launch, kv_cache, qk_norm_rope, rope, settings
from sgl_ext.rope import FusedSetKVBufferArg
from sgl_ext.rope_kv_schema import ROPE_OP
from tests.sgl_ext.sgl_ext_testutil import bits
from tests.sgl_ext.test_validation import make_args

HAS_CUDA = torch.cuda.is_available()
needs_cc = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler"
)
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
D = 16


@pytest.fixture(scope="module")
def mod():
    m = fast_launch._load()
    if not m:
        pytest.skip("fast launch module unavailable")
    return m


def _rope_table(mod):
    return mod.Table(expand=ROPE_OP.expand(), grad=ROPE_OP.grad())


def _rope_args(a, arg=True, enable_pdl=None):
    fa = None
    if arg:
        fa = FusedSetKVBufferArg(
            a["value"], a["k_buffer"], a["v_buffer"], a["k_scale"], a["v_scale"], a["cache_loc"]
        )
    return (
        a["positions"],
        a["query"],
        a["key"],
        a["head_size"],
        a["cos_sin_cache"],
        a["is_neox"],
        enable_pdl,
        fa,
    )


def _py_key(args):
    pos, query, key, head_size, cos_sin, is_neox, enable_pdl, fa = args
    return rope.call_key(pos, query, key, head_size, cos_sin, is_neox, fa, enable_pdl)[0]


# Valid and invalid changes of one argument: each makes a call the plan cache must tell apart.
VARIANTS = [
    ("query", lambda a: a["query"].clone()),  # same metadata, other storage: same key
    ("query", lambda a: a["query"].half()),
    ("query", lambda a: a["query"].view(5, 4, D)),
    ("query", lambda a: torch.empty(5 * 4 * D + 1, dtype=torch.bfloat16)[1:].view(5, 4 * D)),
    ("query", lambda a: a["query"].detach().requires_grad_()),
    ("key", lambda a: a["key"][:, :D]),
    ("key", lambda a: torch.empty(2 * D, 5, dtype=torch.bfloat16).t()),
    ("positions", lambda a: a["positions"].int()),
    ("positions", lambda a: a["positions"][:3]),
    ("head_size", lambda a: 8),
    ("head_size", lambda a: float(D)),
    ("is_neox", lambda a: False),
    ("is_neox", lambda a: 1),
    ("cos_sin_cache", lambda a: a["cos_sin_cache"][:, :8]),
    ("k_buffer", lambda a: a["k_buffer"].to(torch.float8_e4m3fn)),
    ("k_buffer", lambda a: a["k_buffer"].detach().requires_grad_()),
    ("v_buffer", lambda a: a["v_buffer"].transpose(1, 2)),
    ("cache_loc", lambda a: a["cache_loc"].int()),
    ("k_scale", lambda a: 0.5),
    ("k_scale", lambda a: 0.25),
    ("k_scale", lambda a: 1),
    ("v_scale", lambda a: torch.tensor([0.5])),
    ("v_scale", lambda a: torch.tensor(0.5)),
    ("value", lambda a: a["value"].float()),
]


@needs_cc
def test_c_key_holds_the_plan_key(mod):
    """Over pairs of calls, equal C keys imply equal Python plan keys (so a C hit launches
    the plan the Python path made for that metadata); the C key also tells apart what the
    Python key does (no two different plan keys share a C key)."""
    t = _rope_table(mod)
    base = make_args()
    calls = [_rope_args(base), _rope_args(base, arg=False), _rope_args(base, enable_pdl=True)]
    for name, make in VARIANTS:
        a = dict(base)
        a[name] = make(base)
        calls.append(_rope_args(a))
    keys = [(t.key(*c), _py_key(c)) for c in calls]
    assert all(ck is not None for ck, _ in keys)
    assert keys[0][0] == keys[3][0]  # a clone: same metadata, same key
    for (ci, pi), (cj, pj) in itertools.combinations(keys, 2):
        if ci == cj:
            assert pi == pj
        if pi != pj:
            assert ci != cj


@needs_cc
def test_keys_refused_for_unknown_objects(mod):
    t = _rope_table(mod)
    a = make_args()

    class Sub(torch.Tensor):
        pass

    good = _rope_args(a)
    assert t.key(*good) is not None
    odd = [
        (a["positions"].as_subclass(Sub), *good[1:]),
        (*good[:3], types.SimpleNamespace(), *good[4:]),
        (*good[:3], 2**70, *good[4:]),  # an int past int64
        (*good[:7], object()),  # an argument without the fields
    ]
    for args in odd:
        assert t.key(*args) is None
        assert t.launch(*args) == -1


@needs_cc
def test_register_probe_clear(mod):
    t = _rope_table(mod)
    a = make_args()
    args = _rope_args(a)
    assert t.launch(*args) == 0 and not t.probe(*args)
    params = ((0, 8, 0), (1, 8, 0), (-1, 4, 7), (-1, 8, 2**40))
    spec = (None, 0, (1, 1, 1), 128, 0, False, 0, params)
    assert t.register(spec, *args)
    assert t.probe(*args) and len(t) == 1
    assert t.launch(*args) == -1  # a plan without a kernel (function 0) never launches
    other = _rope_args(a, arg=False)
    assert not t.probe(other)
    # a pointer parameter must come from a tensor leaf (3 is head_size)
    assert not t.register((None, 0, (1, 1, 1), 128, 0, False, 0, ((3, 8, 0),)), *other)
    assert not t.register((None, 0, (1, 1, 1), 128, 0, False, 0, ((-1, 3, 0),)), *other)
    t.clear()
    assert len(t) == 0 and not t.probe(*args)


@needs_cc
def test_c_plans_launch_only_with_the_aliasing_they_were_registered_with(mod):
    """The key holds data_ptr() % 16: k_buffer being v_buffer, or value being key, keys as the
    call that registered the plan. A table's written leaves make such a call miss (0: the
    Python path checks it); other storage with the same overlaps and offsets still hits."""
    t = mod.Table(expand=ROPE_OP.expand(), grad=ROPE_OP.grad(), written=ROPE_OP.grad())
    loose = _rope_table(mod)  # no written leaves: aliasing is not part of its plans
    spec = (None, 0, (1, 1, 1), 128, 0, False, 0, ((0, 8, 0),))
    a = make_args()
    for table in (t, loose):
        assert table.register(spec, *_rope_args(a))
    assert t.probe(*_rope_args(make_args()))  # fresh tensors, same metadata
    for bad in (dict(a, v_buffer=a["k_buffer"]), dict(a, value=a["key"])):
        assert t.key(*_rope_args(bad)) == t.key(*_rope_args(a))
        assert not t.probe(*_rope_args(bad)) and t.launch(*_rope_args(bad)) == 0
        assert loose.probe(*_rope_args(bad))

    # q, k, v as column views of one qkv buffer: the same offsets in another buffer hit
    def views(qkv, shift=0):
        q, k, v = qkv[:, :64], qkv[:, 64 + shift : 96 + shift], qkv[:, 96:]
        return dict(a, query=q, key=k, value=v)

    qkv = torch.randn(5, 128).bfloat16()
    assert t.register(spec, *_rope_args(views(qkv)))
    assert t.probe(*_rope_args(views(qkv.clone())))
    assert not t.probe(*_rope_args(views(qkv, shift=-8)))  # key now overlaps query


@needs_cc
def test_table_fills_and_empties(mod):
    t = mod.Table()
    x = torch.randn(3)
    for i in range(600):  # past half the slots: emptied, then filled again
        assert t.register((None, 0, (1, 1, 1), 32, 0, False, 0, ((0, 8, 0),)), x, i)
    assert 0 < len(t) <= 512
    assert t.probe(x, 599) and not t.probe(x, 0)


def test_launch_spec_packs_scalars():
    """The parameter list of a compiled kernel: per-call pointers from their leaves, the
    plan's scalars packed by type, constexprs (and ints specialised to 1) left out."""
    sig = {"a": "*bf16", "b": "*i32", "n": "i32", "big": "i64", "one": "constexpr", "f": "fp32"}
    sig |= {"BLOCK": "constexpr"}
    compiled = types.SimpleNamespace(
        function=1234,
        metadata=types.SimpleNamespace(
            shared=512, num_warps=4, num_ctas=1, launch_pdl=True, launch_cooperative_grid=False
        ),
        src=types.SimpleNamespace(signature=sig),
    )
    lau = types.SimpleNamespace(
        compiled=compiled, tail=(-3, 2**40, 1, 0.5, 64), grid3=(7, 1, 1), device_index=0
    )
    spec = fast_launch.launch_spec(lau, (5, 2))
    assert spec is not None
    owner, fn, grid, threads, shared, pdl, dev, params = spec
    assert (owner, fn, grid, threads, shared) == (compiled, 1234, (7, 1, 1), 128, 512)
    assert pdl is True and dev == 0
    assert params == ((5, 8, 0), (2, 8, 0), (-1, 4, 2**32 - 3), (-1, 8, 2**40), (-1, 4, 0x3F000000))
    assert fast_launch.launch_spec(lau, (5,)) is None  # pointer count mismatch
    compiled.metadata.global_scratch_size = 16
    assert fast_launch.launch_spec(lau, (5, 2)) is None  # scratch memory: Triton's launcher


def test_launch_spec_follows_the_launcher_order():
    """A launcher whose kernel declares its runtime parameters in another order (a pointer
    beside its stride): each parameter taken from the pointers or the fixed values by `order`,
    an int specialised to 1 left out, the constexprs after them."""
    sig = {"a": "*bf16", "n": "i32", "b": "*i32", "one": "constexpr", "f": "fp32"}
    sig |= {"BLOCK": "constexpr"}
    compiled = types.SimpleNamespace(
        function=99,
        metadata=types.SimpleNamespace(shared=0, num_warps=1, num_ctas=1),
        src=types.SimpleNamespace(signature=sig),
    )
    # call order: a, b, then fixed (n, one, f); kernel order a, n, b, one, f
    lau = types.SimpleNamespace(
        compiled=compiled,
        fixed=(-3, 1, 0.5),
        order=(0, 2, 1, 3, 4),
        tail=(64,),
        grid3=(2, 1, 1),
        device_index=0,
    )
    spec = fast_launch.launch_spec(lau, (5, 2))
    assert spec is not None
    assert spec[-1] == ((5, 8, 0), (-1, 4, 2**32 - 3), (2, 8, 0), (-1, 4, 0x3F000000))
    assert fast_launch.launch_spec(lau, (5,)) is None
    lau.order = (0, 2, 3, 1, 4)  # a fixed value where the kernel declares a pointer
    assert fast_launch.launch_spec(lau, (5, 2)) is None


def test_off_without_cuda_or_by_setting():
    t = fast_launch.OpTable()
    with settings.override(fast_launch=False):
        assert t.launch(torch.zeros(1)) == -1
        assert t.table is None
    if not HAS_CUDA:
        assert t.launch(torch.zeros(1)) == -1 and t.table is None


# GPU -----------------------------------------------------------------------------------------


def _gpu_args(seed=0):
    a = make_args("cuda")
    g = torch.Generator(device="cuda").manual_seed(seed)
    for k in ("query", "key", "value"):
        a[k] = torch.randn(a[k].shape, generator=g, device="cuda").bfloat16()
    return a


def _run_rope(a):
    args = _rope_args(a)
    sgl_ext.apply_rope_with_cos_sin_cache_inplace(*args[:6], args[7], args[6])


@needs_cuda
def test_cuda_second_call_launches_from_c_with_the_same_bits():
    torch.manual_seed(0)
    outs = {}
    for fast in (False, True):
        with settings.override(fast_launch=fast):
            for i in range(3):  # JIT, Python direct launch (+ register), C launch
                a = _gpu_args(seed=i)
                _run_rope(a)
                names = ("query", "key", "k_buffer", "v_buffer")
                outs[fast, i] = [bits(a[k]).clone() for k in names]
            if fast:
                assert rope._FAST.table is not None and rope._FAST.table.probe(*_rope_args(a))
    torch.cuda.synchronize()
    for i in range(3):
        for x, y in zip(outs[False, i], outs[True, i], strict=True):
            assert torch.equal(x, y)


@needs_cuda
def test_cuda_set_kv_and_qk_norm_launch_from_c():
    a = _gpu_args()
    args = (a["key"], a["value"], a["k_buffer"], a["v_buffer"], a["cache_loc"], None, None, None)
    for _ in range(3):
        kv_cache.set_kv_buffer(*args)
    assert kv_cache._FAST.table.probe(*args)
    w = torch.randn(D, device="cuda").bfloat16()
    qk = (a["positions"], a["query"], a["key"], D, a["cos_sin_cache"], w, w, 1e-6, True)
    for _ in range(3):
        sgl_ext.apply_qk_norm_rope_with_cos_sin_cache_inplace(*qk)
    assert qk_norm_rope._FAST.table.probe(*qk, None, None)
    torch.cuda.synchronize()
    rows = a["cache_loc"].long()
    assert torch.equal(bits(a["v_buffer"][rows].reshape(a["value"].shape)), bits(a["value"]))


@needs_cuda
def test_cuda_graph_capture_through_the_c_path():
    a = _gpu_args()
    for _ in range(3):
        _run_rope(a)
    q0, k0 = a["query"].clone(), a["key"].clone()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
        _run_rope(a)
    torch.cuda.current_stream().wait_stream(s)
    a["query"].copy_(q0)
    a["key"].copy_(k0)
    g.replay()
    torch.cuda.synchronize()
    want = make_args("cuda")
    want["query"], want["key"] = q0.clone(), k0.clone()
    want["value"] = a["value"]
    want["k_buffer"], want["v_buffer"] = a["k_buffer"].clone(), a["v_buffer"].clone()
    with settings.override(fast_launch=False):
        _run_rope(want)
    torch.cuda.synchronize()
    assert torch.equal(bits(a["query"]), bits(want["query"]))
    assert torch.equal(bits(a["key"]), bits(want["key"]))


@needs_cuda
def test_cuda_launch_hook_sends_calls_back_to_python():
    from triton import knobs

    a = _gpu_args()
    for _ in range(3):
        _run_rope(a)
    assert rope._FAST.launch(*_rope_args(a)) == 1
    seen = []
    enter = knobs.runtime.launch_enter_hook
    hook = seen.append
    enter.add(hook)
    try:
        assert rope._FAST.launch(*_rope_args(a)) == -1
    finally:
        enter.remove(hook)
    assert rope._FAST.launch(*_rope_args(a)) == 1


@needs_cc
def test_light_keys_as_cached_launcher_keys(mod):
    """`CachedLauncher`'s table: tensors by dtype, device and alignment only (any shape), the
    grid, scalars and keyword arguments by value; a change of any is another key."""
    t = mod.Table(light=True)
    a, b = torch.randn(8), torch.randn(3, 5)
    base = t.key((3, 1), a, b, 5, ("X", 1), ("num_warps", 4))
    assert base is not None
    assert t.key((3, 1), torch.randn(2), torch.randn(7), 5, ("X", 1), ("num_warps", 4)) == base
    for other in (
        ((4, 1), a, b, 5, ("X", 1), ("num_warps", 4)),
        ((3, 1), a.half(), b, 5, ("X", 1), ("num_warps", 4)),
        ((3, 1), a[1:], b, 5, ("X", 1), ("num_warps", 4)),  # alignment 4
        ((3, 1), a, b, 6, ("X", 1), ("num_warps", 4)),
        ((3, 1), a, b, 5.0, ("X", 1), ("num_warps", 4)),
        ((3, 1), a, b, 5, ("X", 2), ("num_warps", 4)),
        ((3, 1), a, b, 5, ("Y", 1), ("num_warps", 4)),
        ((3, 1), a, b, 5, ("X", 1), ("num_warps", 8)),
        ((3, 1), a, b, 5, ("X", True), ("num_warps", 4)),
    ):
        k = t.key(*other)
        assert k is not None and k != base, other
    assert t.key((3, 1), a, b, 5, ("X", torch.float16)) is None  # not keyable: Python path


if HAS_CUDA:
    import triton
    import triton.language as tl

    @triton.jit
    def _axpy_kernel(x_ptr, y_ptr, n, alpha, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        x = tl.load(x_ptr + offs, mask=m)
        y = tl.load(y_ptr + offs, mask=m)
        tl.store(y_ptr + offs, y + alpha * x, mask=m)


@needs_cuda
def test_cuda_cached_launcher_launches_from_c():
    from sgl_ext.triton.launcher import cached_launcher

    lau = cached_launcher(_axpy_kernel)
    n = 1000
    for i in range(4):
        x = torch.randn(n, device="cuda")
        y = torch.randn(n, device="cuda")
        want = y + 0.5 * x
        lau[(triton.cdiv(n, 256),)](x, y, n, 0.5, BLOCK=256)
        torch.testing.assert_close(y, want, rtol=0, atol=1e-6)
        if i >= 2:
            key = ((triton.cdiv(n, 256),), x, y, n, 0.5, ("BLOCK", 256))
            assert lau._fast.table is not None and lau._fast.table.probe(*key)


@needs_cuda
def test_cuda_kernel_launcher_direct_launch_from_c():
    x = torch.randn(7, 257, device="cuda").bfloat16()
    w = torch.randn(257, device="cuda").bfloat16()
    outs = {}
    for fast in (False, True):
        with settings.override(fast_launch=fast):
            for _ in range(3):
                outs[fast] = sgl_ext.rmsnorm(x, w, 1e-6)
            plan = next(iter(sgl_ext.norm._PLANS.values()))
            assert (plan.launcher._c_launch is not None) == fast
    torch.cuda.synchronize()
    assert torch.equal(bits(outs[False]), bits(outs[True]))


@needs_cuda
def test_cuda_linear_small_m_launches_from_c():
    from sgl_ext import gemm

    x = torch.randn(3, 256, device="cuda").bfloat16()
    w = torch.randn(96, 256, device="cuda").bfloat16()
    cfg = gemm.GemmConfig(block_n=16, block_k=64)
    outs = {}
    for fast in (False, True):
        with settings.override(fast_launch=fast):
            for _ in range(3):
                outs[fast] = gemm.linear_small_m(x, w, None, cfg)
            if fast:  # (the table is dropped when the settings change back)
                assert gemm._FAST.table.probe(x, w, None, cfg, torch.empty_like(outs[True]))
    torch.cuda.synchronize()
    assert torch.equal(bits(outs[False]), bits(outs[True]))
    torch.testing.assert_close(outs[True].float(), (x.float() @ w.float().T), atol=0.5, rtol=2e-2)


@needs_cuda
def test_cuda_add_rmsnorm_and_silu_launch_from_c():
    from sgl_ext import activation, norm

    g = torch.Generator(device="cuda").manual_seed(5)
    x0 = torch.randn(5, 257, device="cuda", generator=g).bfloat16()
    r0 = torch.randn(5, 257, device="cuda", generator=g).bfloat16()
    w = torch.randn(257, device="cuda", generator=g).bfloat16()
    gu = torch.randn(5, 2 * 129, device="cuda", generator=g).bfloat16()
    outs = {}
    for fast in (False, True):
        with settings.override(fast_launch=fast):
            for _ in range(3):
                x, r = x0.clone(), r0.clone()
                sgl_ext.fused_add_rmsnorm(x, r, w, 1e-6)
                y = sgl_ext.silu_and_mul(gu)
            outs[fast] = (x, r, y)
            if fast:
                args = (x, r, w, 1e-6, False, True, None, None)
                assert norm._FAST_ADD.table.probe(*args)
                assert activation._FAST.table.probe(gu, torch.empty_like(y))
    torch.cuda.synchronize()
    for a, b in zip(outs[False], outs[True], strict=True):
        assert torch.equal(bits(a), bits(b))


def test_available_makes_the_table_once():
    """available() decides once per settings (a table where CUDA and the module allow it)."""
    t = fast_launch.OpTable()
    got = t.available()
    assert got == (t.table is not None) and t.made
    assert got == (HAS_CUDA and bool(fast_launch._load()) and fast_launch._can_launch)
    with settings.override(fast_launch=False):
        assert not t.available() and t.launch(torch.zeros(1)) == -1


@needs_cc
def test_build_goes_to_the_settings_cache_dir(tmp_path):
    """The extension is built into settings.cache_dir (SGL_EXT_CACHE_DIR), once."""
    with settings.override(cache_dir=str(tmp_path)):
        path = fast_launch.build()
        assert path is not None and path.parent == tmp_path and path.exists()
        mtime = path.stat().st_mtime_ns
        assert fast_launch.build() == path and path.stat().st_mtime_ns == mtime
