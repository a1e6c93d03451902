"""sgl_ext.launch_tables: the launch tables as data. Every file loads and every row is chosen
by some call (on the GPU it belongs to); a bad file or row is a ValueError naming the file and
the row; loading is cached, happens on first use only, and `override` swaps a table for a
block."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sgl_ext import device_tables, launch_tables, settings
from sgl_ext.triton import rope_kv_plan as rp
from srt.layers import gemm_choice as gc
from srt.layers.moe.fused_moe_triton import config as moe_config

READERS = {
    "rope_kv": rp.rope_kv_table,
    "qk_norm": rp.qk_norm_table,
    "gemm": gc.gemm_table,
    "moe": moe_config.moe_table,
}
NAMES = ["NVIDIA H100 80GB HBM3", "NVIDIA H200"]


@pytest.fixture
def gpu_named(monkeypatch):
    """gpu_named(name): a fake CUDA device 0 of that name (no GPU needed); caches reset."""

    def _set(name: str) -> torch.device:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: name)
        monkeypatch.setattr(device_tables, "_names", {})
        moe_config._rows.cache_clear()
        return torch.device("cuda", 0)

    yield _set
    moe_config._rows.cache_clear()


def test_every_file_is_a_table_and_loads():
    files = {p.stem for p in launch_tables.TABLES_DIR.glob("*.json")}
    assert files == set(READERS)
    for name, read in READERS.items():
        table = read()
        assert table.rows and table.name == name and read() is table  # cached
        raw = launch_tables.read(name)
        assert isinstance(raw["about"], str) and raw["about"]
        assert len(table.rows) == len(raw["rows"])
        # the file's own layout: a row a line, each one as row_line prints it
        text = launch_tables.table_path(name).read_text()
        for row in raw["rows"]:
            assert launch_tables.row_line(row) in text


def _sections(table):
    """(device name, rows): the H100's rows on an H100, each devices section on its GPU."""
    yield NAMES[0], table.rows
    for sub, rows in table.devices.items():
        yield f"NVIDIA {sub}", rows


@pytest.mark.parametrize("name", ["rope_kv", "qk_norm"])
def test_every_layout_row_is_chosen(gpu_named, name):
    """At both ends of its range, on its GPU, each row of rope_kv.json / qk_norm.json is the
    layout launch_config / qk_norm_launch_config choose."""
    table = READERS[name]()
    for gpu, rows in _sections(table):
        cuda = gpu_named(gpu)
        for row in rows:
            for t in (row.first, row.last or row.first + 5000):
                d = row.head_dim or 80
                if name == "rope_kv":
                    got = rp.launch_config(t, 64, d, row.cache == "fp8", cuda)
                else:
                    got = rp.qk_norm_launch_config(t, 64, d, cuda)
                want = row.config
                if want is None:  # the RoPE + KV table's H100 layout
                    want = rp.launch_config(t, 64, d)
                    if row.load is not None and want.load is rp.LoadOrder.START:
                        want = dataclasses.replace(want, load=row.load)
                assert got == want, (gpu, row, t)


