"""sgl_ext tests: settings changed by a test (environment or override) end with it."""

import pytest

from sgl_ext import settings


@pytest.fixture(autouse=True)
def _fresh_settings(monkeypatch: pytest.MonkeyPatch):
    """Tests set SGL_EXT_* with monkeypatch and call settings.reload(); afterwards the
    environment is restored and read again (which also drops the cached launch plans)."""
    yield
    monkeypatch.undo()
    settings.reload()
