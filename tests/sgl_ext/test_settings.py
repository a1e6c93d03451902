"""The settings module: SGL_EXT_BACKEND accepts only the backends the package has."""

import os
from pathlib import Path

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
    """with_pdl sets a declared USE_PDL from pdl_on (CUDA sm_90+, SGL_EXT_PDL), with launch_pdl
    where on; kernels without USE_PDL and an explicit USE_PDL of the caller are left alone."""
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
    assert (c.get("USE_PDL"), o.get("launch_pdl")) == ((True, True) if on else (False, None))
    assert with_pdl(NoPdl(), {"A": 1}, {}, dev) == ({"A": 1}, {})
    assert with_pdl(Fn(), {"USE_PDL": False}, {}, dev) == ({"USE_PDL": False}, {})
    with settings.override(pdl=False):  # off: USE_PDL still set (direct launches pass it)
        assert not pdl_on(dev)
        assert with_pdl(Fn(), {}, {}, dev) == ({"USE_PDL": False}, {})
    assert not pdl_on(torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(
    not __import__("torch").cuda.is_available(), reason="needs CUDA (direct launches)"
)
def test_cuda_pdl_on_and_off_give_the_same_bits():
    """Every USE_PDL kernel, launched through the JIT and then directly, with SGL_EXT_PDL on and
    off: the same bits (PDL changes when a kernel may start, never what it computes)."""
    import torch

    from sgl_ext.activation import silu_and_mul
    from sgl_ext.gemm import GemmConfig, linear_small_m
    from sgl_ext.norm import fused_add_rmsnorm, rmsnorm

    g = torch.Generator(device="cuda").manual_seed(7)
    x = torch.randn(7, 4096, device="cuda", dtype=torch.bfloat16, generator=g)
    r = torch.randn(7, 4096, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.rand(4096, device="cuda", dtype=torch.bfloat16, generator=g) + 0.5
    gu = torch.randn(7, 2 * 1000, device="cuda", dtype=torch.bfloat16, generator=g)
    wl = torch.randn(257, 4096, device="cuda", dtype=torch.bfloat16, generator=g)
    cfgs = [GemmConfig(4, 1024, 2, 3, split_k=1, dot=False), GemmConfig(64, 256, 4, 3, 2, True)]

    def run():
        outs = []
        for _ in range(2):  # the first call plans and JIT-launches, the second launches directly
            outs += [rmsnorm(x, w), *fused_add_rmsnorm(x, r, w, inplace=False)]
            outs += [silu_and_mul(gu), *(linear_small_m(x, wl, None, c) for c in cfgs)]
        torch.cuda.synchronize()
        return outs

    with settings.override(pdl=True):
        on = run()
    with settings.override(pdl=False):
        off = run()
    for a, b in zip(on, off, strict=True):
        assert torch.equal(a, b)
    assert torch.allclose(on[-1].float(), (x.float() @ wl.float().t()), rtol=2e-2, atol=2e-1)


def test_cache_dir_and_cc_are_settings(monkeypatch, tmp_path):
    """SGL_EXT_CACHE_DIR and CC are read with the other variables (fast_launch reads only the
    settings): unset, the user's cache and the compiler on PATH."""
    s = settings.from_env({"SGL_EXT_CACHE_DIR": str(tmp_path), "CC": "clang"})
    assert (s.cache_dir, s.cc) == (str(tmp_path), "clang")
    s = settings.from_env({"SGL_EXT_CACHE_DIR": "", "CC": ""})
    assert (s.cache_dir, s.cc) == (os.path.join("~", ".cache", "sgl_ext"), None)
    from sgl_ext import fast_launch

    assert fast_launch._cache_dir() == Path(settings.get().cache_dir).expanduser()
    monkeypatch.setenv("SGL_EXT_CACHE_DIR", str(tmp_path / "c"))
    try:
        settings.reload()
        assert fast_launch._cache_dir() == tmp_path / "c"
    finally:
        monkeypatch.undo()
        settings.reload()
    assert fast_launch._cache_dir() == Path("~/.cache/sgl_ext").expanduser()


def test_sgl_ext_reads_the_environment_only_in_settings():
    """No sgl_ext module but settings.py reads os.environ / os.getenv."""
    import ast

    import sgl_ext

    root = Path(sgl_ext.__file__).parent
    readers = set()
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "environb"):
                readers.add(str(path.relative_to(root)))
    assert readers == {"settings.py"}
