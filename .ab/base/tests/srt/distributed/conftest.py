"""TP tests: make the helper modules in this folder importable (no __init__.py here); spawned
ranks inherit sys.path, so they import them too."""

import pathlib
import sys

_HERE = str(pathlib.Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
