"""Launch one specialisation of a `@triton.jit` kernel with the least host work per call.

`kernel[grid](...)` binds and specialises every argument, looks the compiled kernel up in the
JIT's cache, builds launch metadata and has the C launcher call `data_ptr()` and
`cuPointerGetAttribute` for every tensor: tens of µs of host time per call on a slow host. A
`KernelLauncher` holds everything that is fixed for one launch plan (grid, integer arguments,
constexprs, options). Its first launch goes through the JIT (which compiles or finds the
kernel); it keeps the returned `CompiledKernel` and launches it directly from then on:
`CompiledKernel.run(grid, stream, function, packed metadata, launch metadata, hooks, *args)` with
the pointers as plain integers (the signature is the same from Triton 3.3 to 3.9).

That is correct only if every later call would have been specialised the same way. Triton
specialises an integer on `== 1`, `% 16 == 0` and its range (i32/i64), a pointer on its dtype and
`data_ptr() % 16 == 0`. The caller guarantees it: a launcher belongs to one plan whose cache key
holds every dtype, every shape and stride the integers come from, and every pointer's
`data_ptr() % 16`; only the pointers vary per call.

Kernel convention: the parameters are the per-call pointers first, then the plan's fixed
runtime arguments (ints, floats), then the constexprs (the launcher appends the constexpr
values in parameter order, as the JIT passes them). A kernel whose runtime parameters come in
another order (ptxas schedules some kernels better with pointers and their strides side by
side: rope_kv_kernel) still takes them in that call order: `call_names` names them, and the
launcher passes each where the kernel declares it.

Never used under `TRITON_INTERPRET`, without `torch._C._cuda_getCurrentRawStream`, or with
`SGL_EXT_DIRECT_LAUNCH=0`; launch hooks (profilers) get their launch metadata as from the JIT.
Capture-safe: no allocation (kernels with a global or profile scratch buffer are launched by the
JIT) and no synchronisation.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from typing import Any

import torch
import triton
from triton import knobs

from sgl_ext import settings

_RT = knobs.runtime
_ENTER, _EXIT = _RT.launch_enter_hook, _RT.launch_exit_hook
_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_VERSION = tuple(int(x) for x in triton.__version__.split(".")[:2])
DIRECT_SUPPORTED = _RAW_STREAM is not None and (3, 3) <= _VERSION < (4, 0)
# Triton 3.6's CudaLauncher.__call__ only adds (cooperative, pdl, scratch, scratch) before
# forwarding to its C `launch`; without scratch buffers the C function is called directly.
_C_LAUNCH_ABI = _VERSION == (3, 6)


# With Triton's HookChain hooks (3.4+), the lists that say whether any hook is set; () where
# the hooks are plain attributes that default to None.
_ENTER_CALLS, _EXIT_CALLS = getattr(_ENTER, "calls", ()), getattr(_EXIT, "calls", ())


def _no_hooks() -> bool:
    enter, leave = _RT.launch_enter_hook, _RT.launch_exit_hook
    if enter is None and leave is None:
        return True
    return enter is _ENTER and leave is _EXIT and not _ENTER.calls and not _EXIT.calls


class KernelLauncher:
    """One launch plan of `fn`: grid, fixed runtime arguments, constexprs and options.

    launch(*tensors) runs it through the JIT; direct(*ptrs) through the compiled kernel, once
    `compiled` is set (after the first JIT launch, when `allow_direct`).
    """

    __slots__ = (
        "fn",
        "grid",
        "fixed",
        "constexprs",
        "options",
        "device_index",
        "allow_direct",
        "compiled",
        "_run",
        "grid3",
        "_pre",
        "tail",
        "_c_launch",
        "call_names",
        "order",
        "_pick",
    )

    def __init__(
        self,
        fn: Any,
        grid: tuple[int, ...],
        fixed: tuple[int | float, ...],
        constexprs: Mapping[str, object],
        options: Mapping[str, object],
        device_index: int,
        allow_direct: bool,
        call_names: tuple[str, ...] | None = None,
    ) -> None:
        """call_names: the runtime parameters' names in call order (the per-call tensors of
        `launch`, then `fixed`) where the kernel declares them in another order; None: the
        kernel's own order."""
        self.fn, self.grid, self.fixed = fn, grid, fixed
        self.constexprs, self.options = constexprs, options
        self.device_index = device_index
        self.allow_direct = allow_direct and DIRECT_SUPPORTED
        self.compiled: Any = None
        self._run: Any = None
        self.grid3 = (*grid, 1, 1)[:3]
        self._pre: tuple = ()
        self.tail: tuple = ()
        self._c_launch: Any = None  # the C fast path's launch of the compiled kernel
        self.call_names = call_names
        # each runtime parameter's index in (*ptrs, *fixed), in the kernel's order, where
        # call_names differ from it (None: the same order), and its C-speed picker
        self.order: tuple[int, ...] | None = None
        self._pick: Any = None
        params = getattr(fn, "params", None)  # (the interpreter's functions have none)
        if call_names is not None and params:
            runtime = [p.name for p in params if not p.is_constexpr]
            if sorted(runtime) != sorted(call_names):
                raise ValueError(f"call_names {call_names} are not the kernel's {runtime}")
            if runtime != list(call_names) and len(runtime) > 1:
                self.order = tuple(call_names.index(n) for n in runtime)
                self._pick = operator.itemgetter(*self.order)

    def launch(self, *tensors: object) -> None:
        """Launch through the JIT with the per-call arguments (tensors); keep the compiled
        kernel for direct launches."""
        kernel = self.launch_jit(*tensors)
        if self.compiled is None and self.allow_direct and kernel is not None:
            self._keep(kernel)

    def launch_jit(self, *tensors: object) -> Any:
        """Launch through the JIT (alone under torch.compile tracing: nothing kept)."""
        if self._pick is not None:  # the kernel's order
            args = self._pick((*tensors, *self.fixed))
            return self.fn[self.grid](*args, **self.constexprs, **self.options)
        if self.call_names is not None and not getattr(self.fn, "params", None):
            named = dict(zip(self.call_names, (*tensors, *self.fixed), strict=True))
            return self.fn[self.grid](**named, **self.constexprs, **self.options)
        return self.fn[self.grid](*tensors, *self.fixed, **self.constexprs, **self.options)

    def _keep(self, kernel: Any) -> None:
        if hasattr(kernel, "result"):  # an asynchronous compile's future
            kernel = kernel.result()
        params = self.fn.params
        n_const = sum(p.is_constexpr for p in params)
        # Direct launches append the constexprs: they must be the last parameters.
        if any(p.is_constexpr for p in params[: len(params) - n_const]):
            return
        meta = kernel.metadata
        if getattr(meta, "global_scratch_size", 0) or getattr(meta, "profile_scratch_size", 0):
            return  # the launcher would allocate scratch memory per call
        names = [p.name for p in params[len(params) - n_const :]]
        consts = tuple(self.constexprs[n] for n in names)
        self.tail = consts if self.order is not None else (*self.fixed, *consts)
        run = kernel.run  # the launcher (loads the module: here, outside any capture)
        # _pre: what follows the stream, up to the kernel's arguments, without hooks (launch
        # metadata, enter hook, exit hook: None).
        self._run, self._pre = run, (kernel.function, kernel.packed_metadata, None, None, None)
        c_launch = getattr(run, "launch", None)
        if _C_LAUNCH_ABI and type(run).__name__ == "CudaLauncher" and c_launch is not None:
            flags = (run.launch_cooperative_grid, run.launch_pdl, None, None)
            meta = kernel.packed_metadata
            self._run, self._pre = c_launch, (kernel.function, *flags, meta, None, None, None)
        self.compiled = kernel
        from sgl_ext import fast_launch

        self._c_launch = fast_launch.plan_launch(self)

    def direct(self, *ptrs: int) -> None:
        """Launch the compiled kernel with the per-call pointers (data_ptr() integers)."""
        self.run_ptrs(ptrs)

    def run_ptrs(self, ptrs: tuple[int, ...]) -> None:
        """`direct` with the pointers as one tuple (the ops' fast path: no repacking)."""
        c = self._c_launch
        if c is not None and c(*ptrs):  # False: launch hooks are set (Triton calls them)
            return
        rt = _RT
        stream = _RAW_STREAM(self.device_index)  # type: ignore[misc]  # allow_direct: not None
        if (
            rt.launch_enter_hook is _ENTER
            and rt.launch_exit_hook is _EXIT
            and not _ENTER_CALLS
            and not _EXIT_CALLS
        ) or _no_hooks():
            if self._pick is None:  # (the common case without building args)
                self._run(*self.grid3, stream, *self._pre, *ptrs, *self.tail)
            else:
                self._run(*self.grid3, stream, *self._pre, *self.args(ptrs))
            return
        k = self.compiled
        args = self.args(ptrs)
        meta = k.launch_metadata(self.grid, stream, *args)
        enter, leave = _RT.launch_enter_hook, _RT.launch_exit_hook
        pre = (k.function, k.packed_metadata)
        k.run(*self.grid3, stream, *pre, meta, enter, leave, *args)

    def args(self, ptrs: tuple[int, ...]) -> tuple:
        """Every kernel argument in the kernel's parameter order (constexpr values last)."""
        if self._pick is None:
            return (*ptrs, *self.tail)
        return (*self._pick((*ptrs, *self.fixed)), *self.tail)


