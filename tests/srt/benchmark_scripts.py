"""Load a script of benchmarks/ as a module for its tests."""

from __future__ import annotations

import importlib.util
import os
import sys
from types import ModuleType

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load_benchmark(name: str) -> ModuleType:
    """benchmarks/<name>.py as module `name` (once per process: its dataclasses need it in
    sys.modules)."""
    if name not in sys.modules:
        path = os.path.join(ROOT, "benchmarks", f"{name}.py")
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]
