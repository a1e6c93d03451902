"""The C fast path of eager calls: one C call keys a call's metadata and launches its plan.

`csrc/fast_launch.c` is a small CPython extension (no torch C++ headers: it reads tensors
through torch's DLPack exchange API, `Tensor.__dlpack_c_exchange_api__`, and launches with
`cuLaunchKernelEx` from libcuda). It is compiled on first use with the system C compiler into
the user's cache (`$SGL_EXT_CACHE_DIR`, default `~/.cache/sgl_ext`; ~0.3 s, once per source and
Python/torch version), and is optional: without a compiler, CUDA, the exchange API or with
`SGL_EXT_FAST_LAUNCH=0`, `table()` returns None and the ops keep their Python fast path.

An op owns one `Table`. Its hot path calls `table.launch(*args)` with its own arguments:
1 = launched; 0 = no plan under this key (run the Python path, then `register` the plan);
-1 = not keyable here (a tensor subclass, an unknown object), launch hooks set, or a plan
that cannot launch from C: run the Python path and do not register. The key holds everything
the op's checks read (see the C file); `register` stores a plan only after the Python path
checked the call and launched its kernel, and only for a Triton `KernelLauncher` whose
compiled kernel's parameter list it can describe exactly (checked again in C against
`cuFuncGetParamInfo`).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import warnings
from pathlib import Path
from typing import Any, Protocol

import torch

from sgl_ext import settings


class LaunchPlan(Protocol):
    """What the C path reads of a launch plan (`triton/launcher.py`'s KernelLauncher)."""

    compiled: Any  # the kernel Triton compiled on the plan's first launch (None before)
    fixed: tuple  # the plan's fixed runtime arguments
    tail: tuple  # the arguments after the per-call pointers (constexprs last)
    order: Any  # the kernel's parameter order over (pointers, fixed), or None
    grid3: tuple[int, ...]
    device_index: int


_SRC = Path(__file__).parent / "csrc" / "fast_launch.c"
_NAME = "sgl_ext_fast_launch"
_module: Any = None  # None: not tried yet; False: unavailable
_can_launch = False
_tables: list[OpTable] = []

# Sizes of a Triton kernel's scalar parameter types (pointers are 8 bytes).
_SCALAR_SIZE = {"i1": 1, "u1": 1, "i8": 1, "u8": 1, "i16": 2, "u16": 2, "i32": 4, "u32": 4}
_SCALAR_SIZE |= {"i64": 8, "u64": 8, "fp32": 4, "f32": 4, "fp64": 8}


def _cache_dir() -> Path:
    return Path(settings.get().cache_dir).expanduser()


def _include_dirs() -> list[str]:
    import triton

    dirs = [
        sysconfig.get_paths()["include"],
        os.path.join(os.path.dirname(torch.__file__), "include"),
        os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "include"),
    ]
    return dirs


def build(verbose: bool = False) -> Path | None:
    """Compile the extension into the cache (once per source, Python and torch version); its
    path, or None where no C compiler or header is found or the compile fails."""
    cc = settings.get().cc or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    src = _SRC.read_bytes()
    tag = hashlib.sha256(
        src + sys.version.encode() + torch.__version__.encode() + cc.encode()
    ).hexdigest()[:16]
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    out = _cache_dir() / f"{_NAME}_{tag}{suffix}"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    incs = [f"-I{d}" for d in _include_dirs()]
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        obj = Path(tmp) / out.name
        cmd = [cc, "-O2", "-shared", "-fPIC", *incs, str(_SRC), "-o", str(obj)]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            if verbose:
                print(res.stderr, file=sys.stderr)
            return None
        os.replace(obj, out)  # atomic: concurrent builders each install a complete file
    return out


