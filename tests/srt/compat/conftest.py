"""Fixtures of the SGLang model-file tests: SGLang 0.5.23's files (fetched at test time; the
tests that need them skip when the package index is unreachable) and tiny checkpoints."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.srt.compat import sglang_ckpts
from tests.srt.compat.sglang_wheel import sglang_models_dir


@pytest.fixture(scope="session")
def sglang_dir() -> Path:
    """The folder of SGLang's llama.py, qwen2.py, qwen3.py and gpt_oss.py."""
    pytest.importorskip("transformers")
    return sglang_models_dir()


def _ckpt(tmp_path_factory, name: str):
    pytest.importorskip("transformers")
    return getattr(sglang_ckpts, f"{name}_checkpoint")(tmp_path_factory.mktemp(name))


@pytest.fixture(scope="session")
def llama_ckpt(tmp_path_factory):
    return _ckpt(tmp_path_factory, "llama")


@pytest.fixture(scope="session")
def qwen3_ckpt(tmp_path_factory):
    return _ckpt(tmp_path_factory, "qwen3")


@pytest.fixture(scope="session")
def qwen2_ckpt(tmp_path_factory):
    return _ckpt(tmp_path_factory, "qwen2")


@pytest.fixture(scope="session")
def gpt_oss_ckpt(tmp_path_factory):
    return _ckpt(tmp_path_factory, "gpt_oss")


@pytest.fixture(scope="session")
def gpt_oss_mxfp4_ckpt(tmp_path_factory):
    return _ckpt(tmp_path_factory, "gpt_oss_mxfp4")
