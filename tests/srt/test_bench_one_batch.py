"""python -m srt.bench_one_batch runs with no flags on CPU and reports matching tokens."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_no_flags_subprocess(tmp_path):
    """The README's main job, exactly as a user runs it (tiny model, CPU here)."""
    out = subprocess.run(
        [sys.executable, "-m", "srt.bench_one_batch", "--json-out", str(tmp_path / "r.json")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert lines[-1].startswith("output tokens: MATCH"), out.stdout
    assert any("prefill" in x and "tok/s" in x for x in lines)
    data = json.loads((tmp_path / "r.json").read_text())
    variants = {(r["variant"], r["batch_size"]) for r in data["results"]}
    assert variants == {("fused", 1), ("fused", 8), ("unfused", 1), ("unfused", 8)}
    for r in data["results"]:
        assert r["decode_tokens_per_s"] > 0 and len(r["output_ids"]) == r["batch_size"]
        assert all(len(o) == r["output_len"] for o in r["output_ids"])


def test_flags_paged_fp8(capsys):
    from srt.bench_one_batch import main

    results = main(
        [
            "--batch-size",
            "3",
            "--input-len",
            "7",
            "--output-len",
            "5",
            "--page-size",
            "4",
            "--kv-cache-dtype",
            "fp8_e4m3",
            "--device",
            "cpu",
        ]
    )
    assert len(results) == 2
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("output tokens: MATCH")
    only_unfused = main(
        [
            "--batch-size",
            "1",
            "--input-len",
            "4",
            "--output-len",
            "2",
            "--disable-fused-rope-kv",
            "--device",
            "cpu",
        ]
    )
    assert [r["variant"] for r in only_unfused] == ["unfused"]
