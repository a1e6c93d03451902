"""Scheduler tests reuse the stand-in model of tests/srt/model_executor/runner_fakes.py."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model_executor"))
