"""Make the shared forward-batch test harness (tests/srt/models/fb_harness.py) importable."""

import pathlib
import sys

_HARNESS_DIR = str(pathlib.Path(__file__).resolve().parents[2] / "models")
if _HARNESS_DIR not in sys.path:
    sys.path.insert(0, _HARNESS_DIR)