def runtime_param_names(fn: Any) -> tuple[str, ...]:
    """A Triton kernel's non-constexpr parameters in order (the JIT's or the interpreter's)."""
    import inspect

    params = inspect.signature(getattr(fn, "fn", fn)).parameters.values()
    return tuple(p.name for p in params if "constexpr" not in str(p.annotation))


def make_launcher(
    fn: Any,
    grid: tuple[int, ...],
    fixed: tuple[int | float, ...],
    constexprs: Mapping[str, object],
    options: Mapping[str, object],
    device: torch.device,
    call_names: tuple[str, ...] | None = None,
) -> KernelLauncher:
    """A KernelLauncher for tensors on `device` (a tensor's device; a bare `cuda` means the
    current device): direct launches on CUDA unless the settings turn them off
    (`SGL_EXT_DIRECT_LAUNCH=0`) or Triton interprets. call_names: see KernelLauncher."""
    s = settings.get()
    is_cuda = device.type == "cuda"
    index = -1
    if is_cuda:
        index = device.index if device.index is not None else torch.cuda.current_device()
        device = torch.device("cuda", index)
    direct = is_cuda and s.direct_launch and not s.interpret
    constexprs, options = with_pdl(fn, constexprs, options, device)
    return KernelLauncher(fn, grid, fixed, constexprs, options, index, direct, call_names)


