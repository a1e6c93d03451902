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


@pytest.mark.parametrize(("value", "on"), [(None, True), ("1", True), ("0", False), ("no", False)])
def test_pdl_setting(value, on):
    env = {} if value is None else {"SGL_EXT_PDL": value}
    assert settings.from_env(env).pdl is on


def test_with_pdl_only_for_kernels_that_declare_it_and_only_when_on():
    """with_pdl adds USE_PDL + launch_pdl only where PDL is on (CUDA sm_90+, SGL_EXT_PDL) and the
    kernel declares USE_PDL; an explicit USE_PDL of the caller is kept."""
    import torch

    from sgl_ext.triton.launcher import pdl_on, with_pdl

    class P:
        def __init__(self, name):
            self.name = name

    class Fn:
        params = [P("X"), P("USE_PDL")]

    class NoPdl:
        params = [P("X")]

    dev = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    on = pdl_on(dev)
    c, o = with_pdl(Fn(), {"A": 1}, {"num_warps": 4}, dev)
    assert (c.get("USE_PDL"), o.get("launch_pdl")) == ((True, True) if on else (None, None))
    assert with_pdl(NoPdl(), {"A": 1}, {}, dev) == ({"A": 1}, {})
    assert with_pdl(Fn(), {"USE_PDL": False}, {}, dev) == ({"USE_PDL": False}, {})
    with settings.override(pdl=False):
        assert not pdl_on(dev)
        assert with_pdl(Fn(), {}, {}, dev) == ({}, {})
    assert not pdl_on(torch.device("cpu"))
