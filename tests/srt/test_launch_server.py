"""`python -m srt.launch_server` refuses what cannot serve before any weight loads: one
`error: ...` line and exit status 2 (run in-process: the engine or the weight loading is
replaced by a tripwire, so a check that comes too late fails the test)."""

from __future__ import annotations

import socket

import pytest

pytest.importorskip("fastapi", reason="install the server extra (fastapi, uvicorn)")
pytest.importorskip("uvicorn", reason="install the server extra (fastapi, uvicorn)")

from srt import launch_server  # noqa: E402


class Tripwire(Exception):
    """Raised where a refused start-up must never get to."""


def _tripwire(*args, **kwargs):
    raise Tripwire("got past the start-up checks")


@pytest.fixture
def no_engine(monkeypatch):
    import srt.entrypoints.engine as engine_mod

    monkeypatch.setattr(engine_mod, "Engine", _tripwire)


@pytest.fixture
def no_weights(monkeypatch):
    import srt.model_executor.model_builder as builder

    monkeypatch.setattr(builder, "build_model", _tripwire)


def _run(capsys, *argv: str) -> str:
    rc = launch_server.main(["--device", "cpu", "--log-level", "warning", *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2, err
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


@pytest.mark.parametrize("value", ["-5", "0"])
def test_bad_context_length(no_engine, capsys, value):
    line = _run(capsys, "--context-length", value)
    assert line == f"error: --context-length must be >= 1 ({value})"


def test_port_in_use(no_engine, capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        line = _run(capsys, "--port", str(port))
    assert f"--port {port}" in line and line.endswith(f"({port})")


@pytest.fixture
def no_interpreter():
    """TRITON_INTERPRET unset, as sgl_ext's settings read it (srt asks them)."""
    from sgl_ext import settings

    with settings.override(interpret=False):
        yield


def test_triton_attention_on_cpu_without_the_interpreter(no_engine, capsys, no_interpreter):
    line = _run(capsys, "--attention-backend", "triton")
    assert "attention_backend 'triton' cannot run on device 'cpu'" in line


def test_triton_kernels_on_cpu_without_the_interpreter(no_engine, capsys, backend):
    from sgl_ext import settings

    backend("triton")
    with settings.override(interpret=False):
        line = _run(capsys)
    assert "SGL_EXT_BACKEND=triton cannot run on device 'cpu'" in line


BREAKING = [('{"rms_norm_eps": -1}', "rms_norm_eps"), ('{"vocab_size": 0}', "vocab_size")]


@pytest.mark.parametrize(("override", "field"), BREAKING)
def test_overrides_that_break_the_model(no_weights, capsys, override, field):
    line = _run(capsys, "--json-model-override-args", override, "--port", "0")
    assert field in line and "model config" in line


def test_offline_hub_id_names_the_id(no_weights, capsys):
    from srt import settings

    with settings.override(hf_hub_offline=True):
        line = _run(capsys, "--model-path", "acme/not-cached-anywhere", "--port", "0")
    assert line.startswith("error: model path") and line.endswith("(acme/not-cached-anywhere)")
