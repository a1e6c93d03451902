"""nvcc for the benchmark's peer kernels: find it, where builds are cached, an atomic build.

Builds go to `$SGL_EXT_CACHE_DIR` (default `~/.cache/sgl_ext`), never into the repository. A
finished library is moved into place atomically, so concurrent processes (tensor-parallel ranks,
two benches) never load a half-written file.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path


class BuildError(RuntimeError):
    """nvcc failed (the message holds the command and the end of its stderr)."""


def cache_dir() -> Path:
    """`$SGL_EXT_CACHE_DIR`, or `~/.cache/sgl_ext`."""
    env = os.environ.get("SGL_EXT_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "sgl_ext"


def find_nvcc() -> str | None:
    """nvcc under $CUDA_HOME, $CUDA_PATH or /usr/local/cuda, else on PATH (None: not found)."""
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and (Path(root) / "bin" / "nvcc").is_file():
            return str(Path(root) / "bin" / "nvcc")
    return shutil.which("nvcc")


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