def _load() -> Any:
    """The initialised module, or False where the fast path is unavailable."""
    global _module, _can_launch
    if _module is not None:
        return _module
    _module = False
    api = getattr(torch.Tensor, "__dlpack_c_exchange_api__", None)
    if api is None:
        return _module
    try:
        path = build()
    except OSError:
        path = None
    if path is None:
        return _module
    import importlib.util

    from triton import knobs

    spec = importlib.util.spec_from_file_location(_NAME, path)
    if spec is None or spec.loader is None:
        return _module
    try:
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        rt = knobs.runtime
        enter, leave = rt.launch_enter_hook, rt.launch_exit_hook
        calls = (getattr(enter, "calls", None), getattr(leave, "calls", None))
        types = (torch.Tensor, torch.nn.Parameter)
        _can_launch = bool(mod.init(api, types, rt, enter, leave, *calls))
    except Exception as exc:  # an ABI this file does not know: keep the Python path
        warnings.warn(f"sgl_ext fast launch unavailable: {exc}", stacklevel=2)
        return _module
    _module = mod
    return _module


def enabled() -> bool:
    """Whether the settings allow the C fast path (`SGL_EXT_FAST_LAUNCH`, direct launches on,
    not interpreted)."""
    s = settings.get()
    return s.fast_launch and s.direct_launch and not s.interpret


class OpTable:
    """An op's plan table, made on the op's first call (no work at import).

    `light`: tensors keyed by dtype, device and data_ptr() % 16 only (what Triton specialises
    a pointer on: `CachedLauncher`, whose plans do not depend on shapes).

    `launch(*args)` is the C table's launch once it exists; -1 (take the Python path, do not
    register) where the C fast path cannot launch: no module, no libcuda, no CUDA, or the
    settings turn it off (`SGL_EXT_FAST_LAUNCH=0`, direct launches off, the interpreter).
    `expand`: ((arg index, (attribute, ...)), ...) arguments keyed by class and named
    attributes (None allowed); `grad`: leaf indexes whose requires_grad is part of the key
    (leaves: the arguments in order, an expanded argument followed by its attributes);
    `written`: leaf indexes the op writes in place, whose overlaps with the other tensors (and
    pointer offsets where they meet) a call must share with the registering call to launch
    from C (else 0: the Python path checks its aliasing, `_alias.py`)."""

    def __init__(
        self,
        expand: tuple = (),
        grad: tuple[int, ...] = (),
        light: bool = False,
        written: tuple[int, ...] = (),
    ) -> None:
        self.expand, self.grad, self.light, self.written = expand, grad, light, written
        self.table: Any = None
        self.made = False  # whether the table was looked for since the last reset
        self.launch: Any = self._first_launch
        _tables.append(self)

    def _make(self) -> None:
        self.table = _new_table(self.expand, self.grad, self.light, self.written)
        self.launch = self.table.launch if self.table is not None else _never
        self.made = True

    def _first_launch(self, *args: object) -> int:
        self._make()
        return self.launch(*args)

    def available(self) -> bool:
        """Whether calls can launch from C (makes the table on first use)."""
        if not self.made:
            self._make()
        return self.table is not None

    def register(self, launcher: Any, ptr_leaves: tuple[int, ...], *args: object) -> bool:
        """Store launcher's plan under the key of args (after the Python path checked and
        launched this call). False where the plan cannot launch from C."""
        if self.table is None or launcher is None:
            return False
        spec = launch_spec(launcher, ptr_leaves)
        if spec is None:
            return False
        return bool(self.table.register(spec, *args))

    def reset(self) -> None:
        """Drop the table (settings changed): the next call decides again."""
        if self.table is not None:
            self.table.clear()
        self.table = None
        self.made = False
        self.launch = self._first_launch


def _never(*args: object) -> int:
    return -1


def _launch_module() -> Any:
    """The module where the settings allow launches from C and it can launch; else None."""
    if not enabled() or not torch.cuda.is_available():
        return None
    mod = _load()
    return mod if mod and _can_launch else None


def _new_table(expand: tuple, grad: tuple[int, ...], light: bool, written: tuple[int, ...]) -> Any:
    mod = _launch_module()
    if mod is None:
        return None
    return mod.Table(expand=expand, grad=grad, light=light, written=written)


