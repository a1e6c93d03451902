"""Test setup: without CUDA, Triton kernels run in the interpreter on CPU tensors."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Must be set before any @triton.jit function is defined (sgl_ext imports them lazily).
    os.environ.setdefault("TRITON_INTERPRET", "1")

HAS_CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")


@pytest.fixture
def backend(monkeypatch: pytest.MonkeyPatch):
    """Force an sgl_ext backend for the duration of a test: backend("triton")."""
    from sgl_ext import settings

    def _force(name: str) -> None:
        monkeypatch.setenv("SGL_EXT_BACKEND", name)
        settings.reload()

    yield _force
    monkeypatch.undo()
    settings.reload()