def pdl_on(device: torch.device) -> bool:
    """Whether kernels on `device` launch with programmatic dependent launch: CUDA on Hopper or
    newer, not interpreted, `SGL_EXT_PDL` not 0."""
    s = settings.get()
    if device.type != "cuda" or s.interpret or not s.pdl or not torch.cuda.is_available():
        return False
    from sgl_ext._backend import pdl_capable

    return pdl_capable(device.index)


def with_pdl(
    fn: Any, constexprs: Mapping[str, object], options: Mapping[str, object], device: torch.device
) -> tuple[Mapping[str, object], Mapping[str, object]]:
    """A kernel that declares a `USE_PDL` constexpr (and begins with `pdl.pdl_enter(USE_PDL)`,
    before any dependent load) gets USE_PDL and the `launch_pdl` option set from
    `pdl_on(device)`, unless the caller set USE_PDL itself."""
    # (the interpreter's functions have no params: their kernels keep the default, False)
    if "USE_PDL" in constexprs or not any(p.name == "USE_PDL" for p in getattr(fn, "params", ())):
        return constexprs, options
    on = pdl_on(device)  # set either way: a direct launch passes every constexpr explicitly
    return {**constexprs, "USE_PDL": on}, ({**options, "launch_pdl": True} if on else options)


class CachedLauncher:
    """`launcher[grid](*args, **kwargs)`: a drop-in for `fn[grid](...)` with the host work of a
    direct launch (for kernels called from Python per layer, e.g. attention).

    The arguments must follow the kernel convention: tensors first (the per-call pointers),
    then ints / floats / bools (fixed per plan), constexprs and launch options by keyword. A
    call's plan key holds the grid, each tensor's (dtype, device, data_ptr() % 16) - all that
    Triton specialises a pointer on - and every other argument's type and value; a hit launches
    that plan's compiled kernel directly. Any other call shape (a tensor among the scalars, a
    None, an unhashable value), CPU tensors, the interpreter, torch.compile tracing or
    `SGL_EXT_DIRECT_LAUNCH=0` go through the JIT as `fn[grid](...)` would.

    `call_names`: the runtime parameters' names in call order, for a kernel that declares them
    in another order (scalars between its pointers): the call passes its tensors first and the
    launcher passes each where the kernel declares it (KernelLauncher's call_names), so the
    kernel's own order, and its code, stay.
    """

    __slots__ = ("fn", "call_names", "_plans", "_params", "_fast")

    def __init__(self, fn: Any, call_names: tuple[str, ...] | None = None) -> None:
        from sgl_ext.fast_launch import OpTable
        from sgl_ext.plan_cache import PlanCache

        self.fn = fn
        self.call_names = call_names
        self._plans = PlanCache()
        self._params: dict[str, Any] | None = None
        # the C fast path: key (grid, tensors' dtype / device / data_ptr() % 16, the other
        # arguments' types and values, keyword names and values) and launch in one call
        self._fast = OpTable(light=True)

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        def launch(*args: Any, **kwargs: Any) -> None:
            self.run(grid, args, kwargs)

        return launch

    def run(self, grid: tuple[int, ...], args: tuple, kwargs: dict[str, Any]) -> None:
        fast = -1 if _compiling() else self._fast.launch(grid, *args, *kwargs.items())
        if fast == 1:
            return
        s = settings.get()
        if s.interpret or not s.direct_launch or not DIRECT_SUPPORTED or _compiling():
            self._jit(grid, args, kwargs)
            return
        ptrs = []
        metas = []
        n = 0
        for a in args:
            if a.__class__ is not torch.Tensor and not isinstance(a, torch.Tensor):
                break
            p = a.data_ptr()
            ptrs.append(p)
            metas.append((a.dtype, a.device, p & 15))
            n += 1
        rest = args[n:]
        if any(a is None or isinstance(a, torch.Tensor) for a in rest):
            # off the convention: the JIT, and no key (a key would keep these tensors alive)
            self._jit(grid, args, kwargs)
            return
        try:
            key = (grid, *metas, *[(a.__class__, a) for a in rest], *kwargs.items())
            plan = self._plans.get(key)
        except TypeError:  # unhashable
            self._jit(grid, args, kwargs)
            return
        if plan is None:
            plan = self._plans.put(key, self._plan(grid, args[:n], rest, kwargs))
        if plan is False:
            self._jit(grid, args, kwargs)
        elif plan.compiled is not None:
            plan.direct(*ptrs)
            if fast == 0:  # the next call with this key launches from C
                leaves = tuple(range(1, n + 1))  # leaf 0 is the grid
                self._fast.register(plan, leaves, grid, *args, *kwargs.items())
        else:
            plan.launch(*args[:n])

    def _jit(self, grid: tuple[int, ...], args: tuple, kwargs: dict[str, Any]) -> None:
        """Launch through the JIT (the call's arguments by name where the order differs)."""
        if self.call_names is None:
            self.fn[grid](*args, **kwargs)
        else:
            self.fn[grid](**dict(zip(self.call_names, args, strict=True)), **kwargs)

    def _plan(
        self, grid: tuple[int, ...], tensors: tuple, rest: tuple, kwargs: dict[str, Any]
    ) -> KernelLauncher | bool:
        """The launcher of a call shape, or False where only the JIT can launch it."""
        if not tensors or tensors[0].device.type != "cuda":
            return False
        if self._params is None:
            self._params = {p.name: p for p in self.fn.params}
        runtime = sum(not p.is_constexpr for p in self._params.values())
        if len(tensors) + len(rest) != runtime:  # a runtime parameter left to its default
            return False
        constexprs: dict[str, object] = {}
        options: dict[str, object] = {}
        for name, value in kwargs.items():
            p = self._params.get(name)
            (constexprs if p is not None else options)[name] = value
        for name, p in self._params.items():  # constexprs left to their defaults
            if p.is_constexpr and name not in constexprs:
                if not p.has_default:
                    return False
                constexprs[name] = p.default
        device = tensors[0].device
        constexprs, options = with_pdl(self.fn, constexprs, options, device)  # type: ignore[assignment]
        return KernelLauncher(
            self.fn, grid, rest, constexprs, options, device.index, True, self.call_names
        )


def _compiling() -> bool:
    return torch.compiler.is_compiling()


_CACHED: dict[Any, CachedLauncher] = {}


def cached_launcher(fn: Any, call_names: tuple[str, ...] | None = None) -> CachedLauncher:
    """The CachedLauncher of a @triton.jit function (one per function, made on first use):
    `cached_launcher(kernel)[grid](*args, **kwargs)` launches like `kernel[grid](...)`.
    call_names: see CachedLauncher (one order per kernel)."""
    lau = _CACHED.get(fn)
    if lau is None:
        lau = _CACHED[fn] = CachedLauncher(fn, call_names)
    elif lau.call_names != call_names:
        raise ValueError(f"{fn} is launched with call_names {lau.call_names}, not {call_names}")
    return lau
