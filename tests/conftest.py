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


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--gpu-only",
        action="store_true",
        help="run only the tests that need CUDA (a 'needs CUDA' skipif, or a cuda parameter)",
    )


def _needs_cuda(item: pytest.Item) -> bool:
    """A GPU test: marked with a "needs CUDA" skipif, or a "cuda" parameter in its id."""
    callspec = getattr(item, "callspec", None)
    if callspec is not None and "cuda" in callspec.id.split("-"):
        return True
    return any("needs CUDA" in str(m.kwargs.get("reason", "")) for m in item.iter_markers("skipif"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.getoption("--gpu-only"):
        return
    keep = [i for i in items if _needs_cuda(i)]
    config.hook.pytest_deselected(items=[i for i in items if i not in keep])
    items[:] = keep
