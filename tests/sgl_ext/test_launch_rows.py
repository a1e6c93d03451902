"""Every row of every launch table against the float64 reference, on 16-bit and fp8 caches.

The per-GPU rows (the `devices` rows of rope_kv.json and qk_norm.json) are chosen by the GPU's name,
so a GPU runs only its own rows by default. Here each row is forced through
SGL_EXT_TRITON_CONFIG, so every GPU's rows run on whichever GPU (or the interpreter) is at hand.
On CPU each row runs a few tokens under the interpreter; on the GPU at both ends of its token
range (rope_kv_sweep.row_cases).
"""

from __future__ import annotations

import pytest
import torch

from sgl_ext import settings
from sgl_ext.triton import rope_kv_plan as rp
from tests.conftest import gpu
from tests.sgl_ext.rope_kv_sweep import SweepCase, row_cases, run_case, table_rows

ROWS = table_rows()


def test_every_table_row_is_listed():
    """table_rows holds every configured row of the RoPE + KV and q/k-norm tables, any GPU's."""
    strings = {r[1] for r in ROWS}
    configs = []
    for table in (rp.rope_kv_table(), rp.qk_norm_table()):
        rows = table.rows + tuple(r for own in table.devices.values() for r in own)
        configs += [r.config for r in rows if r.config is not None]
    missing = [c for c in configs if rp.tuning_string(c) not in strings]
    assert not missing, missing


@pytest.mark.parametrize("row", ROWS, ids=[r[0] for r in ROWS])
def test_tuning_string_forces_the_row(row):
    """launch_config parses a row's tuning string back into exactly that layout."""
    _, s, *_ = row
    with settings.override(triton_config=s):
        assert rp.tuning_string(rp.launch_config(5, 64, 128)) == s
        assert rp.tuning_string(rp.qk_norm_launch_config(5, 64, 128)) == s


@pytest.mark.parametrize("kv_dtype", [None, torch.float8_e5m2])
@pytest.mark.parametrize("row", ROWS, ids=[r[0] for r in ROWS])
def test_row_small_batch(backend, row, kv_dtype):
    """Each row's layout on a few tokens (interpreter on CPU): GPT-J, partial rotary, page 1,
    int32 slots with skips, separate q / k / v; fp8 with float scales."""
    name, s, first, last, dims, norm = row
    backend("triton")
    d = dims[0]
    case = SweepCase(
        7,
        kv_dtype=kv_dtype,
        head_dim=d,
        rot_dim=d // 2,
        neox=False,
        hq=6,
        hkv=2,
        page_size=1,
        scale="float" if kv_dtype else "none",
        loc_dtype=torch.int32,
        separate=True,
        qk_norm=norm,
        config=s,
        seed=len(name) + first,
    )
    report = run_case(case, "cuda" if torch.cuda.is_available() else "cpu")
    assert report is None, f"{name}: {case.short()}\n{report}"


GPU_CASES = row_cases() if torch.cuda.is_available() else []


@gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.short().replace(" ", "-"))
def test_row_gpu(backend, case):
    """Each row at both ends of its token range (up to 32768), bf16 / e4m3 / e5m2 caches."""
    backend("triton")
    report = run_case(case, "cuda")
    assert report is None, f"{case.short()}\n{report}"
