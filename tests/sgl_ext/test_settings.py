"""The settings module: SGL_EXT_BACKEND accepts only the backends the package has."""

import pytest

from sgl_ext import settings


@pytest.mark.parametrize("value", ["cuda", "CUDA", "gpu", "tritonx"])
def test_unknown_backend_is_a_clear_error(monkeypatch, value):
    """The CUDA C++ backend is gone: `SGL_EXT_BACKEND=cuda` (like any unknown name) raises a
    ValueError naming the variable and the allowed values, and the settings stay as they were."""
    before = settings.get()
    monkeypatch.setenv("SGL_EXT_BACKEND", value)
    with pytest.raises(ValueError, match=r"SGL_EXT_BACKEND must be one of native, triton") as e:
        settings.reload()
    assert repr(value.lower()) in str(e.value)
    assert settings.get() is before
    with pytest.raises(ValueError, match="SGL_EXT_BACKEND"):
        settings.Settings(backend="cuda")


@pytest.mark.parametrize("value", ["native", "triton", " Triton ", ""])
def test_known_backends_are_read(monkeypatch, value):
    monkeypatch.setenv("SGL_EXT_BACKEND", value)
    assert settings.reload().backend == (value.strip().lower() or None)
