"""srt.settings: the environment variables srt reads, read once; no other srt module reads
the environment (torchrun's variables in srt.distributed excepted, srt/settings.py says why)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from srt import settings

SRT = Path(settings.__file__).parent
# Modules that read os.environ themselves, and why; the test fails when one no longer does.
READERS = {
    "settings.py": "the settings",
    "distributed/parallel_state.py": "torchrun's RANK / WORLD_SIZE / ...; writes NCCL's switches",
}


@pytest.mark.parametrize(
    ("env", "want"),
    [
        ({}, settings.Settings()),
        ({"HF_HUB_OFFLINE": " Yes "}, settings.Settings(hf_hub_offline=True)),
        ({"HF_HUB_OFFLINE": "0"}, settings.Settings()),
        ({"SGLANG_TORCH_PROFILER_DIR": "/x/t"}, settings.Settings(torch_profiler_dir="/x/t")),
        ({"SGLANG_TORCH_PROFILER_DIR": ""}, settings.Settings()),
        ({"OPENAI_API_KEY": "sk-1"}, settings.Settings(openai_api_key="sk-1")),
    ],
)
def test_from_env(env, want):
    assert settings.from_env(env) == want


def test_read_once_reload_and_override(monkeypatch, tmp_path):
    """The first get() reads the environment; a later change shows only after reload();
    override() replaces fields for a block and restores them."""
    monkeypatch.setenv("SGLANG_TORCH_PROFILER_DIR", str(tmp_path))
    try:
        first = settings.reload()
        assert first.torch_profiler_dir == str(tmp_path) and settings.get() is first
        monkeypatch.setenv("SGLANG_TORCH_PROFILER_DIR", "/elsewhere")
        assert settings.get() is first
        assert settings.reload().torch_profiler_dir == "/elsewhere"
        with settings.override(hf_hub_offline=True) as s:
            assert settings.get() is s and s.hf_hub_offline and s.torch_profiler_dir == "/elsewhere"
        assert not settings.get().hf_hub_offline
        with pytest.raises(TypeError):
            with settings.override(no_such_field=1):
                pass
    finally:
        monkeypatch.undo()
        settings.reload()


def test_sglang_switches_read_when_asked(monkeypatch):
    """SGLang's by-name switches are read at call time (its model files ask by name)."""
    from srt.environ import envs
    from srt.utils.common import get_bool_env_var, get_int_env_var

    monkeypatch.setenv("SGLANG_SOME_FLAG", "True")
    monkeypatch.setenv("SGLANG_SOME_INT", "7")
    assert get_bool_env_var("SGLANG_SOME_FLAG") and get_int_env_var("SGLANG_SOME_INT") == 7
    monkeypatch.setenv("SGLANG_SOME_FLAG", "0")
    monkeypatch.delenv("SGLANG_SOME_INT")
    assert not get_bool_env_var("SGLANG_SOME_FLAG") and get_int_env_var("SGLANG_SOME_INT", 3) == 3
    assert settings.sglang_switch("SGLANG_SOME_INT") is None
    monkeypatch.setenv("SGLANG_USE_AITER", "1")
    with pytest.raises(NotImplementedError, match="SGLANG_USE_AITER"):
        envs.SGLANG_USE_AITER.get()


def test_torchrun_world_size(monkeypatch):
    from srt.distributed import torchrun_world_size

    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    assert torchrun_world_size() is None
    env = {"RANK": "1", "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert torchrun_world_size() == 4


def test_only_the_listed_modules_read_the_environment():
    readers = set()
    for path in SRT.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "environb"):
                readers.add(str(path.relative_to(SRT)))
    assert readers == set(READERS)
