"""SGLang's own model files for the compat tests, fetched from the package index at test time.

`sglang_models_dir()` downloads the sglang 0.5.23 wheel with `pip download --no-deps` (about
38 MB), extracts only `sglang/srt/models/{llama,qwen2,qwen3,gpt_oss}.py` into a cache folder
(`$SGL_ROPE_KV_CACHE`, else `~/.cache/sgl-rope-kv`, under `sglang-0.5.23/models`), drops the
wheel and returns that folder; later runs reuse it without the network. Nothing of SGLang's is
stored in this repository. When the index cannot be reached the tests skip, saying so.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import pytest

SGLANG_VERSION = "0.5.23"
MODEL_FILES = ("llama", "qwen2", "qwen3", "gpt_oss")
# Any build of the wheel holds the same (pure Python) model files: when pip finds none for this
# interpreter, the CPython 3.11 manylinux build is fetched instead.
_FALLBACK_PLATFORM = ("--python-version", "3.11", "--platform", "manylinux_2_34_x86_64")


def cache_root() -> Path:
    root = os.environ.get("SGL_ROPE_KV_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "sgl-rope-kv"


def _models_dir() -> Path:
    return cache_root() / f"sglang-{SGLANG_VERSION}" / "models"


def _complete(d: Path) -> bool:
    return all((d / f"{name}.py").is_file() for name in MODEL_FILES)


def _download(dest: Path) -> Path:
    """The wheel in dest (pip download --no-deps); raises RuntimeError with pip's last line."""
    base = [sys.executable, "-m", "pip", "download", f"sglang=={SGLANG_VERSION}", "--no-deps"]
    base += ["--only-binary=:all:", "--disable-pip-version-check", "--timeout", "30"]
    base += ["-q", "-d", str(dest)]
    err = ""
    for extra in ((), _FALLBACK_PLATFORM):
        try:
            proc = subprocess.run(
                [*base, *extra], capture_output=True, text=True, timeout=600, check=False
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            raise RuntimeError(f"pip download failed: {e}") from e
        wheels = sorted(dest.glob("sglang-*.whl"))
        if proc.returncode == 0 and wheels:
            return wheels[0]
        lines = (proc.stderr or proc.stdout).strip().splitlines()
        err = lines[-1] if lines else f"pip exited {proc.returncode}"
    raise RuntimeError(f"pip download sglang=={SGLANG_VERSION} failed: {err}")


def _extract(wheel: Path, out: Path) -> None:
    """Only the model files; written to a temporary folder, then moved into place."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent))
    with zipfile.ZipFile(wheel) as z:
        for name in MODEL_FILES:
            (tmp / f"{name}.py").write_bytes(z.read(f"sglang/srt/models/{name}.py"))
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)


def sglang_models_dir() -> Path:
    """The folder holding SGLang 0.5.23's model files (fetched once); pytest.skip when the
    package index is unreachable."""
    out = _models_dir()
    if _complete(out):
        return out
    with tempfile.TemporaryDirectory() as tmp:
        try:
            wheel = _download(Path(tmp))
            _extract(wheel, out)
        except (RuntimeError, KeyError, zipfile.BadZipFile, OSError) as e:
            pytest.skip(
                f"SGLang {SGLANG_VERSION}'s model files are fetched from the package "
                f"index at test time and it could not be reached: {e}"
            )
    return out
