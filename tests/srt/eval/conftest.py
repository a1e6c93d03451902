"""Fixtures for the eval tests: a synthetic GPQA CSV and the embedded tiny tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.srt.eval.gpqa_fakes import synthetic_rows, write_csv


@pytest.fixture
def gpqa_csv(tmp_path: Path):
    """Factory: gpqa_csv(n) writes an n-row synthetic GPQA CSV and returns its path."""

    def _make(n: int = 7) -> Path:
        return write_csv(tmp_path / f"gpqa_{n}.csv", synthetic_rows(n))

    return _make


@pytest.fixture(scope="session")
def tiny_tokenizer():
    pytest.importorskip("transformers")
    from srt.assets import load_tiny_tokenizer

    return load_tiny_tokenizer()
