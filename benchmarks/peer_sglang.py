"""SGLang's own fused RoPE + KV-store kernel as a benchmark peer (optional, never vendored).

SGLang >= 0.5.23 ships the kernel as CUDA source (`sglang/kernels/jit/csrc/elementwise/rope.cuh`)
that it compiles at run time through apache-tvm-ffi. The device machine has no network and cannot
install SGLang's dependencies, so this module builds that same source the way SGLang's loader
does (same template arguments, flags and tvm-ffi export) without importing the `sglang` package:

    SGL_BENCH_SGLANG_DIR   a directory holding `sglang/kernels/jit` (an unzipped sglang wheel)
    PYTHONPATH             must make `tvm_ffi` importable (apache-tvm-ffi for that Python)

`load(...)` returns a callable with our benchmark's argument order, or raises `PeerUnavailable`
saying what is missing. Built modules are cached under `$SGL_EXT_CACHE_DIR/peer_sglang`.

Usage (build check): python benchmarks/peer_sglang.py [--arch 90]
"""

from __future__ import annotations

import functools
import hashlib
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

import torch

_CPP_DTYPE = {torch.bfloat16: "bf16_t", torch.float16: "fp16_t"}
_FFI_INCLUDES = (
    "tvm/ffi/container/tensor.h",
    "tvm/ffi/dtype.h",
    "tvm/ffi/error.h",
    "tvm/ffi/extra/c_env_api.h",
    "tvm/ffi/function.h",
)


class PeerUnavailable(RuntimeError):
    """SGLang's kernel cannot be built or loaded here (the reason is the message)."""


def _jit_dir() -> pathlib.Path:
    root = os.environ.get("SGL_BENCH_SGLANG_DIR")
    if not root:
        raise PeerUnavailable("SGL_BENCH_SGLANG_DIR is not set")
    jit = pathlib.Path(root) / "sglang" / "kernels" / "jit"
    if not (jit / "csrc" / "elementwise" / "rope.cuh").is_file():
        raise PeerUnavailable(f"{jit}/csrc/elementwise/rope.cuh not found")
    return jit


def _nvcc() -> str:
    for cand in (os.environ.get("NVCC"), shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if cand and os.path.isfile(cand):
            return cand
    raise PeerUnavailable("nvcc not found")


def _source(is_neox: bool, rope_dim: int, pdl: bool, dtype: torch.dtype) -> str:
    """A translation unit that includes rope.cuh and exports its fused entry point."""
    args = ", ".join(["true" if is_neox else "false", str(rope_dim), "true" if pdl else "false",
                      _CPP_DTYPE[dtype], _CPP_DTYPE[dtype]])  # fmt: skip
    lines = [f"#include <{h}>" for h in _FFI_INCLUDES]
    lines += ['#include "elementwise/rope.cuh"', "namespace sglang {"]
    entry = f"FusedRopeKernel<{args}>::run_fused"
    lines.append(f"TVM_FFI_DLL_EXPORT_TYPED_FUNC(run_rope_store, ({entry}));")
    lines.append("}  // namespace sglang")
    return "\n".join(lines) + "\n"


def build(is_neox: bool, rope_dim: int, pdl: bool, dtype: torch.dtype, arch: int) -> pathlib.Path:
    """Compile the module for sm_{arch}a (no GPU needed); returns the shared library's path."""
    try:
        from tvm_ffi.libinfo import find_dlpack_include_path, find_include_path, find_libtvm_ffi
    except ImportError as err:
        raise PeerUnavailable(f"tvm_ffi is not importable ({err})") from err
    jit = _jit_dir()
    src = _source(is_neox, rope_dim, pdl, dtype)
    lib = pathlib.Path(find_libtvm_ffi())
    includes = dict.fromkeys([find_include_path(), find_dlpack_include_path(),
                              str(jit / "include"), str(jit / "csrc")])  # fmt: skip
    target = f"{arch}a"
    flags = [f"-DSGL_CUDA_ARCH={arch * 10}", "-std=c++20", "-O3", "--expt-relaxed-constexpr",
             f"-gencode=arch=compute_{target},code=sm_{target}", "-Xcompiler", "-fPIC",
             "-shared", *(f"-I{p}" for p in includes), f"-L{lib.parent}",
             f"-l{lib.stem.removeprefix('lib')}", "-lcudart"]  # fmt: skip
    key_src = src + " ".join(flags) + (jit / "csrc" / "elementwise" / "rope.cuh").read_text()
    key = hashlib.sha256(key_src.encode()).hexdigest()[:16]
    cache = pathlib.Path(os.environ.get("SGL_EXT_CACHE_DIR", "~/.cache/sgl_ext")).expanduser()
    out = cache / "peer_sglang" / f"fused_rope_{key}.so"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        cu = pathlib.Path(tmp) / "wrapper.cu"
        cu.write_text(src)
        so = pathlib.Path(tmp) / "m.so"
        proc = subprocess.run([_nvcc(), *flags, str(cu), "-o", str(so)], capture_output=True,
                              text=True)  # fmt: skip
        if proc.returncode != 0:
            raise PeerUnavailable(f"nvcc failed:\n{proc.stderr[-3000:]}")
        os.replace(so, out)
    return out


@functools.cache
def _module(is_neox: bool, rope_dim: int, pdl: bool, dtype: torch.dtype, arch: int):
    import tvm_ffi

    return tvm_ffi.load_module(str(build(is_neox, rope_dim, pdl, dtype, arch)))


def load(is_neox: bool, rope_dim: int, dtype: torch.dtype):
    """fn(pos, q, k, v, cos_sin, k_cache, v_cache, loc): SGLang's fused RoPE + KV store.

    q [T, Hq, D], k/v [T, Hkv, D] (same head stride), caches [slots, Hkv * D], cos_sin fp32
    [max_pos, rope_dim], pos/loc int32 or int64 of one dtype. PDL as SGLang enables it (sm_90+).
    """
    if dtype not in _CPP_DTYPE:
        raise PeerUnavailable(f"dtype {dtype} not supported by the peer")
    major, minor = torch.cuda.get_device_capability()
    mod = _module(is_neox, rope_dim, major >= 9, dtype, major * 10 + minor)
    run = mod["run_rope_store"] if hasattr(mod, "__getitem__") else mod.run_rope_store

    def fn(pos, q, k, v, cos_sin, k_cache, v_cache, loc):
        run(q, k, v, k_cache, v_cache, cos_sin, pos, loc)

    return fn


if __name__ == "__main__":
    arch = int(sys.argv[sys.argv.index("--arch") + 1]) if "--arch" in sys.argv else 90
    for neox, dim in ((True, 128), (True, 64)):
        print(build(neox, dim, True, torch.bfloat16, arch))
