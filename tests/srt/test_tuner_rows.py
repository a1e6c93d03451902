"""The tuners print rows in their table file's format: each printed row reads back through the
table's own parser (benchmarks/bench_gemm.py, bench_moe.py, tune_qk_norm.py; no GPU needed)."""

from __future__ import annotations

import json

import torch

from sgl_ext import launch_tables
from sgl_ext.triton import rope_kv_plan as rp
from srt.layers import gemm_choice as gc
from srt.layers.moe.fused_moe_triton import config as moe_config
from tests.srt.benchmark_scripts import load_benchmark


def _rows(text: str) -> list[dict]:
    """The table rows of a tuner's output: its lines that are one JSON object (and a comma)."""
    lines = (ln.strip().removesuffix(",") for ln in text.splitlines())
    return [json.loads(ln) for ln in lines if ln.startswith("{")]


def _parse(parser, row: dict):
    """A row as the loader parses it: a copy without its note."""
    return parser({k: v for k, v in row.items() if k != "note"})


def test_bench_gemm_prints_gemm_json_rows(capsys):
    tool = load_benchmark("bench_gemm")
    cfg = gc.GemmConfig(64, 256, 4, 3, split_k=2, dot=True)
    times = {"F.linear": 20.0, "triton": 10.0}
    row = dict(name="qkv", n=6144, k=4096, m=8, floor_us=9.0, users=[["llama3-8b", 32]])
    tool.summary([{**row, "times_us": times, "triton_config": cfg.tag}], 0.02)
    (printed,) = _rows(capsys.readouterr().out)
    assert _parse(gc._row, printed) == ((6144, 4096, 8), cfg)


def test_bench_moe_prints_moe_json_rows():
    tool = load_benchmark("bench_moe")
    table = moe_config.moe_table()
    for row in table.rows + tuple(r for own in table.devices.values() for r in own):
        mx = row.experts == "mxfp4"
        text = tool.config_line(row.first, row.last or 1 << 20, 12.5, row.config, mx, 10.0)
        (printed,) = _rows(text)
        assert _parse(moe_config._row, printed).config == row.config


def test_tune_qk_norm_reprints_the_table(monkeypatch):
    """Without sweep points, winners() prints the D = 128 rows the GPU reads, as the file holds
    them; a winning candidate becomes that row's layout."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    tool = load_benchmark("tune_qk_norm")
    tables = tool.Tables()
    want = [r for r in rp.qk_norm_table().rows if r.head_dim == 128]
    assert [_parse(rp._qk_norm_row, r) for r in _rows(tool.winners([], tables))] == want
    cand = "block_h=2,num_warps=2,order=2d,load=pre_wait"
    point = {"shape": "qwen3-8b", "T": 1, "row": 0, "ratio": {"default": 1.1, cand: 1.0}}
    first = _rows(tool.winners([point], tables))[0]
    assert _parse(rp._qk_norm_row, first).config == rp.parse_tuning(cand)
    assert launch_tables.row_line(first).startswith('{"head_dim": 128, "tokens": [1, 8]')