def plan_launch(launcher: LaunchPlan) -> Any:
    """The C launch of a launcher's compiled kernel: `f(*ptrs)` -> True (launched) or False
    (launch hooks set: launch through Triton); None where it cannot launch from C."""
    mod = _launch_module()
    if mod is None:
        return None
    spec = launch_spec(launcher, None)
    if spec is None:
        return None
    n = sum(leaf >= 0 for leaf, _, _ in spec[-1])  # the per-call pointers
    try:
        return mod.Plan(spec, n).launch
    except ValueError:  # a parameter list the kernel does not have
        return None


def _reset_tables() -> None:
    for t in _tables:
        t.reset()


settings.on_change(_reset_tables)


def launch_spec(launcher: LaunchPlan, ptr_leaves: tuple[int, ...] | None) -> tuple | None:
    """The C plan of a launcher whose kernel has been compiled: (compiled kernel, function,
    grid, threads, shared, pdl, device, params), with ptr_leaves[i] the leaf whose data
    pointer is the i-th per-call pointer (None: leaf i, as `Plan.launch(*ptrs)` takes them).
    None where the kernel's parameters cannot be described (a scratch buffer, clusters,
    cooperative launch, a scalar type without a fixed size)."""
    k = launcher.compiled
    src = getattr(k, "src", None)
    if k is None or not isinstance(getattr(k, "function", None), int) or src is None:
        return None
    meta = k.metadata
    if getattr(meta, "global_scratch_size", 0) or getattr(meta, "profile_scratch_size", 0):
        return None
    if getattr(meta, "num_ctas", 1) != 1 or getattr(meta, "launch_cooperative_grid", False):
        return None
    shared = int(meta.shared)
    if shared > 227 * 1024:
        return None
    sig = list(getattr(src, "signature", {}).values())
    tail = launcher.tail
    # each parameter's index in (*per-call pointers, *tail); a launcher with an `order` takes
    # its runtime parameters from (*pointers, *fixed) in that order, the constexprs from tail
    order = getattr(launcher, "order", None)
    if order is None:
        n_ptr = len(sig) - len(tail)
        values, source = tail, list(range(len(sig)))
    else:
        n_ptr = len(order) - len(launcher.fixed)
        values = (*launcher.fixed, *tail)
        source = [*order, *range(len(order), len(sig))]
    if ptr_leaves is None:
        ptr_leaves = tuple(range(max(n_ptr, 0)))
    if n_ptr != len(ptr_leaves) or n_ptr < 0 or len(source) != len(sig):
        return None
    params: list[tuple[int, int, int]] = []
    for i, ty in enumerate(sig):
        if not isinstance(ty, str):
            return None
        j = source[i]
        if j < n_ptr:
            if not ty.startswith("*"):
                return None
            params.append((ptr_leaves[j], 8, 0))
            continue
        if ty == "constexpr":
            continue
        value = values[j - n_ptr]
        size = _SCALAR_SIZE.get(ty)
        if size is None or isinstance(value, torch.Tensor):
            return None
        params.append((-1, size, _pack(ty, value, size)))
    grid = launcher.grid3
    threads = 32 * int(meta.num_warps)
    pdl = bool(getattr(meta, "launch_pdl", False))
    return (k, int(k.function), grid, threads, shared, pdl, launcher.device_index, tuple(params))


def _pack(ty: str, value: object, size: int) -> int:
    """A scalar parameter's bytes as an unsigned integer (little end first)."""
    import struct

    if ty in ("fp32", "f32"):
        return struct.unpack("<I", struct.pack("<f", float(value)))[0]  # type: ignore[arg-type]
    if ty == "fp64":
        return struct.unpack("<Q", struct.pack("<d", float(value)))[0]  # type: ignore[arg-type]
    return int(value) & ((1 << (8 * size)) - 1)  # type: ignore[call-overload]
