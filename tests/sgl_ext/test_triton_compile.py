"""Compile the Triton kernel for sm_90 on any machine: catches errors the interpreter misses."""

import os
import sys

import pytest

pytest.importorskip("triton")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))


def test_kernel_variants_compile_for_sm90():
    from compile_check import main

    assert main() == 0
