"""Just-in-time build of the CUDA C++ kernels in `sgl_ext/csrc` into cached shared libraries.

A kernel source is compiled by nvcc (no torch headers: a few seconds) for the GPU's own
architecture into `$SGL_EXT_CACHE_DIR` (default `~/.cache/sgl_ext`), never into the package
directory. The file name carries a hash of the source, the flags and the nvcc version, so an
edited source or another toolkit builds anew; a finished build is moved into place atomically, so
concurrent processes (tensor-parallel ranks) never load a half-written file. The library is
loaded with ctypes and exposes plain C functions that take raw pointers and the CUDA stream.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from sgl_ext import settings

CSRC = Path(__file__).resolve().parent.parent / "csrc"
NVCC_FLAGS = ("-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC", "-lineinfo")


class BuildError(RuntimeError):
    """nvcc is missing or failed; the caller falls back to another backend."""


def cache_dir() -> Path:
    env = settings.get().cache_dir
    return Path(env) if env else Path.home() / ".cache" / "sgl_ext"


def find_nvcc() -> str | None:
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and (Path(root) / "bin" / "nvcc").is_file():
            return str(Path(root) / "bin" / "nvcc")
    return shutil.which("nvcc")


@functools.cache
def _nvcc_version(nvcc: str) -> str:
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60)
    return out.stdout.strip().splitlines()[-1] if out.returncode == 0 else "unknown"


def arch_flags(capability: tuple[int, int]) -> list[str]:
    """SASS for exactly this GPU (sm_90 on an H100)."""
    cc = f"{capability[0]}{capability[1]}"
    return ["-gencode", f"arch=compute_{cc},code=sm_{cc}"]


def build(
    name: str, capability: tuple[int, int], out_dir: Path | None = None, extra_flags: str = ""
) -> Path:
    """Compile `csrc/<name>.cu` for `capability` (cached); returns the shared library's path.
    extra_flags: more nvcc flags (e.g. -D switches of experiments), part of the cache key."""
    nvcc = find_nvcc()
    if nvcc is None:
        raise BuildError("nvcc not found (set CUDA_HOME or put nvcc on PATH)")
    src = CSRC / f"{name}.cu"
    flags = [*NVCC_FLAGS, *arch_flags(capability), *extra_flags.split()]
    key = hashlib.sha256(
        src.read_bytes() + " ".join(flags).encode() + _nvcc_version(nvcc).encode()
    ).hexdigest()[:16]
    out_dir = out_dir or cache_dir()
    lib = out_dir / f"{name}-sm{capability[0]}{capability[1]}-{key}.so"
    if not lib.exists():
        run_nvcc(nvcc, [*flags, str(src)], lib)
    return lib


def run_nvcc(nvcc: str, args: list[str], lib: Path) -> None:
    """nvcc args -o lib, written beside lib and moved into place only when complete (so
    concurrent processes never load a half-written file); BuildError on failure."""
    lib.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=lib.parent)
    os.close(fd)
    cmd = [nvcc, *args, "-o", tmp]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if res.returncode != 0:
            raise BuildError(f"nvcc failed ({' '.join(cmd)}):\n{res.stderr[-4000:]}")
        os.replace(tmp, lib)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load(name: str, capability: tuple[int, int], extra_flags: str = "") -> ctypes.CDLL:
    """Build (or find in the cache) and load `csrc/<name>.cu` for one GPU architecture (the
    caller keeps the handle; loading the same file again returns the same library)."""
    return ctypes.CDLL(str(build(name, capability, extra_flags=extra_flags)))
