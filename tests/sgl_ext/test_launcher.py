"""KernelLauncher: the first launch goes through the JIT, later ones call the compiled kernel
with the same arguments in the same order (checked with a stand-in kernel on CPU; on CUDA with
the real one)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sgl_ext import rope, settings
from sgl_ext.triton import launcher as L
from tests.sgl_ext.test_rope import run_case

HAS_CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")


class _FakeJit:
    """Looks like a @triton.jit function with params a_ptr, b_ptr, n, X (constexpr), Y."""

    params = [
        SimpleNamespace(name="a_ptr", is_constexpr=False),
        SimpleNamespace(name="b_ptr", is_constexpr=False),
        SimpleNamespace(name="n", is_constexpr=False),
        SimpleNamespace(name="X", is_constexpr=True),
        SimpleNamespace(name="Y", is_constexpr=True),
    ]

    def __init__(self, scratch: int = 0):
        self.jit_calls: list = []
        self.runs: list = []
        meta = SimpleNamespace(global_scratch_size=scratch, profile_scratch_size=0)
        self.kernel = SimpleNamespace(
            run=lambda *a: self.runs.append(a),
            function="FN",
            packed_metadata="META",
            metadata=meta,
            launch_metadata=lambda grid, stream, *args: ("LM", grid, stream, args),
        )

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.jit_calls.append((grid, args, kwargs))
            return self.kernel

        return launch


@pytest.fixture
def direct_on(monkeypatch):
    monkeypatch.setattr(L, "DIRECT_SUPPORTED", True)
    monkeypatch.setattr(L, "_RAW_STREAM", lambda index: 1000 + index)


def test_first_launch_through_jit_then_direct(direct_on):
    fn = _FakeJit()
    lau = L.KernelLauncher(fn, (7, 2), (5,), {"Y": 3, "X": 2}, {"num_warps": 4}, 1, True)
    lau.launch("A", "B")
    assert fn.jit_calls == [((7, 2), ("A", "B", 5), {"Y": 3, "X": 2, "num_warps": 4})]
    assert lau.compiled is fn.kernel
    lau.direct(11, 22)
    # grid padded to 3-D, stream of device 1, no hooks, per-call pointers, fixed, constexprs
    # in parameter order (X before Y)
    assert fn.runs == [(7, 2, 1, 1001, "FN", "META", None, None, None, 11, 22, 5, 2, 3)]


def test_call_names_pass_each_argument_where_the_kernel_declares_it(direct_on, monkeypatch):
    """A kernel declaring its runtime parameters in another order than the call (n between the
    pointers): the JIT and direct launches (Python and hooks) get them in the kernel's order;
    names that are not the kernel's are refused; a function without params (the interpreter's)
    gets them by name."""
    fn = _FakeJit()
    fn.params = [fn.params[0], fn.params[2], fn.params[1], *fn.params[3:]]  # a_ptr, n, b_ptr
    names = ("a_ptr", "b_ptr", "n")
    lau = L.KernelLauncher(fn, (3,), (5,), {"Y": 3, "X": 2}, {}, 0, True, names)
    lau.launch("A", "B")
    assert fn.jit_calls == [((3,), ("A", 5, "B"), {"Y": 3, "X": 2})]
    assert lau.order == (0, 2, 1) and lau.args((11, 22)) == (11, 5, 22, 2, 3)
    lau.direct(11, 22)
    assert fn.runs[-1][-5:] == (11, 5, 22, 2, 3)
    monkeypatch.setattr(L._RT, "launch_enter_hook", lambda meta: None)
    lau.direct(11, 22)
    assert fn.runs[-1][6] == ("LM", (3,), 1000, (11, 5, 22, 2, 3))
    same = L.KernelLauncher(_FakeJit(), (3,), (5,), {"Y": 3, "X": 2}, {}, 0, True, names)
    same.launch("A", "B")
    assert same.order is None and same.args((11, 22)) == (11, 22, 5, 2, 3)
    with pytest.raises(ValueError, match="call_names"):
        L.KernelLauncher(fn, (3,), (5,), {}, {}, 0, True, ("a_ptr", "b", "n"))
    interp = _FakeJit()
    interp.params = None
    lau = L.KernelLauncher(interp, (3,), (5,), {"X": 2}, {}, -1, False, names)
    lau.launch("A", "B")
    assert interp.jit_calls == [((3,), (), {"a_ptr": "A", "b_ptr": "B", "n": 5, "X": 2})]


def test_launch_hooks_get_launch_metadata(direct_on, monkeypatch):
    fn = _FakeJit()
    lau = L.KernelLauncher(fn, (4,), (), {"X": 1, "Y": 0}, {}, 0, True)
    lau.launch("A", "B")
    hook = L._RT.launch_enter_hook
    seen = []
    monkeypatch.setattr(L._RT, "launch_enter_hook", lambda meta: seen.append(meta))
    lau.direct(1, 2)
    run = fn.runs[-1]
    assert run[6] == ("LM", (4,), 1000, (1, 2, 1, 0)) and callable(run[7])
    monkeypatch.setattr(L._RT, "launch_enter_hook", hook)
    lau.direct(1, 2)
    assert fn.runs[-1][6:9] == (None, None, None)


def test_no_direct_launch_when_not_allowed_or_scratch(direct_on):
    fn = _FakeJit()
    lau = L.KernelLauncher(fn, (1,), (), {"X": 1, "Y": 1}, {}, 0, False)
    lau.launch("A", "B")
    assert lau.compiled is None
    fn = _FakeJit(scratch=64)  # the launcher would allocate per call
    lau = L.KernelLauncher(fn, (1,), (), {"X": 1, "Y": 1}, {}, 0, True)
    lau.launch("A", "B")
    assert lau.compiled is None


def test_constexpr_before_runtime_param_disables_direct(direct_on):
    fn = _FakeJit()
    fn.params = [fn.params[3], *fn.params[:3], fn.params[4]]
    lau = L.KernelLauncher(fn, (1,), (), {"X": 1, "Y": 1}, {}, 0, True)
    lau.launch("A", "B")
    assert lau.compiled is None


@pytest.mark.skipif(HAS_CUDA, reason="about the CPU interpreter: with CUDA the kernels compile")
def test_interpreter_never_launches_directly(backend):
    backend("triton")
    run_case(dtype=torch.bfloat16, num_tokens=3)
    plans = [p for p in rope._PLANS.values() if p.launcher is not None]
    assert plans and all(p.launcher.compiled is None for p in plans)


@gpu
@pytest.mark.parametrize("kv_dtype", [None, torch.float8_e4m3fn])
def test_direct_launches_match_reference_on_cuda(backend, kv_dtype):
    """The same case three times: the first call compiles, the later ones launch directly; each
    result is checked against the float64 reference by run_case."""
    backend("triton")
    rope._PLANS.clear()
    for seed in range(3):
        run_case(
            device="cuda",
            dtype=torch.bfloat16,
            kv_dtype=kv_dtype,
            scale="tensor" if kv_dtype else "none",
            num_tokens=33,
            hq=8,
            hkv=2,
            d=64,
            seed=seed,
        )
    launchers = [p.launcher for p in rope._PLANS.values() if p.launcher is not None]
    assert launchers and all(x.compiled is not None for x in launchers)
    with settings.override(direct_launch=False):  # the JIT path gives the same result
        run_case(device="cuda", dtype=torch.bfloat16, num_tokens=33, hq=8, hkv=2, d=64, seed=9)
        assert all(p.launcher.compiled is None for p in rope._PLANS.values() if p.launcher)


class CudaLauncher:  # the name Triton 3.6's launcher class has
    launch_cooperative_grid, launch_pdl = False, True

    def __init__(self):
        self.calls: list = []

    def launch(self, *args):
        self.calls.append(args)


def test_triton36_c_launch_abi(direct_on, monkeypatch):
    """With Triton 3.6 the C launch function is called as CudaLauncher.__call__ would."""
    monkeypatch.setattr(L, "_C_LAUNCH_ABI", True)
    fn = _FakeJit()
    fn.kernel.run = CudaLauncher()
    lau = L.KernelLauncher(fn, (3,), (9,), {"X": 1, "Y": 2}, {}, 0, True)
    lau.launch("A", "B")
    lau.direct(5, 6)
    want = (3, 1, 1, 1000, "FN", False, True, None, None, "META", None, None, None, 5, 6, 9, 1, 2)
    assert fn.kernel.run.calls == [want]


# ------------------------------------------------------------------------- CachedLauncher
class _FakeTensor(torch.Tensor):
    """A CPU tensor that reports itself on CUDA (the plan logic only reads the metadata)."""

    @property
    def device(self):  # type: ignore[override]
        return torch.device("cuda", 0)


def _fake(ptr_offset: int = 0) -> torch.Tensor:
    t = torch.zeros(8).as_subclass(_FakeTensor)
    return t[ptr_offset:] if ptr_offset else t


def _fake_params(fn: _FakeJit) -> None:
    for p in fn.params:
        p.has_default = p.name == "Y"
        p.default = 7


@pytest.fixture
def compiled_mode():
    """Settings as on a GPU host (the CPU suite runs with TRITON_INTERPRET=1)."""
    with settings.override(interpret=False, direct_launch=True):
        yield


def test_cached_launcher_keys_and_direct(direct_on, compiled_mode):
    fn = _FakeJit()
    _fake_params(fn)
    lau = L.CachedLauncher(fn)
    a, b = _fake(), _fake()
    lau[(3,)](a, b, 5, X=1, num_warps=4)  # JIT, keeps the compiled kernel
    assert fn.jit_calls[-1] == ((3,), (a, b, 5), {"X": 1, "Y": 7, "num_warps": 4})
    lau[(3,)](b, a, 5, X=1, num_warps=4)  # same plan: direct, the new pointers
    assert len(fn.jit_calls) == 1
    assert fn.runs[-1][-5:] == (b.data_ptr(), a.data_ptr(), 5, 1, 7)
    # any change of grid, scalar, constexpr, option or pointer alignment is another plan
    for grid, args, kw in (
        ((4,), (a, b, 5), {"X": 1, "num_warps": 4}),
        ((3,), (a, b, 6), {"X": 1, "num_warps": 4}),
        ((3,), (a, b, 5), {"X": 2, "num_warps": 4}),
        ((3,), (a, b, 5), {"X": 1, "num_warps": 8}),
        ((3,), (_fake(1), b, 5), {"X": 1, "num_warps": 4}),  # 4-byte offset: alignment 4
    ):
        n = len(fn.jit_calls)
        lau[grid](*args, **kw)
        assert len(fn.jit_calls) == n + 1, (grid, kw)


def test_cached_launcher_falls_back_to_jit(direct_on, compiled_mode):
    fn = _FakeJit()
    _fake_params(fn)
    lau = L.CachedLauncher(fn)
    a = _fake()
    cpu = torch.zeros(4)
    for args in ((cpu, cpu, 5), (a, a, None), (a, 5, a), (a, a)):  # CPU, None, order, arity
        for _ in range(2):
            lau[(1,)](*args, X=1)
    assert len(fn.jit_calls) == 8 and not fn.runs
    # a tensor or None among the scalars is never part of a key: the launcher, alive for the
    # process, would keep that tensor (a dead engine's KV tables) alive with it
    assert not any(isinstance(x, torch.Tensor) for k in lau._plans for x in _leaves(k))
    with settings.override(direct_launch=False):
        lau[(1,)](a, a, 5, X=1)
        lau[(1,)](a, a, 5, X=1)
    assert len(fn.jit_calls) == 10 and not fn.runs


def test_cached_launcher_call_names(direct_on, compiled_mode):
    """A kernel with a scalar between its pointers (a_ptr, n, b_ptr), called tensors first
    with call_names: planned, launched through the JIT in the kernel's order, then directly
    with the pointers where the kernel declares them; the JIT fallback (interpreter) passes
    them by name; one order per kernel."""
    fn = _FakeJit()
    fn.params = [fn.params[0], fn.params[2], fn.params[1], *fn.params[3:]]  # a_ptr, n, b_ptr
    _fake_params(fn)
    names = ("a_ptr", "b_ptr", "n")
    lau = L.CachedLauncher(fn, names)
    a, b = _fake(), _fake()
    lau[(3,)](a, b, 5, X=1)
    assert fn.jit_calls[-1] == ((3,), (a, 5, b), {"X": 1, "Y": 7})
    lau[(3,)](b, a, 5, X=1)
    assert len(fn.jit_calls) == 1 and fn.runs[-1][-5:] == (b.data_ptr(), 5, a.data_ptr(), 1, 7)
    assert len(lau._plans) == 1
    with settings.override(interpret=True):
        lau[(3,)](a, b, 6, X=1)
    assert fn.jit_calls[-1] == ((3,), (), {"a_ptr": a, "b_ptr": b, "n": 6, "X": 1})
    L._CACHED.pop(fn, None)
    assert L.cached_launcher(fn, names).call_names == names
    with pytest.raises(ValueError, match="call_names"):
        L.cached_launcher(fn)
    L._CACHED.pop(fn, None)


def _leaves(key):
    for x in key if isinstance(key, tuple) else (key,):
        yield from _leaves(x) if isinstance(x, tuple) else (x,)


def test_bare_cuda_device_means_the_current_one(monkeypatch):
    """make_launcher(..., torch.device("cuda")): the launcher keeps the current device's index
    (a None index crashed the C fast path's plan)."""
    monkeypatch.setattr(L.torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(L, "with_pdl", lambda fn, c, o, device: (c, {**o, "dev": device}))
    lau = L.make_launcher(_FakeJit(), (1,), (5,), {"X": 1, "Y": 2}, {}, torch.device("cuda"))
    assert lau.device_index == 3 and lau.options["dev"] == torch.device("cuda", 3)
    lau = L.make_launcher(_FakeJit(), (1,), (5,), {"X": 1, "Y": 2}, {}, torch.device("cuda", 1))
    assert lau.device_index == 1