def test_every_gemm_row_is_chosen(gpu_named):
    table = gc.gemm_table()
    for gpu, rows in _sections(table):
        cuda = gpu_named(gpu)
        for (n, k, m), cfg in rows:
            for mm in (m // 2 + 1, m):  # the smallest and largest M of the bucket
                assert gc.choose_config(n, k, mm, torch.bfloat16, cuda) == cfg, (gpu, n, k, m)
            assert launch_tables.row_line(gc.table_row((n, k, m), cfg))  # prints


def test_every_moe_row_is_chosen(gpu_named):
    table = moe_config.moe_table()
    for gpu, rows in _sections(table):
        cuda = gpu_named(gpu)
        for row in rows:
            for t in (row.first, row.last or row.first + 5000):
                got = moe_config.get_config(t, cuda, torch.bfloat16, row.experts == "mxfp4")
                assert got == row.config, (gpu, row, t)  # bf16 tiles fit: as measured
            again = moe_config.table_row(row.config, row.experts, row.first, row.last)
            assert moe_config._row(json.loads(json.dumps(again))) == row  # a fresh dict


def test_the_h200_rows_apply_on_h200_only(gpu_named):
    """Each GPU takes its own rows by a substring of its name, any other GPU the H100's."""
    for name in NAMES:
        cuda = gpu_named(name)
        own = "H200" in name
        assert (rp.launch_config(1, 32, 128, False, cuda).block_h == 4) == own
        assert (rp.qk_norm_launch_config(9, 32, 128, cuda).block_h == 16) == own
        lm_head = gc.choose_config(201088, 2880, 1, torch.bfloat16, cuda)
        assert lm_head is not None and lm_head.dot == own
        assert (moe_config.get_config(1, cuda, mxfp4=True).gate_up.block_n == 4) == own


def _rope_kv(*rows, devices=None):
    data = {"about": "test", "rows": list(rows)}
    if devices is not None:
        data["devices"] = devices
    return data


GOOD = {"head_dim": 64, "cache": "16bit", "block_h": 4, "num_warps": 4}


@pytest.mark.parametrize(
    "data, where, match",
    [
        (_rope_kv({**GOOD, "tokens": [1, None], "colour": 1}), "rows[0]", "unknown key 'colour'"),
        (_rope_kv({**GOOD, "tokens": [1, None], "load": "late"}), "rows[0]", "load must be one"),
        (_rope_kv({**GOOD, "tokens": [1, None], "block_h": 3}), "rows[0]", "powers of two"),
        (_rope_kv(GOOD), "rows[0]", "missing 'tokens'"),
        (_rope_kv({**GOOD, "tokens": [0, 8]}), "rows[0]", "tokens must be"),
        (_rope_kv({**GOOD, "tokens": [1, None], "cache": "fp16"}), "rows[0]", "cache one of"),
        (_rope_kv({**GOOD, "tokens": [1, None], "note": "a\nb"}), "rows[0]", "one line"),
        (_rope_kv({**GOOD, "tokens": [1, 8]}, [9]), "rows[1]", "a row is an object"),
        (_rope_kv({**GOOD, "tokens": [1, 8]}), "rows", "no row past 8 tokens"),
        (_rope_kv({**GOOD, "tokens": [2, None]}), "rows", "starts at 2, not 1"),
        (
            _rope_kv({**GOOD, "tokens": [1, 8]}, {**GOOD, "tokens": [10, None]}),
            "rows",
            "no row for tokens 9..9",
        ),
        (
            _rope_kv({**GOOD, "tokens": [1, 8]}, {**GOOD, "tokens": [8, None]}),
            "rows",
            "overlap",
        ),
        (
            _rope_kv({**GOOD, "tokens": [1, None]}, devices={"H200": {"tokens": [1, 8]}}),
            "",
            "'devices' maps",
        ),
        (
            _rope_kv({**GOOD, "tokens": [1, None]}, devices={"H200": [{**GOOD, "tokens": [3]}]}),
            "devices['H200'][0]",
            "tokens must be",
        ),
        ({"rows": [], "colour": 1}, "", "unknown key 'colour'"),
        ({"row": []}, "", "a list of 'rows'"),
    ],
)
def test_bad_rope_kv_table_raises(data, where, match):
    with launch_tables.override("rope_kv", data):
        with pytest.raises(ValueError, match=match) as err:
            rp.rope_kv_table()
    msg = str(err.value)
    assert msg.startswith(str(launch_tables.table_path("rope_kv"))) and where in msg


@pytest.mark.parametrize(
    "rows, match",
    [
        ([{"n": 8, "k": 8, "m": 3, "kernel": "fma"}], "m a power of two"),
        ([{"n": 8, "k": 8, "m": 2, "kernel": "mma"}], "kernel must be one of"),
        ([{"n": 8, "k": 8, "m": 2, "kernel": "f_linear"}], "f_linear is for a GPU's own rows"),
        ([{"n": 8, "k": 8, "m": 2, "kernel": "fma", "block_n": 16}], "missing 'block_k'"),
    ],
)
def test_bad_gemm_table_raises(rows, match):
    with launch_tables.override("gemm", {"rows": rows}):
        with pytest.raises(ValueError, match=match) as err:
            gc.gemm_table()
    assert "gemm.json (override): rows" in str(err.value)


def test_bad_moe_table_raises():
    row = launch_tables.read("moe")["rows"][0]
    with launch_tables.override("moe", {"rows": [{**row, "experts": "fp4"}]}):
        with pytest.raises(ValueError, match="experts must be one of"):
            moe_config.moe_table()
    with launch_tables.override("moe", {"rows": [{**row, "tokens": [1, None]}]}):
        with pytest.raises(ValueError, match="every experts kind"):
            moe_config.moe_table()


def test_broken_file_names_it(tmp_path, monkeypatch):
    monkeypatch.setattr(launch_tables, "TABLES_DIR", tmp_path)
    (tmp_path / "broken.json").write_text('{"rows": [')
    with pytest.raises(ValueError, match="broken.json: not valid JSON"):
        launch_tables.load("broken", dict)
    with pytest.raises(ValueError, match="no launch table 'absent'"):
        launch_tables.load("absent", dict)


def test_override_swaps_the_table_and_drops_plans(monkeypatch):
    """Inside override the data is the table (plans dropped on the way in and out); after it,
    the file's rows again."""
    drops = []
    monkeypatch.setattr(settings, "_listeners", [*settings._listeners, lambda: drops.append(1)])
    before = rp.qk_norm_table()
    row = {"head_dim": "other", "tokens": [1, None], "block_h": 2, "num_warps": 2}
    with launch_tables.override("qk_norm", {"rows": [row]}):
        assert len(drops) == 1
        assert rp.qk_norm_launch_config(300, 32, 128) == rp.LaunchConfig(2, 2)
        assert launch_tables.read("qk_norm")["rows"] == [row]
    assert len(drops) == 2
    after = rp.qk_norm_table()
    assert after is not before and after.rows == before.rows


def test_nothing_is_read_at_import():
    """Importing the modules that read tables reads none (tables load on first use)."""
    code = (
        "import sgl_ext, sgl_ext.launch_tables as lt, sgl_ext.triton.rope_kv_plan, "
        "srt.layers.gemm_choice, srt.layers.moe.fused_moe_triton.fused_moe, "
        "srt.layers.moe.fused_moe_triton.topk_experts, srt.layers.linear; "
        "assert not lt._cache, lt._cache"
    )
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, cwd=root)
