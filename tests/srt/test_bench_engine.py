"""benchmarks/bench_engine.py on CPU: its table and its refusal without CUDA (the timing runs
on the GPU: `gpu_run.sh engine`)."""

import pytest
import torch

from tests.srt.benchmark_scripts import load_benchmark


def test_table_and_no_cuda_exit(monkeypatch):
    mod = load_benchmark("bench_engine")
    row = {
        "preset": "p",
        "batch_size": 1,
        "step_ms_overlap_off": 3.0,
        "step_ms_overlap_on": 2.0,
        "graph_replay_ms": 1.9,
        "floor_ms": 1.25,
        "tokens_same": True,
    }
    lines = mod.table([row, {**row, "batch_size": 8, "tokens_same": False}]).splitlines()
    assert lines[2] == "| p | 1 | 3.000 | 2.000 | 0.67 | 1.900 | 1.250 | 1.60x | same |"
    assert lines[3].endswith("| DIFFER |")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs CUDA"):
        mod.main([])
